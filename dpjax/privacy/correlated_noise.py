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
import functools
import hashlib
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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
  made: jax.Array  # uint32[8]: `StreamingNoise.made_words` of the privatizer that made it.


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
  recursion_fields: ClassVar[tuple[str, ...]] = ()  # The strategy's parameters (per class).

  def key_data(self) -> np.ndarray:
    return prng.noise_stream_data(self.seed, self.noise_impl)

  def state_bytes(self, params: Any) -> int:
    """Bytes of the state: state_vectors × the parameters' size × 4 (float32) or more."""
    return sum(
      self.state_vectors * int(np.size(p)) * history_dtype(jnp.result_type(p)).itemsize
      for p in jax.tree.leaves(params)
    )

  @functools.cached_property
  def made_words(self) -> np.ndarray:
    """SHA-256 (eight uint32 words) of what the recursion's noise vectors depend on: the
    strategy's parameters, the seed (only hashed) and the generator. A state continues only
    the recursion of a privatizer with the same words; σ, C and b scale the release, not w."""
    return noise_state.digest_words(
      {
        'strategy': {f: getattr(self, f) for f in self.recursion_fields},
        'seed_sha256': hashlib.sha256(f'dpjax-noise-seed:{self.seed}'.encode()).hexdigest(),
        'noise_impl': self.noise_impl,
      }
    )

  def accepts(self, state, step) -> jax.Array:
    """(Traceable) whether `state` is at `step` and was made by a privatizer like this one (its
    eight maker words compared one by one: scalar comparisons, no reduction in the program)."""
    made = jnp.asarray(state.made, jnp.uint32)
    ok = jnp.asarray(state.step, jnp.uint32) == jnp.asarray(step, jnp.uint32)
    for i, word in enumerate(self.made_words):
      ok &= made[i] == jnp.uint32(word)
    return ok

  def zero_memory(self, params: Any) -> Any:
    """[state_vectors, *leaf.shape] zeros per leaf: the recursion before step 0."""
    return jax.tree.map(
      lambda p: jnp.zeros((self.state_vectors, *jnp.shape(p)), history_dtype(jnp.result_type(p))),
      params,
    )

  def stream(self, grad_sum: Any, memory: Any, state_step, step, key_data, recurse, ok):
    """(released tree, the step after, new memory tree) for this step's z of (seed, t); `ok`
    must include `accepts` (the state's step and its maker)."""
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
  recursion_fields: ClassVar[tuple[str, ...]] = ('coefficients',)

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
    return BandedNoiseState(
      step=jnp.zeros((), jnp.uint32),
      history=self.zero_memory(params),
      made=jnp.asarray(self.made_words),
    )

  def release(self, grad_sum: Any, state: BandedNoiseState, step, key_data):
    ok = self.accepts(state, step)
    recurse = lambda z, h: banded_noise(z, h, self.coefficients)
    released, after, history = self.stream(
      grad_sum, state.history, state.step, step, key_data, recurse, ok
    )
    return released, BandedNoiseState(step=after, history=history, made=state.made)


# ---------------------------------------------------------------------------------------------
# BLT: buffered linear Toeplitz strategies
# ---------------------------------------------------------------------------------------------


class BLTNoiseState(NamedTuple):
  """The step released next (uint32; `noise_state.REFUSED` after a refused update) and the d
  buffers s_0..s_{d−1}, one [d, *leaf.shape] array per leaf."""

  step: jax.Array
  buffers: Any
  made: jax.Array  # uint32[8]: `StreamingNoise.made_words` of the privatizer that made it.


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
  recursion_fields: ClassVar[tuple[str, ...]] = ('decays', 'weights')

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
    return BLTNoiseState(
      step=jnp.zeros((), jnp.uint32),
      buffers=self.zero_memory(params),
      made=jnp.asarray(self.made_words),
    )

  def release(self, grad_sum: Any, state: BLTNoiseState, step, key_data):
    step = jnp.asarray(step, jnp.uint32)
    ok = self.accepts(state, step) & (step < jnp.uint32(self.num_steps))
    recurse = lambda z, s: blt_noise(z, s, self.decays, self.weights)
    released, after, buffers = self.stream(
      grad_sum, state.buffers, state.step, step, key_data, recurse, ok
    )
    return released, BLTNoiseState(step=after, buffers=buffers, made=state.made)
