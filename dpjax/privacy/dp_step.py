"""The DP-SGD logical step with virtual batching (PRNG streams: `dpjax.privacy.prng`).

A logical step t is K ≥ 0 physical batches of the same static shape P (K
varies with the sampled batch size; K = 0 happens under Poisson sampling):

  acc = init_accumulator(params)
  for batch in physical_batches:            # K times, one compiled program
    acc = accumulate(params, acc, batch)    # += Σ_i w_i · clip_C(g_i)
  params, opt_state, metrics = apply(params, opt_state, acc, t)   # noise of (seed, t)

The trainer runs the same computation as ONE compiled program per logical step,
`train_step(params, opt_state, logical, K, t)`: a `lax.fori_loop` over the first K physical
batches of a fixed-shape buffer [K_max = B/P, P, ...] (K is data, so every step reuses one
executable), the noise key derived inside the program from (seed, t) with the same bits as
`noise_key`, the division by b and the optax update; params and optimiser state are donated.
Given a `device_data.DeviceDataset`, the buffer holds only int32 row indices and weights, and
each physical batch is gathered and normalised on the device inside the loop.

`apply` releases  ĝ = (Σ_i w_i · clip_C(g_i) + N(0, σ²C² I)) / b  and takes an
optax step on ĝ (`accumulator.release`): the noise is added ONCE per logical step,
to the sum over all K physical batches, and b is the sampler's
`expected_batch_size`, never the realised number of rows.

With `private=False` the same pipeline runs without clipping or noise, so the update is SGD on
Σ_i w_i · g_i / b (the mean gradient when b is the number of rows).

Models must be per-example (no BatchNorm) and deterministic (no dropout), see
`dpjax.models.factory`. Metrics are monitoring values computed from the raw batch: they are
NOT differentially private and must not be released as if they were.

Data parallelism: given a `mesh` (`dpjax.privacy.sharding`), each physical batch is split
over its 'data' axis and everything else is replicated; the sum inside `accumulate` becomes
a cross-device reduction, and `apply` (noise included) runs on replicated inputs: the noise
is drawn once per logical step from one key, the update is the same on every device.

Randomness: the noise comes from JAX's Threefry PRNG keyed by (seed, NOISE_STREAM, step):
reproducible, not a cryptographically secure sampler. `apply` refuses a step that is not
after the last one it noised (`noise_state.check_after`).
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax.privacy import accumulator as accumulator_lib
from dpjax.privacy import augmult as augmult_lib
from dpjax.privacy import checks
from dpjax.privacy import clipping as clipping_lib
from dpjax.privacy import logical_buffer
from dpjax.privacy import precision as precision_lib
from dpjax.privacy import noise_state
from dpjax.privacy import privacy_plan
from dpjax.privacy import losses
from dpjax.privacy import prng
from dpjax.privacy import sharding

Params = Any
Batch = dict[str, jax.Array]

PHYSICAL_LOOPS = ('auto', 'device', 'host')


class DPStep:
  """DP-SGD (or non-private SGD) logical step over K physical batches.

  `accumulate` and `apply` are each compiled once: all physical batches share
  one static shape and every per-step quantity (K, the number of real rows,
  the noise key) is data, not a trace-time constant.

  Warning: `accumulate` and `apply` donate the accumulator passed to them;
  use the returned one and start each step from `init_accumulator`.

  Args:
    model: a dpjax.models.factory module (per-example, deterministic).
    optimizer: applied to the noisy mean gradient ĝ.
    clip_norm: C, finite and > 0. Ignored if not private.
    noise_multiplier: σ > 0 (finite); noise std on the summed gradient is
      σ·C. Ignored if not private.
    expected_batch_size: b > 0, the sampler's `expected_batch_size`.
    private: False runs the non-private baseline (no clipping, no noise).
    clipping: `config.privacy.clipping`: 'auto' (ghost clipping when it
      covers every parameter of the model, else per-example gradients, with
      a log line), 'vmap' or 'ghost' (see `dpjax.privacy.clipping`). Decided when
      `accumulate` is first traced; a model 'ghost' does not cover raises
      ValueError there, before any compute.
    label_format: 'int' labels [P] or 'one_hot' [P, classes].
    mesh: data-parallel device mesh (`sharding.make_mesh`): batches are
      sharded over its 'data' axis, params / optimiser state / accumulator
      replicated, outputs replicated. P must be a multiple of its size.
      None: run where the inputs are (one device).
    seed: the run's secret seed; step t's noise is drawn from
      noise_key(seed, t) (`dpjax.privacy.prng`), inside the program.
    precision: `config.precision` ('default', 'highest', 'bfloat16'; see
      `dpjax.privacy.precision`): examples are clipped at C exactly, and the
      float rounding of the norms and of the sum is paid for in ε (the plan's
      η, `dpjax.privacy.rounding`); the noise std is σ·C.
    physical_loop: how `train_step` loops over the K physical batches:
      'device' (one program, a while loop inside: one dispatch per logical
      step), 'host' (K dispatches of a program that slices batch i of the
      device-resident buffer, then one that noises and updates: the same
      result), or 'auto' = 'host' on the CPU backend for models with
      convolution kernels (XLA:CPU runs convolution weight gradients inside
      a while loop far slower than at top level), else 'device'.
    sum_fn_wrapper: optional f(sum_fn) -> sum_fn applied to the physical batch's
      clipped-sum function (e.g. `auditing.with_gradient_canaries`).
    augmult: augmentation multiplicity (`dpjax.privacy.augmult.Augmult`; None or
      K <= 1 = off). `train_step` makes K views of each row on the device
      (keys from (seed, step, example index): the logical buffer must carry
      'index'); each example's gradient is the mean over its views, clipped
      once. The low-level `accumulate` then takes batch['x'] as views
      [P, K, ...] (`augmult.make_views`).
    loss: the per-example loss (`losses.LOSSES`: softmax_cross_entropy, mse,
      sequence_cross_entropy).
    noise_impl: the JAX generator of the noise (`prng.NOISE_IMPLS`; threefry, the
      default, draws the bits `prng.noise_key` names).
    allow_repeated_steps: let `apply` noise a step again (tests comparing two sums under one
      noise; such releases have no guarantee). False: refused, one line.
    clipping_forms: 'flops' | 'measured', how ghost clipping picks each layer's form (speed).
  """

  def __init__(
    self,
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    *,
    clip_norm: float | None,
    noise_multiplier: float | None,
    expected_batch_size: float,
    private: bool = True,
    clipping: str = 'auto',
    label_format: str = 'int',
    mesh: jax.sharding.Mesh | None = None,
    seed: int = 0,
    precision: str = 'default',
    physical_loop: str = 'auto',
    sum_fn_wrapper=None,
    augmult: augmult_lib.Augmult | None = None,
    loss: str = 'softmax_cross_entropy',
    clipping_forms: str = 'flops',
    noise_impl: str = 'threefry',
    allow_repeated_steps: bool = False,
  ):
    """Validates everything before any compute (the arguments: see the class docstring)."""
    if physical_loop not in PHYSICAL_LOOPS:
      raise ValueError(f'physical_loop={physical_loop!r}; valid: {PHYSICAL_LOOPS}.')
    self.physical_loop = physical_loop
    prng.check_seed(seed)
    self.precision = precision_lib.check_precision(precision)
    if not (hasattr(optimizer, 'init') and hasattr(optimizer, 'update')):
      raise ValueError('optimizer must be an optax.GradientTransformation.')
    b = checks.check_expected_batch_size(expected_batch_size)
    self.model = model
    self.optimizer = optimizer
    self.private = bool(private)
    self.allow_repeated_steps, self._last_applied = bool(allow_repeated_steps), None
    self.expected_batch_size = b
    self.label_format = label_format
    self.augmult = augmult if augmult is not None and augmult.num_views > 1 else None
    loss_fn = losses.make_loss_fn(
      model, label_format, precision, views=self.augmult is not None, loss=loss
    )
    self._sum_fn = self._clipped_sum_fn(
      loss_fn, clipping, clip_norm, noise_multiplier, clipping_forms
    )
    if sum_fn_wrapper is not None:  # e.g. audit canaries: (params, batch) -> (sum, stats).
      self._sum_fn = sum_fn_wrapper(self._sum_fn)
    self.seed = seed
    # The seed's key data, an argument of every program (not a constant in it): one
    # compilation, and one persistent cache entry, serve every run whatever its secret seed.
    self.noise_impl = prng.check_noise_impl(noise_impl)
    self.keys = {
      'noise': prng.noise_stream_data(seed, noise_impl),
      'views': augmult_lib.stream_data(seed),
    }
    self._traces = {'accumulate': 0, 'apply': 0, 'train_step': 0}
    self.sizing_compiles = 0  # Programs compiled only for their memory analysis (P = 0).
    self._step_bytes = {}  # physical_batch.compiled_step_bytes, by shapes.
    self.mesh = mesh
    self._jit_programs(mesh)

  def _clipped_sum_fn(self, loss_fn, clipping: str, clip_norm, noise_multiplier, forms: str):
    """(params, batch) -> (Σ_i w_i · clip_C(g_i), stats), or the unclipped sum if not private.

    Sets C, σ and `clip_bound` = C (checked when private: σ > 0 and C finite, anything else
    releases without a guarantee).
    """
    if self.private:
      self.clip_norm = checks.check_clip_norm(clip_norm)
      self.noise_multiplier = checks.check_noise_multiplier(noise_multiplier)
      self.clip_bound = self.clip_norm  # Each example is clipped at C itself.
      sum_fn = clipping_lib.make_clipped_sum_fn(clipping, loss_fn, self.clip_bound, forms)
      self._choice = sum_fn.choice  # Filled when first traced ('auto', 'ghost').
      return sum_fn
    if clipping not in clipping_lib.CLIPPING_METHODS:
      raise ValueError(
        f'config.privacy.clipping={clipping!r}; valid: {clipping_lib.CLIPPING_METHODS}.'
      )
    self.clip_norm = self.clip_bound = None
    self.noise_multiplier = 0.0
    self._choice = []
    return functools.partial(clipping_lib.grad_sum, loss_fn)

  def _jit_programs(self, mesh: jax.sharding.Mesh | None) -> None:
    """The compiled programs, their inputs sharded over `mesh` (None: where the inputs are)."""
    if mesh is None:
      self.accumulate = jax.jit(self._accumulate, donate_argnums=(1,))
      self._apply_jit = jax.jit(self._apply, donate_argnums=(2,))
      self._zeros = accumulator_lib.zeros
      self._train_step = jax.jit(self._fused_step, donate_argnums=(0, 1))
      self._accumulate_at = jax.jit(self._accumulate_at_fn, donate_argnums=(1,))
      self._apply_at = jax.jit(self._apply_at_fn, donate_argnums=(0, 1))
      self._logical_sharding = None
      return
    state, batch = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    self.accumulate = jax.jit(
      self._accumulate, in_shardings=(state, state, batch), out_shardings=state, donate_argnums=(1,)
    )
    self._apply_jit = jax.jit(
      self._apply, in_shardings=state, out_shardings=state, donate_argnums=(2,)
    )
    self._zeros = jax.jit(accumulator_lib.zeros, out_shardings=state)
    self._train_step = jax.jit(
      self._fused_step,
      in_shardings=(
        state,
        state,
        sharding.logical_batch_sharding(mesh),
        state,
        state,
        state,
        state,
      ),
      out_shardings=state,
      donate_argnums=(0, 1),
    )
    self._logical_sharding = sharding.logical_batch_sharding(mesh)
    self._accumulate_at = jax.jit(
      self._accumulate_at_fn,
      in_shardings=(state, state, self._logical_sharding, state, state, state, state),
      out_shardings=state,
      donate_argnums=(1,),
    )
    self._apply_at = jax.jit(
      self._apply_at_fn, in_shardings=state, out_shardings=state, donate_argnums=(0, 1)
    )

  @classmethod
  def from_plan(
    cls, model, optimizer: optax.GradientTransformation, plan: privacy_plan.PrivacyPlan, **kwargs
  ) -> 'DPStep':
    """The DP step of a `PrivacyPlan`: σ, C, the divisor b, the seed and the precision (whose
    float rounding η the plan's accountant pays for) are the plan's.

    They cannot be passed here, so the step that runs and the accountant that reports cannot
    disagree; `kwargs` are the other `DPStep` arguments (clipping, mesh, ...).
    """
    taken = sorted(
      set(kwargs)
      & {'clip_norm', 'noise_multiplier', 'expected_batch_size', 'seed', 'private', 'precision'}
    )
    if taken:
      raise TypeError(f'DPStep.from_plan: {", ".join(taken)} come from the plan.')
    return cls(
      model,
      optimizer,
      clip_norm=plan.clip_norm,
      noise_multiplier=plan.noise_multiplier,
      expected_batch_size=plan.expected_batch_size,
      seed=plan.seed,
      private=True,
      precision=plan.precision,
      **kwargs,
    )

  def loop_mode(self, params: Params) -> str:
    """'device' or 'host': how `train_step` runs for these params (see physical_loop)."""
    if self.physical_loop != 'auto':
      return self.physical_loop
    convolutional = any(jnp.ndim(leaf) >= 3 for leaf in jax.tree.leaves(params))
    return 'host' if jax.default_backend() == 'cpu' and convolutional else 'device'

  def train_step(
    self, params: Params, opt_state: optax.OptState, logical: Batch, num_batches, step, dataset=None
  ):
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
      (params, opt_state, metrics) as `apply`. Refuses a step not after the last one noised,
      as `apply` does.
    """
    self._check_step(step)
    if self.loop_mode(params) == 'device':
      return self._train_step(params, opt_state, logical, num_batches, step, dataset, self.keys)
    # 'host': the buffer goes to the device once; K small dispatches read it.
    logical = jax.device_put(logical, self._logical_sharding)
    k_max = logical_buffer.num_slots(logical)
    acc = self._zeros(params)
    for i in range(min(max(int(num_batches), 0), k_max)):
      acc = self._accumulate_at(params, acc, logical, np.int32(i), step, dataset, self.keys)
    return self._apply_at(params, opt_state, acc, step, self.keys)

  def apply(
    self, params: Params, opt_state: optax.OptState, acc: accumulator_lib.Accumulator, step
  ):
    """ĝ = (acc.grad_sum + N(0, σ²C²)) / b with the noise of (this step's seed, `step`); one
    optax step on ĝ. Donates `acc`. Refuses (ValueError, before any compute) a step not after
    the last one applied (`noise_state.check_after`)."""
    self._check_step(step)
    return self._apply_jit(params, opt_state, acc, step, self.keys)

  def _check_step(self, step) -> None:
    """This object noises each step once, in order (`noise_state.check_after`); a loop
    resumed in another process continues from its saved step (the noise is (seed, t)'s)."""
    if self.private and not self.allow_repeated_steps:
      self._last_applied = noise_state.check_after(step, self._last_applied, who='DPStep')

  def _accumulate_at_fn(self, params, acc, logical, i, step, dataset, keys):
    self._traces['train_step'] += 1
    with precision_lib.matmul_precision(self.precision):
      return self._add_batch(params, acc, self._physical_batch(logical, i, step, dataset, keys))

  def _apply_at_fn(self, params, opt_state, acc, step, keys):
    self._traces['train_step'] += 1
    with precision_lib.matmul_precision(self.precision):
      return self._update(params, opt_state, acc, self._noise_key(keys, step))

  def _physical_batch(self, logical: Batch, i, step, dataset, keys) -> Batch:
    return logical_buffer.physical_batch(logical, i, step, dataset, self.augmult, keys['views'])

  def _fused_step(
    self,
    params: Params,
    opt_state: optax.OptState,
    logical: Batch,
    num_batches,
    step,
    dataset,
    keys,
  ):
    self._traces['train_step'] += 1
    with precision_lib.matmul_precision(self.precision):
      return self._fused_body(params, opt_state, logical, num_batches, step, dataset, keys)

  def logical_step(self, params, opt_state, logical, num_batches, step, dataset=None, keys=None):
    """`train_step`'s computation, untraced and unjitted, in the step's precision: to embed
    in a larger program (`dpjax.privacy.multi_step`, which passes `self.keys` as an argument)."""
    with precision_lib.matmul_precision(self.precision):
      return self._fused_body(
        params, opt_state, logical, num_batches, step, dataset, self.keys if keys is None else keys
      )

  def _fused_body(self, params, opt_state, logical, num_batches, step, dataset, keys):
    k_max = logical_buffer.num_slots(logical)
    k = logical_buffer.clamp_num_batches(num_batches, k_max)

    def body(i, acc):
      return self._add_batch(params, acc, self._physical_batch(logical, i, step, dataset, keys))

    acc = jax.lax.fori_loop(0, k, body, accumulator_lib.zeros(params))
    return self._update(params, opt_state, acc, self._noise_key(keys, step))

  def _noise_key(self, keys: dict, step) -> jax.Array:
    """Step t's noise key from the noise stream's key data (an argument of the program)."""
    return prng.step_noise_key(keys['noise'], step, self.noise_impl)

  def init_accumulator(self, params: Params) -> accumulator_lib.Accumulator:
    """Zero sums with the structure of params (replicated over the mesh)."""
    return self._zeros(params)

  def _accumulate(
    self, params: Params, acc: accumulator_lib.Accumulator, batch: Batch
  ) -> accumulator_lib.Accumulator:
    """acc + this physical batch's Σ_i w_i · clip_C(g_i) and statistics."""
    self._traces['accumulate'] += 1
    with precision_lib.matmul_precision(self.precision):
      return self._add_batch(params, acc, batch)

  def _add_batch(
    self, params: Params, acc: accumulator_lib.Accumulator, batch: Batch
  ) -> accumulator_lib.Accumulator:
    batch = dict(batch, weight=clipping_lib.clamp_weights(batch['weight']))  # As clipped_grad.
    g, stats = self._sum_fn(params, batch)
    return accumulator_lib.add(acc, g, stats)

  def _apply(
    self, params: Params, opt_state: optax.OptState, acc: accumulator_lib.Accumulator, step, keys
  ):
    self._traces['apply'] += 1
    with precision_lib.matmul_precision(self.precision):
      return self._update(params, opt_state, acc, self._noise_key(keys, step))

  def _update(
    self,
    params: Params,
    opt_state: optax.OptState,
    acc: accumulator_lib.Accumulator,
    key: jax.Array,
  ):
    std = (
      self.noise_multiplier * self.clip_norm if self.private and self.noise_multiplier > 0 else None
    )
    return accumulator_lib.release(
      params, opt_state, acc, key, self.optimizer, std, self.expected_batch_size
    )

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
