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

The mechanism itself is `GaussianPrivatizer` (a `Privatizer`, the compiled step's extension
point: `dpjax.privacy.dp_step.DPStep` takes one); `gaussian_privatizer` adds the step-counting
state to it, so the library and the trainer release through the same object and `noisy_mean`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax.privacy import checks as _checks
from dpjax.privacy import noise_state
from dpjax.privacy import prng

MISSING_STEP = (
  "the Gaussian privatizer's update needs step=t, the logical step whose clipped sum this "
  "is (the batch's `LogicalBatch.step`): tx.update(grad_sum.total, opt_state, params, "
  'step=t). The batch and the noise of a step share one counter.'
)


def standard_normals_like(key: jax.Array, tree: Any) -> Any:
  """N(0, 1) per coordinate of `tree`: bit for bit `optax.tree.random_like(key, tree,
  jax.random.normal)` (leaf i from key i of split(key, L), drawn in the leaf's shape and
  dtype), but the leaves of one shape and dtype are drawn by one vmapped sampler. Each sampler
  is a threefry program, so L leaves compiled L of them (40 leaves, XLA CPU at O0: 5.0 -> 0.6
  s of CPU to trace and compile); vmapping over keys changes no bit (tests/privacy/test_noise.py).

  Layout-free: with `jax_threefry_partitionable` (JAX's default) coordinate j of a leaf is a
  function of (key, j) only, so a leaf split over a mesh draws each shard's normals on its
  own device, bit-identical to the one-device draw (tests/privacy/test_param_sharding.py).
  A flat draw reshaped would not split that way: the partitioner cannot slice [n] into the
  shards of [a, b] split on b, and each device would draw the whole leaf."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  groups: dict[tuple[tuple[int, ...], Any], list[int]] = {}
  for i, leaf in enumerate(leaves):
    groups.setdefault((tuple(leaf.shape), jnp.dtype(leaf.dtype)), []).append(i)
  normals = [None] * len(leaves)
  for (shape, dtype), members in groups.items():
    draw = jax.vmap(lambda k, shape=shape, dtype=dtype: jax.random.normal(k, shape, dtype))
    drawn = draw(keys[np.asarray(members)])
    for row, i in enumerate(members):
      normals[i] = drawn[row]
  return jax.tree.unflatten(treedef, normals)


def add_noise(grad_sum: Any, key: jax.Array, std: float) -> Any:
  """grad_sum + N(0, std² I), one standard normal per coordinate from `key`."""
  noise = standard_normals_like(key, grad_sum)
  return jax.tree.map(lambda s, z: s + std * z.astype(s.dtype), grad_sum, noise)


def noisy_mean(grad_sum: Any, key: jax.Array, std: float | None, expected_batch_size: float) -> Any:
  """ĝ = (grad_sum + N(0, std² I)) / b: the Gaussian mechanism of one logical step, the one
  place dpjax adds DP-SGD's noise and divides by b (the privatizer's update and the trainer's
  step both call it). std: σ·C (None: no noise, the non-private baseline); b: the sampler's
  expected batch size, never the rows present."""
  noisy = grad_sum if std is None else add_noise(grad_sum, key, std)
  return jax.tree.map(lambda g: g / expected_batch_size, noisy)


class Privatizer(Protocol):
  """What the DP step asks of its noise mechanism: the step's one extension point.

  The step clips and sums (`clipping`), then calls `release` once per logical step t with
  the sum over its K physical batches, then the optimizer. The Gaussian mechanism below is
  stateless; a correlated-noise mechanism (matrix factorisation: Choquette-Choo et al. 2023,
  "Multi-Epoch Matrix Factorization Mechanisms for Private Machine Learning") is one new
  class with `stateful = True`: the step carries its state beside the optimiser's,
  `(noise state, optimiser state)`, so checkpoints save it and nothing else changes.
  """

  clip_norm: float | None  # C, the bound of each clipped contribution (None: not private).
  noise_multiplier: float  # σ (0: no noise).
  expected_batch_size: float  # b, the divisor.
  seed: int  # The run's secret seed.
  stateful: bool

  def key_data(self) -> np.ndarray:
    """The seed's key data, passed to `release` as a program argument (not a constant)."""

  def init(self, params: Any) -> Any:
    """The mechanism's state before step 0 (None when stateless)."""

  def release(self, grad_sum: Any, state: Any, step, key_data) -> tuple[Any, Any]:
    """(ĝ_t, state): step t's release of the clipped sum."""


@dataclasses.dataclass(frozen=True)
class GaussianPrivatizer:
  """ĝ_t = (grad_sum + N(0, σ²C² I)) / b, the noise of step t drawn from
  fold_in(noise stream of the seed, t) (`prng.step_noise_key`); stateless, so a resumed run
  redraws exactly the noise of an uninterrupted one. `clip_norm` None: the non-private
  baseline (no noise, ÷ b only). Build it with `gaussian` or `no_noise` (they validate).
  """

  noise_multiplier: float
  clip_norm: float | None
  expected_batch_size: float
  seed: int = 0
  noise_impl: str = 'threefry'
  stateful: ClassVar[bool] = False

  @classmethod
  def gaussian(
    cls, noise_multiplier, clip_norm, expected_batch_size, seed: int = 0, noise_impl='threefry'
  ) -> 'GaussianPrivatizer':
    """The private mechanism: σ > 0 and C finite > 0 (anything else has no guarantee)."""
    return cls(
      _checks.check_noise_multiplier(noise_multiplier),
      _checks.check_clip_norm(clip_norm),
      _checks.check_expected_batch_size(expected_batch_size),
      _seed(seed),
      prng.check_noise_impl(noise_impl),
    )

  @classmethod
  def no_noise(cls, expected_batch_size, seed: int = 0) -> 'GaussianPrivatizer':
    """The non-private baseline: Σ_i w_i · g_i / b."""
    return cls(0.0, None, _checks.check_expected_batch_size(expected_batch_size), _seed(seed))

  @classmethod
  def of(
    cls, private: bool, noise_multiplier, clip_norm, expected_batch_size, seed=0, impl='threefry'
  ) -> 'GaussianPrivatizer':
    """`gaussian(...)` if private, else `no_noise(expected_batch_size, seed)`."""
    if private:
      return cls.gaussian(noise_multiplier, clip_norm, expected_batch_size, seed, impl)
    return cls.no_noise(expected_batch_size, seed)

  @property
  def noise_std(self) -> float | None:
    """σ·C on the sum; None when nothing is noised."""
    return None if self.clip_norm is None else self.noise_multiplier * self.clip_norm

  def key_data(self) -> np.ndarray:
    return prng.noise_stream_data(self.seed, self.noise_impl)

  def init(self, params: Any) -> None:
    del params

  def release(self, grad_sum: Any, state: None, step, key_data) -> tuple[Any, None]:
    key = prng.step_noise_key(key_data, step, self.noise_impl)
    return noisy_mean(grad_sum, key, self.noise_std, self.expected_batch_size), state


def _seed(seed: int) -> int:
  prng.check_seed(seed)
  return int(seed)


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
  mechanism = GaussianPrivatizer.gaussian(
    noise_multiplier, clip_norm, expected_batch_size, seed, noise_impl
  )
  sigma, c, b = mechanism.noise_multiplier, mechanism.clip_norm, mechanism.expected_batch_size
  cap = _checks.check_int('max_batch_size', max_batch_size, 0)
  stream = mechanism.key_data()
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
    mean, _ = mechanism.release(updates, None, state.step, stream)
    released = jax.tree.map(lambda g: jnp.where(ok, g, jnp.nan).astype(g.dtype), mean)
    after = jnp.where(ok, state.step + jnp.uint32(1), jnp.uint32(noise_state.REFUSED))
    return released, state._replace(step=after)

  return optax.GradientTransformationExtraArgs(init, update)
