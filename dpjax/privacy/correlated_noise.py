"""Correlated noise as a privatizer: the matrix-factorisation mechanism with a banded Toeplitz
strategy (BandMF, `BandedPrivatizer`) or a buffered linear Toeplitz one (BLT, `BLTPrivatizer`).

  ĝ_t = (Σ_t + σC · w_t) / b,   w = C⁻¹ z,   z_t ~ N(0, I) per coordinate,

with C the n×n lower-triangular Toeplitz strategy of coefficients c_0..c_{k−1} (C[t, t−j] = c_j,
zero beyond k bands). Everything released is post-processing of C·X + σC·Z (X the clipped sums),
so the guarantee is the Gaussian mechanism's on X ↦ C·X, with the sensitivity of C under the
sampler's participation patterns (docs: ../shared/docs/accounting.md §9; Denisov, McMahan, Rush,
Smith, Thakurta 2022, "Improved Differential Privacy for SGD via Optimal Private Linear Operators
on Adaptive Streams"; Choquette-Choo, Ganesh, McMahan, Rush, Thakurta, Xu 2023, "(Amplified)
Banded Matrix Factorization"). DP-SGD is C = I (k = 1, c_0 = 1): the release is then
`noise.GaussianPrivatizer`'s bit for bit.

Streaming: w_t = (z_t − Σ_{j=1}^{k−1} c_j w_{t−j}) / c_0, so the state is the last k − 1 w's
(k − 1 arrays the size of the parameters, float32 at least), most recent first, and the step t
it releases next. z_t is step t's Gaussian draw of DP-SGD (fold_in(noise stream of the seed, t),
`prng.step_noise_key`); the state is part of the optimiser state (`accumulator.init_state`), so
checkpoints save it and a resumed run continues the same w's bit for bit. A step other than the
one the state expects releases NaN and marks the state refused (`noise_state.REFUSED`): the
recursion holds only for consecutive steps.

The coefficients must have unit ℓ2 norm: the sensitivity of one participation (a column of C)
is then 1 and σ is the noise multiplier the accountant composes.

BLT (Dvijotham et al. 2024): C = scale·C_blt with C_blt's c_0 = 1, c_t = Σ_i ω_i θ_i^(t−1); C w
= z is w_t = z_t − Σ_i ω_i s_i with d buffers s_i ← θ_i s_i + w_t (the state: d arrays the size
of the parameters), released as σC·w_t/scale. Both share the step check and the release
(`_released`). `correlated.strategy.Strategy.privatizer` builds the one its strategy runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax.privacy import checks as _checks
from dpjax.privacy import noise as noise_lib
from dpjax.privacy import noise_state
from dpjax.privacy import prng
from dpjax.privacy.correlated import blt as blt_lib

# |‖c‖₂ − 1| allowed: the coefficients are float64 and normalised by the strategy.
UNIT_NORM_TOLERANCE = 1e-9


class BandedNoiseState(NamedTuple):
  """The step released next (uint32; `noise_state.REFUSED` after a refused update) and the last
  k − 1 noise vectors w_{t−1}, …, w_{t−k+1}, one [k − 1, *leaf.shape] array per leaf."""

  step: jax.Array
  history: Any


def check_coefficients(coefficients) -> tuple[float, ...]:
  """c_0..c_{k−1} as floats: a non-empty finite sequence, c_0 > 0, ‖c‖₂ = 1."""
  values = np.asarray(coefficients, dtype=np.float64)
  if values.ndim != 1 or values.size == 0 or not np.all(np.isfinite(values)):
    raise ValueError(
      f'coefficients must be a non-empty 1-D sequence of finite numbers, got {coefficients!r}.'
    )
  if values[0] <= 0:
    raise ValueError(f'coefficients[0] must be > 0 (C is invertible), got {values[0]!r}.')
  norm = math.sqrt(float(np.sum(values**2)))
  if abs(norm - 1.0) > UNIT_NORM_TOLERANCE:
    raise ValueError(
      f'coefficients must have unit l2 norm (the sensitivity of one participation is then 1, '
      f'and sigma is the accounted noise multiplier), got norm {norm!r}: divide by it.'
    )
  return tuple(float(v) for v in values)


def history_dtype(dtype) -> jnp.dtype:
  """The state's dtype for a leaf of `dtype`: float32 at least (w's recursion is not rounded
  to bfloat16)."""
  return jnp.promote_types(dtype, jnp.float32)


def banded_noise(z: jax.Array, history: jax.Array, coefficients: tuple[float, ...]):
  """(w_t, new history) for one leaf: w_t = (z_t − Σ_{j≥1} c_j w_{t−j}) / c_0, elementwise in a
  fixed order (no dot product: the same bits on every device and layout, no TF32)."""
  acc = z.astype(history.dtype)
  for j, c in enumerate(coefficients[1:]):
    acc = acc - c * history[j]
  w = acc if coefficients[0] == 1.0 else acc / coefficients[0]
  if history.shape[0] == 0:
    return w, history
  return w, jnp.concatenate([w[None], history[:-1]])


def _released(leaves, noises, ok, state_step, mechanism) -> tuple[list, jax.Array]:
  """(ĝ_t per leaf, the step released next) shared by the correlated privatizers: (Σ_t + std·w_t)
  / b where `ok`, else NaN; the state's step + 1 where `ok`, else `noise_state.REFUSED`."""
  std, b = mechanism.noise_std, mechanism.expected_batch_size
  released = [
    jnp.where(ok, (s + std * w.astype(s.dtype)) / b, jnp.nan).astype(s.dtype)
    for s, w in zip(leaves, noises)
  ]
  return released, jnp.where(ok, state_step + jnp.uint32(1), jnp.uint32(noise_state.REFUSED))


def checked_release(noise_multiplier, clip_norm, expected_batch_size, seed, noise_impl) -> tuple:
  """(σ, C, b, seed, generator), each validated (`checks`, `prng`): a privatizer's release."""
  prng.check_seed(seed)
  return (
    _checks.check_noise_multiplier(noise_multiplier),
    _checks.check_clip_norm(clip_norm),
    _checks.check_expected_batch_size(expected_batch_size),
    int(seed),
    prng.check_noise_impl(noise_impl),
  )


class StreamingNoise:
  """What the correlated privatizers share: DP-SGD's key stream, a state of `state_vectors`
  parameter-sized arrays (float32 at least), and the release of a per-leaf noise recursion
  `recurse(z, memory) -> (w, memory)` (`_released`: the step check, NaN when refused)."""

  stateful: ClassVar[bool] = True

  def key_data(self) -> np.ndarray:
    return prng.noise_stream_data(self.seed, self.noise_impl)

  def state_bytes(self, params: Any) -> int:
    """Bytes of the state: state_vectors × the parameters' size × 4 (float32) or more."""
    return sum(
      self.state_vectors * int(np.size(p)) * history_dtype(jnp.result_type(p)).itemsize
      for p in jax.tree.leaves(params)
    )

  def zero_memory(self, params: Any) -> Any:
    """[state_vectors, *leaf.shape] zeros per leaf: the recursion before step 0."""
    return jax.tree.map(
      lambda p: jnp.zeros((self.state_vectors, *jnp.shape(p)), history_dtype(jnp.result_type(p))),
      params,
    )

  def stream(self, grad_sum: Any, memory: Any, state_step, step, key_data, recurse, ok):
    """(released tree, the step after, new memory tree) for this step's z of (seed, t)."""
    z = noise_lib.standard_normals_like(
      prng.step_noise_key(key_data, step, self.noise_impl), grad_sum
    )
    leaves, treedef = jax.tree.flatten(grad_sum)
    pairs = [
      recurse(zi, mi) for zi, mi in zip(treedef.flatten_up_to(z), treedef.flatten_up_to(memory))
    ]
    released, after = _released(leaves, [w for w, _ in pairs], ok, state_step, self)
    return treedef.unflatten(released), after, treedef.unflatten([m for _, m in pairs])


@dataclasses.dataclass(frozen=True)
class BandedPrivatizer(StreamingNoise):
  """ĝ_t = (Σ_t + σC · w_t) / b with w = C⁻¹z for the banded Toeplitz C of `coefficients` (module
  docstring); a `noise.Privatizer` with state. Build it with `banded` (it validates)."""

  coefficients: tuple[float, ...]
  noise_multiplier: float
  clip_norm: float
  expected_batch_size: float
  seed: int = 0
  noise_impl: str = 'threefry'

  @classmethod
  def banded(
    cls,
    coefficients,
    noise_multiplier,
    clip_norm,
    expected_batch_size,
    seed: int = 0,
    noise_impl: str = 'threefry',
  ) -> 'BandedPrivatizer':
    return cls(
      check_coefficients(coefficients),
      *checked_release(noise_multiplier, clip_norm, expected_batch_size, seed, noise_impl),
    )

  @property
  def bands(self) -> int:
    return len(self.coefficients)

  @property
  def noise_std(self) -> float:
    """σ·C on the sum."""
    return self.noise_multiplier * self.clip_norm

  @property
  def state_vectors(self) -> int:
    return self.bands - 1

  def init(self, params: Any) -> BandedNoiseState:
    return BandedNoiseState(step=jnp.zeros((), jnp.uint32), history=self.zero_memory(params))

  def release(self, grad_sum: Any, state: BandedNoiseState, step, key_data):
    ok = state.step == jnp.asarray(step, jnp.uint32)
    recurse = lambda z, h: banded_noise(z, h, self.coefficients)
    released, after, history = self.stream(
      grad_sum, state.history, state.step, step, key_data, recurse, ok
    )
    return released, BandedNoiseState(step=after, history=history)


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


# ---------------------------------------------------------------------------------------------
# BLT: buffered linear Toeplitz strategies
# ---------------------------------------------------------------------------------------------


class BLTNoiseState(NamedTuple):
  """The step released next (uint32; `noise_state.REFUSED` after a refused update) and the d
  buffers s_0..s_{d−1}, one [d, *leaf.shape] array per leaf."""

  step: jax.Array
  buffers: Any


def blt_noise(z: jax.Array, buffers: jax.Array, decays, weights):
  """(w_t, new buffers) for one leaf: w_t = z_t − Σ_i ω_i s_i, then s_i ← θ_i s_i + w_t,
  elementwise in a fixed order (as `banded_noise`: no dot, the same bits on every layout)."""
  w = z.astype(buffers.dtype)
  for i, omega in enumerate(weights):
    w = w - omega * buffers[i]
  return w, jnp.stack([theta * buffers[i] + w for i, theta in enumerate(decays)])


@dataclasses.dataclass(frozen=True)
class BLTPrivatizer(StreamingNoise):
  """ĝ_t = (Σ_t + σC·w_t/scale) / b with w = C_blt⁻¹z, C_blt the BLT of `decays` θ and `weights`
  ω (c_0 = 1, c_t = Σ_i ω_i θ_i^(t−1): `correlated.blt`; Dvijotham, McMahan, Pillutla,
  Steinke, Thakurta 2024, "Efficient and near-optimal noise generation for streaming
  differential privacy") and the strategy that runs C = scale·C_blt, of unit max column norm
  over `num_steps` (checked): σ is then the noise multiplier of one participation. The state
  is the d buffers (float32 at least) and the step released next; a step out of order, or at
  or beyond `num_steps` (C's columns would grow past norm 1), releases NaN and refuses the
  state. Build it with `blt` (it validates)."""

  decays: tuple[float, ...]
  weights: tuple[float, ...]
  scale: float
  num_steps: int
  noise_multiplier: float
  clip_norm: float
  expected_batch_size: float
  seed: int = 0
  noise_impl: str = 'threefry'

  @classmethod
  def blt(
    cls,
    decays,
    weights,
    scale,
    num_steps,
    noise_multiplier,
    clip_norm,
    expected_batch_size,
    seed: int = 0,
    noise_impl: str = 'threefry',
  ) -> 'BLTPrivatizer':
    theta, omega = blt_lib.check_blt(decays, weights)
    n = _checks.check_int('num_steps', num_steps, 1, noise_state.REFUSED - 1)
    scale = _checks.check_number('scale', scale, low=0.0)
    norm = scale * math.sqrt(float(np.sum(blt_lib.coefs(blt_lib.BLT(theta, omega), n) ** 2)))
    if abs(norm - 1.0) > UNIT_NORM_TOLERANCE:
      raise ValueError(
        f'scale must make C = scale * C_blt of unit max column norm over num_steps = {n} (1 / '
        f'the norm of c_0..c_(n-1)), got max column norm {norm!r}.'
      )
    return cls(
      tuple(float(v) for v in theta),
      tuple(float(v) for v in omega),
      float(scale),
      n,
      *checked_release(noise_multiplier, clip_norm, expected_batch_size, seed, noise_impl),
    )

  @property
  def num_buffers(self) -> int:
    return len(self.decays)

  @property
  def noise_std(self) -> float:
    """σ·C / scale on the sum (C⁻¹ = C_blt⁻¹ / scale)."""
    return self.noise_multiplier * self.clip_norm / self.scale

  @property
  def state_vectors(self) -> int:
    return self.num_buffers

  def init(self, params: Any) -> BLTNoiseState:
    return BLTNoiseState(step=jnp.zeros((), jnp.uint32), buffers=self.zero_memory(params))

  def release(self, grad_sum: Any, state: BLTNoiseState, step, key_data):
    step = jnp.asarray(step, jnp.uint32)
    ok = (state.step == step) & (step < jnp.uint32(self.num_steps))
    recurse = lambda z, s: blt_noise(z, s, self.decays, self.weights)
    released, after, buffers = self.stream(
      grad_sum, state.buffers, state.step, step, key_data, recurse, ok
    )
    return released, BLTNoiseState(step=after, buffers=buffers)


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


def state_step(opt_state: Any) -> int:
  """The step the one correlated-noise state inside an optax state releases next; one-line
  ValueError when there is none, several, or it refused a step."""
  kinds = (BandedNoiseState, BLTNoiseState)
  found = [
    leaf
    for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds))
    if isinstance(leaf, kinds)
  ]
  if len(found) != 1:
    raise ValueError(
      f'the optimiser state holds {len(found)} correlated-noise states, not 1: pass the state '
      "of `tx.init(params)` with the plan's privatizer in `tx`."
    )
  step = int(np.asarray(found[0].step))
  if step == noise_state.REFUSED:
    raise ValueError(
      'this correlated-noise state refused an update (a step other than the one it expected): '
      'the parameters after it are NaN. Resume from the last state it accepted.'
    )
  return step
