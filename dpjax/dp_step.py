"""The DP-SGD logical step with virtual batching (PRNG streams: `dpjax.prng`).

A logical step t is K ≥ 0 physical batches of the same static shape P (K
varies with the sampled batch size; K = 0 happens under Poisson sampling):

  acc = init_accumulator(params)
  for batch in physical_batches:            # K times, one compiled program
    acc = accumulate(params, acc, batch)    # += Σ_i w_i · clip_C(g_i)
  params, opt_state, metrics = apply(params, opt_state, acc, t)   # noise of (seed, t)

The trainer runs the same computation as ONE compiled program per logical
step, `train_step(params, opt_state, logical, K, t)`: a `lax.fori_loop` over
the first K physical batches of a fixed-shape buffer [K_max = B/P, P, ...]
(K is data, so every step reuses one executable), the noise key derived
inside the program from (seed, t) with the same bits as `noise_key`, the
division by b and the optax update; params and optimiser state are donated.
Given a `device_data.DeviceDataset`, the buffer holds only int32 row indices
and weights, and each physical batch is gathered and normalised on the
device inside the loop.

`apply` releases  ĝ = (Σ_i w_i · clip_C(g_i) + N(0, σ²C² I)) / b  and takes an
optax step on ĝ. The noise is added ONCE per logical step, to the sum over all
K physical batches (Abadi et al. 2016, Alg. 1; docs/accounting.md: noise std
on the *sum* of clipped gradients is σ·C), and the divisor is the sampler's
`expected_batch_size` b (q·N for Poisson, b for fixed-size samplers), never
the realised number of rows: dividing by a data-dependent count would change
the sensitivity (seed 002; optax's `differentially_private_aggregate` makes
this mistake for padded / Poisson batches).

With `private=False` the same pipeline runs without clipping or noise, so the
update is SGD on Σ_i w_i · g_i / b (the mean gradient when b is the number of
rows).

Models must be per-example (no BatchNorm) and deterministic (no dropout), see
`dpjax.models`. Metrics are monitoring values computed from the raw batch:
they are NOT differentially private and must not be released as if they were.

Data parallelism: given a `mesh` (see `dpjax.sharding`), each physical
batch is split over the mesh's 'data' axis and everything else is replicated;
the sum over the batch inside `accumulate` becomes a cross-device reduction
chosen by the compiler, and `apply` (noise included) runs on replicated
inputs, so the noise is drawn once per logical step from the same key and the
update is the same on every device.

Randomness: the Gaussian noise comes from JAX's Threefry PRNG keyed by
(seed, NOISE_STREAM, step). It is reproducible, not a cryptographically secure
sampler (the usual caveat for floating-point DP implementations).
"""

import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax import augmult as augmult_lib
from dpjax import clipping as clipping_lib
from dpjax import precision as precision_lib
from dpjax import noise as noise_lib
from dpjax import privacy_plan
from dpjax import prng
# Re-exported: the step's PRNG streams and loss, where users found them before.
from dpjax.losses import LABEL_FORMATS, eval_step, make_loss_fn  # noqa: F401 pylint: disable=unused-import
from dpjax.prng import INIT_STREAM, NOISE_STREAM, init_params, noise_key  # pylint: disable=unused-import
from dpjax import sharding

Params = Any
Batch = dict[str, jax.Array]

PHYSICAL_LOOPS = ('auto', 'device', 'host')


def _kahan_add(total: Params, compensation: Params, g: Params) -> tuple[Params, Params]:
  """total + g with Kahan's compensation (Higham 2002, §4.3): error O(u)·|total|, not O(K·u)."""
  def add(s, c, x):
    y = x - c
    t = s + y
    return t, (t - s) - y
  pairs = jax.tree.map(add, total, compensation, g)
  outer = jax.tree.structure(total)
  return jax.tree.transpose(outer, jax.tree.structure((0, 0)), pairs)


class Accumulator(NamedTuple):
  """Running sums over the physical batches of one logical step.

  `grad_sum` is a compensated (Kahan) sum over the physical batches: `compensation`
  holds the low-order bits each float32 addition lost, so the sum's rounding error does
  not grow with the number of batches (`precision.sum_margin`).
  """
  grad_sum: Params  # Σ_i w_i · clip_C(g_i) (private) or Σ_i w_i · g_i.
  stats: clipping_lib.ClipStats
  compensation: Params  # −(the rounding error of grad_sum so far), per coordinate.


class DPStep:
  """DP-SGD (or non-private SGD) logical step over K physical batches.

  `accumulate` and `apply` are each compiled once: all physical batches share
  one static shape and every per-step quantity (K, the number of real rows,
  the noise key) is data, not a trace-time constant.

  Warning: `accumulate` and `apply` donate the accumulator passed to them;
  use the returned one and start each step from `init_accumulator`.
  """

  def __init__(self, model: nn.Module,
               optimizer: optax.GradientTransformation, *,
               clip_norm: float | None, noise_multiplier: float | None,
               expected_batch_size: float, private: bool = True,
               clipping: str = 'auto', label_format: str = 'int',
               mesh: jax.sharding.Mesh | None = None, seed: int = 0,
               precision: str = 'default', physical_loop: str = 'auto',
               sum_fn_wrapper=None, augmult: augmult_lib.Augmult | None = None,
               max_batch_size: int | None = None, loss: str = 'softmax_cross_entropy',
               noise_impl: str = 'threefry'):
    """Validates everything before any compute.

    Args:
      model: a dpjax.models module (per-example, deterministic).
      optimizer: applied to the noisy mean gradient ĝ.
      clip_norm: C, finite and > 0. Ignored if not private.
      noise_multiplier: σ > 0 (finite); noise std on the summed gradient is
        σ·C. Ignored if not private.
      expected_batch_size: b > 0, the sampler's `expected_batch_size`.
      private: False runs the non-private baseline (no clipping, no noise).
      clipping: `config.privacy.clipping`: 'auto' (ghost clipping when it
        covers every parameter of the model, else per-example gradients, with
        a log line), 'vmap' or 'ghost' (see `dpjax.clipping`). Decided when
        `accumulate` is first traced; a model 'ghost' does not cover raises
        ValueError there, before any compute.
      label_format: 'int' labels [P] or 'one_hot' [P, classes].
      noise_impl: the JAX generator of the noise (`prng.NOISE_IMPLS`; threefry, the
        default, draws the bits `prng.noise_key` names).
      loss: the per-example loss (`losses.LOSSES`: softmax_cross_entropy, mse,
        sequence_cross_entropy).
      mesh: data-parallel device mesh (`sharding.make_mesh`): batches are
        sharded over its 'data' axis, params / optimiser state / accumulator
        replicated, outputs replicated. P must be a multiple of its size.
        None: run where the inputs are (one device).
      seed: the run's secret seed; step t's noise is drawn from
        noise_key(seed, t) (`dpjax.prng`), inside the program.
      precision: `config.precision` ('default', 'highest', 'bfloat16'; see
        `dpjax.precision`): examples are clipped to `clip_bound` = C / ((1 +
        margin of the mode)(1 + sum_margin(B))) so that each contribution as
        summed has norm ≤ C, and so has the difference of the float32 sums
        over neighbouring datasets; the noise std stays σ·C.
      physical_loop: how `train_step` loops over the K physical batches:
        'device' (one program, a while loop inside: one dispatch per logical
        step), 'host' (K dispatches of a program that slices batch i of the
        device-resident buffer, then one that noises and updates: the same
        result), or 'auto' = 'host' on the CPU backend for models with
        convolution kernels (XLA:CPU runs convolution weight gradients inside
        a while loop 25-100x slower than at top level: measured 4.4 s vs
        0.05 s for a 3x3x64x64 conv's weight gradient), else 'device'.
      sum_fn_wrapper: optional f(sum_fn) -> sum_fn applied to the physical batch's
        clipped-sum function (e.g. `auditing.with_gradient_canaries`).
      augmult: augmentation multiplicity (`dpjax.augmult.Augmult`; None or
        K <= 1 = off). `train_step` makes K views of each row on the device
        (keys from (seed, step, example index): the logical buffer must carry
        'index'); each example's gradient is the mean over its views, clipped
        once. The low-level `accumulate` then takes batch['x'] as views
        [P, K, ...] (`augmult.make_views`).
      max_batch_size: B, the most rows one logical step sums (the batcher's cap;
        `from_plan` passes the plan's). None assumes DEFAULT_MAX_ROWS = 65,536,
        which clips 7.8% below C: pass B.
    """
    if physical_loop not in PHYSICAL_LOOPS:
      raise ValueError(f'physical_loop={physical_loop!r}; valid: {PHYSICAL_LOOPS}.')
    self.physical_loop = physical_loop
    prng.check_seed(seed)
    self.precision = precision_lib.check_precision(precision)
    if not (hasattr(optimizer, 'init') and hasattr(optimizer, 'update')):
      raise ValueError('optimizer must be an optax.GradientTransformation.')
    b = float(expected_batch_size)
    if not (b > 0 and math.isfinite(b)):
      raise ValueError('expected_batch_size must be finite and > 0 (the '
                       "sampler's expected_batch_size), got "
                       f'{expected_batch_size!r}.')
    self.model = model
    self.optimizer = optimizer
    self.private = bool(private)
    self.expected_batch_size = b
    self.label_format = label_format
    self.augmult = augmult if augmult is not None and augmult.num_views > 1 else None
    loss_fn = make_loss_fn(model, label_format, precision, views=self.augmult is not None,
                           loss=loss)
    if self.private:  # σ > 0 and C finite: anything else releases without a guarantee.
      self.clip_norm = noise_lib.check_clip_norm(clip_norm)
      self.noise_multiplier = noise_lib.check_noise_multiplier(noise_multiplier)
      self.max_batch_size = (clipping_lib.DEFAULT_MAX_ROWS if max_batch_size is None
                             else max_batch_size)
      self.clip_bound = precision_lib.summed_clip_norm(self.clip_norm, precision,
                                                       self.max_batch_size)
      self._sum_fn = clipping_lib.make_clipped_sum_fn(
          clipping, loss_fn, self.clip_bound)
      self._choice = self._sum_fn.choice  # Filled when first traced ('auto', 'ghost').
    else:
      if clipping not in clipping_lib.CLIPPING_METHODS:
        raise ValueError(f'config.privacy.clipping={clipping!r}; valid: '
                         f'{clipping_lib.CLIPPING_METHODS}.')
      self.clip_norm = self.clip_bound = self.max_batch_size = None
      self.noise_multiplier = 0.0
      self._sum_fn = functools.partial(clipping_lib.grad_sum, loss_fn)
      self._choice = []
    if sum_fn_wrapper is not None:  # e.g. audit canaries: (params, batch) -> (sum, stats).
      self._sum_fn = sum_fn_wrapper(self._sum_fn)
    self.seed = seed
    # The seed's key data, an argument of every program (not a constant in it): one
    # compilation, and one persistent cache entry, serve every run whatever its secret seed.
    self.noise_impl = prng.check_noise_impl(noise_impl)
    self.keys = {'noise': prng.noise_stream_data(seed, noise_impl),
                 'views': augmult_lib.stream_data(seed)}
    self._traces = {'accumulate': 0, 'apply': 0, 'train_step': 0}
    self.sizing_compiles = 0  # Programs compiled only for their memory analysis (P = 0).
    self._step_bytes = {}  # physical_batch.compiled_step_bytes, by shapes.
    self.mesh = mesh
    if mesh is None:
      self.accumulate = jax.jit(self._accumulate, donate_argnums=(1,))
      self._apply_jit = jax.jit(self._apply, donate_argnums=(2,))
      self._zeros = self._zero_accumulator
      self._train_step = jax.jit(self._fused_step, donate_argnums=(0, 1))
      self._accumulate_at = jax.jit(self._accumulate_at_fn, donate_argnums=(1,))
      self._apply_at = jax.jit(self._apply_at_fn, donate_argnums=(0, 1))
      self._logical_sharding = None
    else:
      state, batch = sharding.replicated(mesh), sharding.batch_sharding(mesh)
      self.accumulate = jax.jit(
          self._accumulate, in_shardings=(state, state, batch),
          out_shardings=state, donate_argnums=(1,))
      self._apply_jit = jax.jit(self._apply, in_shardings=state,
                                out_shardings=state, donate_argnums=(2,))
      self._zeros = jax.jit(self._zero_accumulator, out_shardings=state)
      self._train_step = jax.jit(
          self._fused_step,
          in_shardings=(state, state, sharding.logical_batch_sharding(mesh),
                        state, state, state, state),
          out_shardings=state, donate_argnums=(0, 1))
      self._logical_sharding = sharding.logical_batch_sharding(mesh)
      self._accumulate_at = jax.jit(
          self._accumulate_at_fn,
          in_shardings=(state, state, self._logical_sharding, state, state, state, state),
          out_shardings=state, donate_argnums=(1,))
      self._apply_at = jax.jit(self._apply_at_fn, in_shardings=state,
                               out_shardings=state, donate_argnums=(0, 1))

  @classmethod
  def from_plan(cls, model, optimizer: optax.GradientTransformation,
                plan: privacy_plan.PrivacyPlan, **kwargs) -> 'DPStep':
    """The DP step of a `PrivacyPlan`: σ, C, the divisor b and the seed are the plan's.

    They (and the cap B, which sets the float32 sum's margin) cannot be passed here, so the
    step that runs and the accountant that reports cannot disagree; `kwargs` are the other
    `DPStep` arguments (clipping, mesh, ...).
    """
    taken = sorted(set(kwargs) & {'clip_norm', 'noise_multiplier', 'expected_batch_size',
                                  'seed', 'private', 'max_batch_size'})
    if taken:
      raise TypeError(f'DPStep.from_plan: {", ".join(taken)} come from the plan.')
    return cls(model, optimizer, clip_norm=plan.clip_norm,
               noise_multiplier=plan.noise_multiplier,
               expected_batch_size=plan.expected_batch_size, seed=plan.seed, private=True,
               max_batch_size=plan.max_batch_size, **kwargs)

  def loop_mode(self, params: Params) -> str:
    """'device' or 'host': how `train_step` runs for these params (see physical_loop)."""
    if self.physical_loop != 'auto':
      return self.physical_loop
    convolutional = any(jnp.ndim(leaf) >= 3 for leaf in jax.tree.leaves(params))
    return 'host' if jax.default_backend() == 'cpu' and convolutional else 'device'

  def train_step(self, params: Params, opt_state: optax.OptState,
                 logical: Batch, num_batches, step, dataset=None):
    """One whole logical step as one compiled program (one dispatch).

    Equals init_accumulator, `accumulate` over logical[:K], then `apply` with
    noise_key(self.seed, step), up to float reassociation. With
    `loop_mode(params) == 'host'` (CPU and convolutions, see physical_loop)
    the same computation runs as K + 1 dispatches of two compiled programs
    (pass K as a host integer there).

    Args:
      params, opt_state: donated; use the returned ones.
      logical: the logical batch as a buffer with a leading axis K_max
        (= B/P, fixed for the run): {'x': [K_max, P, ...], 'y': [K_max, P
        (, classes)], 'weight': [K_max, P]}, or with `dataset`
        {'index': int32 [K_max, P], 'weight': [K_max, P]}
        (`device_data.index_buffer` / `host_buffer` build them). Physical
        batches K.. are never read.
      num_batches: K, the number of non-empty physical batches (int32, data:
        it varies with no recompilation); clamped to [0, K_max].
      step: the 0-based logical step t (uint32 or int32 data, < 2**32).
      dataset: a `device_data.DeviceDataset` holding the raw training set on
        the device, or None when `logical` carries the rows themselves.

    Returns:
      (params, opt_state, metrics) as `apply`.
    """
    if self.loop_mode(params) == 'device':
      return self._train_step(params, opt_state, logical, num_batches, step,
                              dataset, self.keys)
    # 'host': the buffer goes to the device once; K small dispatches read it.
    logical = jax.device_put(logical, self._logical_sharding)
    k_max = jax.tree.leaves(logical)[0].shape[0]
    acc = self._zeros(params)
    for i in range(min(max(int(num_batches), 0), k_max)):
      acc = self._accumulate_at(params, acc, logical, np.int32(i), step, dataset, self.keys)
    return self._apply_at(params, opt_state, acc, step, self.keys)

  def apply(self, params: Params, opt_state: optax.OptState, acc: Accumulator, step):
    """ĝ = (acc.grad_sum + N(0, σ²C²)) / b with the noise of (this step's seed, `step`); one
    optax step on ĝ. Donates `acc`."""
    return self._apply_jit(params, opt_state, acc, step, self.keys)

  def _accumulate_at_fn(self, params, acc, logical, i, step, dataset, keys):
    self._traces['train_step'] += 1
    with precision_lib.matmul_precision(self.precision):
      return self._add_batch(params, acc,
                             self._physical_batch(logical, i, step, dataset, keys))

  def _apply_at_fn(self, params, opt_state, acc, step, keys):
    self._traces['train_step'] += 1
    with precision_lib.matmul_precision(self.precision):
      return self._update(params, opt_state, acc, self._noise_key(keys, step))

  def _physical_batch(self, logical: Batch, i, step, dataset, keys) -> Batch:
    """Physical batch i of a logical buffer, gathered from `dataset` if given;
    with augmult, its x becomes the rows' views [P, K, ...] (made here, on the
    device, from (seed, step, batch['index']))."""
    batch = jax.tree.map(
        lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), logical)
    if dataset is not None:
      batch = dataset.gather(batch['index']) | {'weight': batch['weight'],
                                                'index': batch['index']}
    if self.augmult is not None:
      if 'index' not in batch:
        raise ValueError("augmult: the logical buffer must carry each row's example "
                         "'index' (device_data.index_buffer / host_buffer do).")
      batch = batch | {'x': self.augmult.views(batch['x'], batch['index'], step,
                                               seed=keys['views'])}
    return batch

  def _fused_step(self, params: Params, opt_state: optax.OptState,
                  logical: Batch, num_batches, step, dataset, keys):
    self._traces['train_step'] += 1
    with precision_lib.matmul_precision(self.precision):
      return self._fused_body(params, opt_state, logical, num_batches, step,
                              dataset, keys)

  def logical_step(self, params, opt_state, logical, num_batches, step, dataset=None,
                   keys=None):
    """`train_step`'s computation, untraced and unjitted, in the step's precision: to embed
    in a larger program (`dpjax.multi_step`, which passes `self.keys` as an argument)."""
    with precision_lib.matmul_precision(self.precision):
      return self._fused_body(params, opt_state, logical, num_batches, step, dataset,
                              self.keys if keys is None else keys)

  def _fused_body(self, params, opt_state, logical, num_batches, step,
                  dataset, keys):
    k_max = jax.tree.leaves(logical)[0].shape[0]
    k = jnp.clip(jnp.asarray(num_batches, jnp.int32), 0, k_max)

    def body(i, acc):
      return self._add_batch(params, acc,
                             self._physical_batch(logical, i, step, dataset, keys))

    acc = jax.lax.fori_loop(0, k, body, self._zero_accumulator(params))
    return self._update(params, opt_state, acc, self._noise_key(keys, step))

  def _noise_key(self, keys: dict, step) -> jax.Array:
    """Step t's noise key from the noise stream's key data (an argument of the program)."""
    return prng.step_noise_key(keys['noise'], step, self.noise_impl)

  def init_accumulator(self, params: Params) -> Accumulator:
    """Zero sums with the structure of params (replicated over the mesh)."""
    return self._zeros(params)

  @staticmethod
  def _zero_accumulator(params: Params) -> Accumulator:
    zeros = lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return Accumulator(zeros(), clipping_lib.ClipStats.zeros(), zeros())

  def _accumulate(self, params: Params, acc: Accumulator,
                  batch: Batch) -> Accumulator:
    """acc + this physical batch's Σ_i w_i · clip_C(g_i) and statistics."""
    self._traces['accumulate'] += 1
    with precision_lib.matmul_precision(self.precision):
      return self._add_batch(params, acc, batch)

  def _add_batch(self, params: Params, acc: Accumulator,
                 batch: Batch) -> Accumulator:
    g, stats = self._sum_fn(params, batch)
    total, compensation = _kahan_add(acc.grad_sum, acc.compensation, g)
    return Accumulator(total, jax.tree.map(jnp.add, acc.stats, stats), compensation)

  def _apply(self, params: Params, opt_state: optax.OptState,
             acc: Accumulator, step, keys):
    self._traces['apply'] += 1
    with precision_lib.matmul_precision(self.precision):
      return self._update(params, opt_state, acc, self._noise_key(keys, step))

  def _update(self, params: Params, opt_state: optax.OptState,
              acc: Accumulator, key: jax.Array):
    g = acc.grad_sum
    if self.private and self.noise_multiplier > 0:
      std = self.noise_multiplier * self.clip_norm
      g = noise_lib.add_noise(g, key, std)
    g = jax.tree.map(lambda s: s / self.expected_batch_size, g)
    updates, opt_state = self.optimizer.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
    s = acc.stats
    finite_rows = s.num_rows - s.num_nonfinite.astype(jnp.float32)
    metrics = {
        'loss': s.loss_sum / jnp.maximum(finite_rows, 1.0),
        'accuracy': s.correct / jnp.maximum(s.num_rows, 1.0),
        'num_examples': s.num_rows,
        'num_clipped': s.num_clipped,
        'num_nonfinite': s.num_nonfinite,
        # ‖Σ_i w_i clip(g_i)‖ / b: the mean clipped gradient before noise.
        'grad_norm': optax.tree.norm(acc.grad_sum) / self.expected_batch_size,
        'noisy_grad_norm': optax.tree.norm(g),
        # Mean per-example ‖g_i‖ before clipping (helps choose C); 0 when
        # not private (no per-example gradients are formed).
        'example_grad_norm': s.grad_norm_sum / jnp.maximum(finite_rows, 1.0),
    }
    return params, opt_state, metrics

  def compile_count(self, fn: str | None = None) -> int:
    """Compilations so far of 'accumulate', 'apply' or 'train_step'; None:
    their total.

    Counted as traces of the jitted Python bodies (each trace is one XLA
    compilation). A healthy run stays at 1 each whatever K is (the trainer
    compiles only 'train_step': one program, or two with the 'host' loop).
    """
    if fn is None:
      return sum(self._traces.values())
    if fn not in self._traces:
      raise ValueError(f'fn={fn!r}; valid: {tuple(self._traces)} or None.')
    return self._traces[fn]

  @property
  def clipping_choice(self) -> list[str]:
    """What the clipped sum runs, as log lines: per-example gradients, or ghost clipping with
    each layer's form (`clipping.make_clipped_sum_fn`); empty before the first trace of
    'auto' / 'ghost' and for the non-private step."""
    return list(self._choice)
