"""The Gaussian mechanism of DP-SGD as an optax transform: noise once per logical step, then ÷ b.

  ĝ_t = (Σ_i w_i · clip_C(g_i) + N(0, σ²C² I)) / b

(Abadi et al. 2016, "Deep Learning with Differential Privacy", Alg. 1): the input is the
*sum* of the clipped per-example gradients of logical step t, the noise std on that sum is
σ·C, and b is the sampler's expected batch size (q·N for Poisson, b for fixed-size
samplers), never the realised count (dividing by a data-dependent count changes the
sensitivity; Beltran et al., "Towards Efficient and Scalable Training of Differentially
Private Deep Learning").

The update is told which logical step its sum belongs to, `update(sum, state, params,
step=t)`, with t the logical batch's own (`LogicalBatch.step`): the noise of step t is drawn
from fold_in(noise stream of the seed, t) (`dpjax.privacy.prng`), and the state
(`noise_state.GaussianNoiseState`) accepts only the t it expects next, and only if it was
made with this transform's σ, C, b, B and fingerprint. A step repeated, skipped or noised
from another plan's state releases NaN instead of the sum and marks the state refused (a
jitted update cannot raise; `noise_state.check` says why on the host). So a batch and its
noise share one counter, each step's noise is used once, and a run resumed from a saved
state redraws exactly the noise of an uninterrupted one. The seed is an argument of the
transform and never enters the state (which checkpoints save); the guarantee needs it to be
secret (draw it with `secrets.randbits(63)`).

  privatizer = dpjax.gaussian_privatizer(noise_multiplier=1.1, clip_norm=1.0,
                                         expected_batch_size=256, seed=seed)
  tx = optax.chain(privatizer, optax.adam(1e-3))   # tx.update(clipped_sum, state, params, step=t)
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax

from dpjax.privacy import checks as _checks
from dpjax.privacy import noise_state
from dpjax.privacy import prng

MISSING_STEP = (
  "the Gaussian privatizer's update needs step=t, the logical step whose clipped sum this "
  "is (the batch's `LogicalBatch.step`): tx.update(grad_sum.total, opt_state, params, "
  'step=t). The batch and the noise of a step share one counter.'
)


def add_noise(grad_sum: Any, key: jax.Array, std: float) -> Any:
  """grad_sum + N(0, std² I), one standard normal per coordinate from `key`."""
  noise = optax.tree.random_like(key, grad_sum, jax.random.normal)
  return jax.tree.map(lambda s, z: s + std * z.astype(s.dtype), grad_sum, noise)


def noisy_mean(grad_sum: Any, key: jax.Array, std: float | None, expected_batch_size: float) -> Any:
  """ĝ = (grad_sum + N(0, std² I)) / b: the Gaussian mechanism of one logical step, the one
  place dpjax adds DP-SGD's noise and divides by b (the privatizer's update and the trainer's
  step both call it). std: σ·C (None: no noise, the non-private baseline); b: the sampler's
  expected batch size, never the rows present."""
  noisy = grad_sum if std is None else add_noise(grad_sum, key, std)
  return jax.tree.map(lambda g: g / expected_batch_size, noisy)


def gaussian_privatizer(
  noise_multiplier: float,
  clip_norm: float,
  expected_batch_size: float,
  seed: int,
  *,
  max_batch_size: int = 0,
  fingerprint: Mapping[str, Any] | None = None,
  noise_impl: str = 'threefry',
) -> optax.GradientTransformationExtraArgs:
  """An optax transform mapping Σ_i w_i · clip_C(g_i) of step t to ĝ_t (module docstring).

  Args:
    noise_multiplier: σ > 0 (finite); the noise std on the sum is σ·C.
    clip_norm: C (finite, > 0), the bound each clipped contribution obeys.
    expected_batch_size: b, the sampler's `expected_batch_size`.
    seed: the run's secret seed, an integer in [0, 2**64).
    max_batch_size: B, the batcher's cap (0: not given), kept in the state.
    fingerprint: what enters ε (`PrivacyPlan.fingerprint`), kept in the state as its
      SHA-256; None: σ, C, b, B and the noise stream of the seed.
    noise_impl: the JAX generator (`prng.NOISE_IMPLS`: 'threefry', 'rbg', 'unsafe_rbg').

  Returns:
    `init(params)` and `update(updates, state, params=None, *, step)`; `update` raises
    TypeError (when traced) without `step`.
  """
  sigma = _checks.check_noise_multiplier(noise_multiplier)
  c = _checks.check_clip_norm(clip_norm)
  std = sigma * c
  b = _checks.check_expected_batch_size(expected_batch_size)
  cap = _checks.check_int('max_batch_size', max_batch_size, 0)
  stream = prng.noise_stream_data(seed, noise_impl)
  if fingerprint is None:
    fingerprint = {
      'noise_multiplier': sigma,
      'clip_norm': c,
      'expected_batch_size': b,
      'max_batch_size': cap,
      'noise_stream': stream.tolist(),
    }
  made = noise_state.made_with(sigma, c, b, cap, fingerprint)

  def init(params):
    del params
    return jax.tree.map(jnp.asarray, made)

  def update(updates, state, params=None, *, step=None, **extra_args):
    del params, extra_args
    if step is None:
      raise TypeError(MISSING_STEP)
    ok = noise_state.accepts(state, made, step)
    key = prng.step_noise_key(stream, state.step, noise_impl)
    mean = noisy_mean(updates, key, std, b)
    released = jax.tree.map(lambda g: jnp.where(ok, g, jnp.nan).astype(g.dtype), mean)
    after = jnp.where(ok, state.step + jnp.uint32(1), jnp.uint32(noise_state.REFUSED))
    return released, state._replace(step=after)

  return optax.GradientTransformationExtraArgs(init, update)
