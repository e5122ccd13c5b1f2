"""The optax face of the correlated-noise privatizers (`correlated_noise`): each as an optax
transform for a loop of one's own, and the step a transform's state releases next.

  tx = optax.chain(banded_privatizer(coefs, 1.1, 1.0, 256, seed), optax.sgd(0.1))
  updates, state = tx.update(clipped_sum, state, params, step=t)   # t: the logical step

`PrivacyPlan.privatizer()` builds these from the plan's strategy (`as_optax`), and
`PrivacyPlan.batcher()` starts at `state_step` of the state it is given.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optax

from dpjax.privacy import noise as noise_lib
from dpjax.privacy import noise_state
from dpjax.privacy.correlated_noise import BandedNoiseState
from dpjax.privacy.correlated_noise import BandedPrivatizer
from dpjax.privacy.correlated_noise import BLTNoiseState
from dpjax.privacy.correlated_noise import BLTPrivatizer
from dpjax.privacy.correlated_noise import StreamingNoise


def banded_privatizer(
  coefficients,
  noise_multiplier: float,
  clip_norm: float,
  expected_batch_size: float,
  seed: int,
  *,
  noise_impl: str = 'threefry',
) -> optax.GradientTransformationExtraArgs:
  """An optax transform mapping Σ_i w_i · clip_C(g_i) of step t to ĝ_t = (Σ_t + σC·(C⁻¹z)_t) / b
  (module docstring): `init(params)` is the `BandedNoiseState` at step 0, `update(sum, state,
  params=None, *, step=t)` releases step t (NaN, and a refused state, for any other t).

    tx = optax.chain(banded_privatizer(coefs, 1.1, 1.0, 256, seed), optax.sgd(0.1))
  """
  mechanism = BandedPrivatizer.banded(
    coefficients, noise_multiplier, clip_norm, expected_batch_size, seed, noise_impl
  )
  return as_optax(mechanism, 'banded')


def as_optax(mechanism, name: str = 'correlated') -> optax.GradientTransformationExtraArgs:
  """The optax pair of a correlated privatizer (`BandedPrivatizer`, `BLTPrivatizer`): init = its
  state at step 0, update releases the step it is told (TypeError without `step`)."""
  stream = mechanism.key_data()

  def update(updates, state, params=None, *, step=None, **extra_args):
    del params, extra_args
    if step is None:
      raise TypeError(noise_lib.MISSING_STEP.replace('Gaussian', name))
    return mechanism.release(updates, state, step, stream)

  return optax.GradientTransformationExtraArgs(mechanism.init, update)


def blt_privatizer(
  decays,
  weights,
  scale: float,
  num_steps: int,
  noise_multiplier: float,
  clip_norm: float,
  expected_batch_size: float,
  seed: int,
  *,
  noise_impl: str = 'threefry',
) -> optax.GradientTransformationExtraArgs:
  """An optax transform mapping Σ_i w_i · clip_C(g_i) of step t to ĝ_t = (Σ_t + σC·(C⁻¹z)_t) / b
  for the BLT strategy C = scale·C_blt (`BLTPrivatizer`): `init(params)` is the `BLTNoiseState`
  at step 0, `update(sum, state, params=None, *, step=t)` releases step t (NaN, and a refused
  state, for any other t). `Strategy.privatizer` of `correlated.strategy` builds the mechanism.

    tx = optax.chain(blt_privatizer(theta, omega, scale, n, 1.1, 1.0, 256, seed), optax.sgd(0.1))
  """
  mechanism = BLTPrivatizer.blt(
    decays,
    weights,
    scale,
    num_steps,
    noise_multiplier,
    clip_norm,
    expected_batch_size,
    seed,
    noise_impl,
  )
  return as_optax(mechanism, 'BLT')


def state_step(opt_state: Any, privatizer: StreamingNoise | None = None) -> int:
  """The step the one correlated-noise state inside an optax state releases next; one-line
  ValueError when there is none, several, it refused a step, or (given `privatizer`) another
  privatizer made it (another strategy, seed or generator: its noise history is not this
  recursion's)."""
  found = noise_state.find(opt_state, (BandedNoiseState, BLTNoiseState), 'correlated-noise')
  step = int(np.asarray(found.step))
  if step == noise_state.REFUSED:
    raise ValueError(
      'this correlated-noise state refused an update (a step other than the one it expected, '
      'or a state of another privatizer): the parameters after it are NaN. Resume from the last '
      'state it accepted.'
    )
  if privatizer is not None and not np.array_equal(
    np.asarray(found.made, np.uint32), privatizer.made_words
  ):
    raise ValueError(
      'the correlated-noise state was made by another privatizer (another strategy, seed or '
      "generator): it cannot continue this plan's noise. Resume with the plan that made it."
    )
  return step
