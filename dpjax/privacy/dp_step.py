"""The DP-SGD logical step: the library tier compiled (PRNG streams: `dpjax.privacy.prng`).

  loss_fn(params, example)  →  Σ_i w_i · clip_C(g_i)  (`clipping`: vmap / ghost / auto)
    summed over the K physical batches of step t (Kahan, `accumulator`)
  →  the privatizer's ĝ_t  (`noise.Privatizer`: Gaussian, (Σ + N(0, σ²C² I)) / b, the noise
     of (seed, t) added ONCE per logical step, b the sampler's expected batch size)
  →  the optimizer (optax).

This is what `clipping.clipped_grad(loss_fn)` + `accumulator.GradSum` + `gaussian_privatizer`
compute in a loop of one's own (tests/privacy/test_one_mechanism.py). The privatizer is the
extension point: a correlated-noise mechanism is one new privatizer with its own state
(carried beside the optimiser's, `accumulator.init_state`), nothing else here changes.

A logical step t is K ≥ 0 physical batches of the same static shape P (K varies with the
sampled batch size; K = 0 happens under Poisson sampling). ONE body, `logical_step`: a
`lax.fori_loop` over the first K physical batches of a fixed-shape buffer [K_max = B/P, P,
...] (K is data, so every step reuses one executable), then the release. `train_step` runs it
as one compiled program (the 'device' loop) or as K + 1 dispatches of its two parts (the
'host' loop); `init_accumulator` / `accumulate` / `apply` are the same parts for a loop of
one's own. Given a `device_data.DeviceDataset`, the buffer holds only int32 row indices and
weights, gathered and normalised on the device inside the loop. Params and optimiser state
are donated.

With a non-private privatizer (`GaussianPrivatizer.no_noise`) the same pipeline runs without
clipping or noise: SGD on Σ_i w_i · g_i / b.

Models must be per-example (no BatchNorm) and deterministic (no dropout), see
`dpjax.models.factory`. Metrics are monitoring values computed from the raw batch: they are
NOT differentially private and must not be released as if they were.

Data parallelism is a sharding argument, not another program: given a `mesh`
(`dpjax.privacy.sharding`), each physical batch is split over its 'data' axis and everything
else is replicated; the sum becomes a cross-device reduction, and the release (noise
included) runs on replicated inputs: the noise is drawn once per logical step from one key.

Randomness: the noise comes from JAX's Threefry PRNG keyed by (seed, NOISE_STREAM, step):
reproducible, not a cryptographically secure sampler. `apply` and `train_step` refuse a step
that is not after the last one they noised (`noise_state.check_after`).
"""

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

from dpjax.privacy import accumulator as accumulator_lib
from dpjax.privacy import augmult as augmult_lib
from dpjax.privacy import clipping as clipping_lib
from dpjax.privacy import logical_buffer
from dpjax.privacy import losses
from dpjax.privacy import noise
from dpjax.privacy import noise_state
from dpjax.privacy import param_sharding
from dpjax.privacy import precision as precision_lib
from dpjax.privacy import privacy_plan
from dpjax.privacy import prng
from dpjax.privacy import sharding
from dpjax.privacy import stateful_layers
from dpjax.privacy import step_layout
from dpjax.privacy import step_sizing

Params = Any
Batch = dict[str, jax.Array]

StepOptions = step_layout.StepOptions
program_shardings = step_layout.program_shardings


class DPStep:
  """DP-SGD (or non-private SGD) logical step over K physical batches (module docstring).

  Every per-step quantity (K, the number of real rows, the step t, the seed's key data) is
  data, not a trace-time constant: each program compiles once.

  Warning: `accumulate`, `apply` and `train_step` donate their accumulator / params and
  optimiser state; use the returned ones and start each step from `init_accumulator`.

  Args:
    loss_fn: one example's loss, `(params, example) -> loss` (or `(loss, aux)` with has_aux),
      as `clipping.clipped_grad` takes it (`for_model` builds it from a Flax model).
    optimizer: applied to the privatizer's release ĝ.
    privatizer: the noise mechanism (`noise.Privatizer`); its C clips, its σ, b and seed
      noise. `noise.GaussianPrivatizer.no_noise(b)` (C = None): the non-private baseline (no
      clipping, no noise, Σ_i w_i · g_i / b).
    has_aux: whether loss_fn returns (loss, aux); aux['correct'] is the accuracy metric.
    clipping: 'auto' (ghost clipping when it covers every parameter of the model, else
      per-example gradients, with a log line), 'vmap' or 'ghost' (`dpjax.privacy.clipping`).
      Decided when first traced; a model 'ghost' does not cover raises ValueError there.
    precision: 'default', 'highest', 'bfloat16' (`dpjax.privacy.precision`): examples are
      clipped at C exactly, and the float rounding of the norms and of the sum is paid for in
      ε (the plan's η, `dpjax.privacy.rounding`).
    augmult: augmentation multiplicity (`augmult.Augmult`; None or K <= 1 = off; loss_fn then
      takes x as views [K, ...]). `train_step` makes K views of each row on the device (keys
      from (seed, step, example index): the logical buffer must carry 'index'); the low-level
      `accumulate` takes batch['x'] as views [P, K, ...] (`augmult.make_views`).
    sum_fn_wrapper: optional f(sum_fn) -> sum_fn applied to the physical batch's clipped-sum
      function (e.g. `auditing.with_gradient_canaries`).
    options: `StepOptions` (mesh, physical loop, clipping forms, repeated steps).
  """

  def __init__(
    self,
    loss_fn: clipping_lib.LossFn,
    optimizer: optax.GradientTransformation,
    privatizer: noise.Privatizer,
    *,
    has_aux: bool = False,
    clipping: str = 'auto',
    precision: str = 'default',
    augmult: augmult_lib.Augmult | None = None,
    sum_fn_wrapper=None,
    options: StepOptions = StepOptions(),
  ):
    """Validates everything before any compute (the arguments: see the class docstring)."""
    self.precision = precision_lib.check_precision(precision)
    if not (hasattr(optimizer, 'init') and hasattr(optimizer, 'update')):
      raise ValueError('optimizer must be an optax.GradientTransformation.')
    self.optimizer, self.privatizer, self.options = optimizer, privatizer, options
    self.private = privatizer.clip_norm is not None
    self.clip_norm = self.clip_bound = privatizer.clip_norm  # Each example is clipped at C.
    self.noise_multiplier = privatizer.noise_multiplier
    self.expected_batch_size, self.seed = privatizer.expected_batch_size, privatizer.seed
    self.augmult = augmult if augmult is not None and augmult.num_views > 1 else None
    # As clipped_grad: BatchNorm / Dropout state in the loss is Flax's error with the fix.
    loss_fn = clipping_lib.with_aux(stateful_layers.explained(loss_fn), has_aux)
    self._sum_fn = self._clipped_sum_fn(loss_fn, clipping)
    if sum_fn_wrapper is not None:  # e.g. audit canaries: (params, batch) -> (sum, stats).
      self._sum_fn = sum_fn_wrapper(self._sum_fn)
    self._last_applied = None
    # The seed's key data, an argument of every program (not a constant in it): one
    # compilation, and one persistent cache entry, serve every run whatever its secret seed.
    self.keys = {'noise': privatizer.key_data(), 'views': augmult_lib.stream_data(self.seed)}
    self._traces = {'accumulate': 0, 'apply': 0, 'train_step': 0}
    self.sizing = step_sizing.StepSizing()
    self._jit_programs()

  mesh = property(lambda self: self.options.mesh)
  physical_loop = property(lambda self: self.options.physical_loop)
  allow_repeated_steps = property(lambda self: self.options.allow_repeated_steps)
  sizing_compiles = property(lambda self: self.sizing.compiles)

  def _clipped_sum_fn(self, loss_fn, clipping: str):
    """(params, batch) -> (Σ_i w_i · clip_C(g_i), stats), or the unclipped sum if not private."""
    if clipping not in clipping_lib.CLIPPING_METHODS:
      raise ValueError(f'clipping={clipping!r}; valid: {clipping_lib.CLIPPING_METHODS}.')
    if not self.private:
      self._choice = []
      return lambda params, batch: clipping_lib.grad_sum(loss_fn, params, batch)
    sum_fn = clipping_lib.make_clipped_sum_fn(
      clipping, loss_fn, self.clip_norm, self.options.clipping_forms
    )
    self._choice = sum_fn.choice  # Filled when first traced ('auto', 'ghost').
    return sum_fn

  @classmethod
  def for_model(
    cls,
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    *,
    clip_norm: float | None,
    noise_multiplier: float | None,
    expected_batch_size: float,
    private: bool = True,
    seed: int = 0,
    noise_impl: str = 'threefry',
    label_format: str = 'int',
    loss: str = 'softmax_cross_entropy',
    precision: str = 'default',
    augmult: augmult_lib.Augmult | None = None,
    privatizer: noise.Privatizer | None = None,
    **kwargs,
  ) -> 'DPStep':
    """The step of a Flax model: loss_fn = `losses.make_loss_fn(model, label_format, ...)`
    ((loss, {'correct': ...}) of one example) and the Gaussian privatizer of (σ, C, b, seed),
    or `privatizer` when given (a plan's `mechanism()`, with the same σ, C, b and seed);
    private=False: the non-private baseline (σ and C ignored). `kwargs`: clipping,
    sum_fn_wrapper, and `StepOptions`' fields (mesh, physical_loop, ...)."""
    options = StepOptions(**{f: kwargs.pop(f) for f in step_layout.OPTION_FIELDS if f in kwargs})
    prng.check_seed(seed)
    privatizer = privatizer or (
      noise.GaussianPrivatizer.gaussian(
        noise_multiplier, clip_norm, expected_batch_size, seed, noise_impl
      )
      if private
      else noise.GaussianPrivatizer.no_noise(expected_batch_size, seed)
    )
    prng.check_noise_impl(noise_impl)
    views = augmult is not None and augmult.num_views > 1
    loss_fn = losses.make_loss_fn(model, label_format, precision, views=views, loss=loss)
    return cls(
      loss_fn,
      optimizer,
      privatizer,
      has_aux=True,
      precision=precision,
      augmult=augmult,
      options=options,
      **kwargs,
    )

  @classmethod
  def non_private(
    cls,
    model,
    optimizer: optax.GradientTransformation,
    expected_batch_size,
    seed: int = 0,
    **kwargs,
  ) -> 'DPStep':
    """The non-private baseline of a Flax model: no clipping, no noise, Σ_i w_i · g_i / b
    (`kwargs`: the other `for_model` arguments)."""
    return cls.for_model(
      model,
      optimizer,
      clip_norm=None,
      noise_multiplier=None,
      expected_batch_size=expected_batch_size,
      private=False,
      seed=seed,
      **kwargs,
    )

  @classmethod
  def from_plan(
    cls, model, optimizer: optax.GradientTransformation, plan: privacy_plan.PrivacyPlan, **kwargs
  ) -> 'DPStep':
    """The DP step of a `PrivacyPlan`: σ, C, the divisor b, the seed and the precision (whose
    float rounding η the plan's accountant pays for) are the plan's.

    They cannot be passed here, so the step that runs and the accountant that reports cannot
    disagree; `kwargs` are the other `for_model` arguments (clipping, mesh, ...).
    """
    taken = sorted(
      set(kwargs)
      & {'clip_norm', 'noise_multiplier', 'expected_batch_size', 'seed', 'private', 'precision'}
    )
    if taken:
      raise TypeError(f'DPStep.from_plan: {", ".join(taken)} come from the plan.')
    return cls.for_model(
      model,
      optimizer,
      clip_norm=plan.clip_norm,
      noise_multiplier=plan.noise_multiplier,
      expected_batch_size=plan.expected_batch_size,
      seed=plan.seed,
      private=True,
      precision=plan.precision,
      privatizer=plan.mechanism(kwargs.get('noise_impl', 'threefry')),
      **kwargs,
    )

  def _jit_programs(self) -> None:
    """The compiled programs: each one body below, sharded by `program_shardings` (the mesh's
    layout, or where the inputs are when there is no mesh)."""
    jit = lambda fn, counter, kinds, donate: jax.jit(
      self._counted(fn, counter), donate_argnums=donate, **program_shardings(self.mesh, kinds)
    )
    self.accumulate = jit(self._add_batch, 'accumulate', 'ssb', (1,))
    self._apply = jit(self._release, 'apply', 'sssss', (2,))
    self._train_step = jit(self.logical_step, 'train_step', 'sslssss', (0, 1))
    self._host_add = jit(self._add_slot, 'train_step', 'sslssss', (1,))
    self._host_release = jit(self._release, 'train_step', 'sssss', (0, 1))
    self._zeros = jax.jit(lambda p: self.placed(accumulator_lib.zeros(p), p))

  def placed(self, tree, params):
    """`tree` (traced) held in the state's layout on the mesh (`param_sharding.constrain`)."""
    return param_sharding.constrain(tree, params, self.mesh, self.options.rules)

  def _counted(self, fn, counter: str):
    """fn in the step's precision, its traces (= XLA compilations) counted under `counter`."""

    @functools.wraps(fn)
    def traced(*args):
      self._traces[counter] += 1
      with precision_lib.matmul_precision(self.precision):
        return fn(*args)

    return traced

  # The bodies: one physical batch, one release, one logical step.

  def _add_batch(self, params: Params, acc, batch: Batch) -> accumulator_lib.Accumulator:
    """acc + this physical batch's Σ_i w_i · clip_C(g_i) and statistics."""
    batch = dict(batch, weight=clipping_lib.clamp_weights(batch['weight']))  # As clipped_grad.
    g, stats = self._sum_fn(params, batch)
    return self.placed(accumulator_lib.add(acc, g, stats), params)

  def _add_slot(self, params, acc, logical, i, step, dataset, keys):
    """acc + physical batch i of the logical buffer (gathered and viewed on the device)."""
    batch = logical_buffer.physical_batch(logical, i, step, dataset, self.augmult, keys['views'])
    return self._add_batch(params, acc, batch)

  def _release(self, params, opt_state, acc, step, keys):
    """The privatizer's ĝ of the sum (noise of (seed, t) once, ÷ b), then the optimizer."""
    noise_key, optimizer, privatizer = keys['noise'], self.optimizer, self.privatizer
    out = accumulator_lib.release(params, opt_state, acc, step, noise_key, optimizer, privatizer)
    return self.placed(out, params)

  def logical_step(self, params, opt_state, logical, num_batches, step, dataset=None, keys=None):
    """The logical step's body: a fori over its K physical batches, then the release.
    Untraced and unjitted (`train_step` compiles it; `dpjax.privacy.multi_step` embeds it in a
    larger program, passing `self.keys` as an argument); in the step's matmul precision."""
    keys = self.keys if keys is None else keys
    k = logical_buffer.clamp_num_batches(num_batches, logical_buffer.num_slots(logical))
    add = lambda i, acc: self._add_slot(params, acc, logical, i, step, dataset, keys)
    with precision_lib.matmul_precision(self.precision):
      acc = jax.lax.fori_loop(0, k, add, self.placed(accumulator_lib.zeros(params), params))
      return self._release(params, opt_state, acc, step, keys)

  # The entry points.

  def loop_mode(self, params: Params) -> str:
    """'device' or 'host': how `train_step` runs for these params (see physical_loop)."""
    return step_layout.loop_mode(self.physical_loop, params)

  def train_step(
    self, params: Params, opt_state: optax.OptState, logical: Batch, num_batches, step, dataset=None
  ):
    """One whole logical step: `logical_step` compiled, one dispatch ('device' loop), or, with
    `loop_mode(params) == 'host'`, K + 1 dispatches of its two parts (pass K as a host int).

    Args:
      params, opt_state: donated; use the returned ones (opt_state: `init_opt_state`'s).
      logical: the logical batch as a buffer with a leading axis K_max (= B/P, fixed for the
        run): {'x': [K_max, P, ...], 'y': [K_max, P (, classes)], 'weight': [K_max, P]}, or
        with `dataset` {'index': int32 [K_max, P], 'weight': [K_max, P]}
        (`device_data.index_buffer` / `host_buffer` build them). Batches K.. are never read.
      num_batches: K, the number of non-empty physical batches (int32 data: it varies with no
        recompilation); clamped to [0, K_max].
      step: the 0-based logical step t (uint32 or int32 data, < 2**32).
      dataset: a `device_data.DeviceDataset` holding the raw training set on the device, or
        None when `logical` carries the rows themselves.

    Returns:
      (params, opt_state, metrics) as `apply`. Refuses a step not after the last one noised.
    """
    self._check_step(step)
    if self.loop_mode(params) == 'device':
      return self._train_step(params, opt_state, logical, num_batches, step, dataset, self.keys)
    # 'host': the buffer goes to the device once; K small dispatches read it.
    where = None if self.mesh is None else sharding.logical_batch_sharding(self.mesh)
    logical = jax.device_put(logical, where)
    k_max, acc = logical_buffer.num_slots(logical), self._zeros(params)
    for i in range(min(max(int(num_batches), 0), k_max)):
      acc = self._host_add(params, acc, logical, np.int32(i), step, dataset, self.keys)
    return self._host_release(params, opt_state, acc, step, self.keys)

  def init_accumulator(self, params: Params) -> accumulator_lib.Accumulator:
    """Zero sums with the structure of params (replicated over the mesh)."""
    return self._zeros(params)

  def init_opt_state(self, params: Params) -> optax.OptState:
    """The optimiser state `apply` / `train_step` take (`accumulator.init_state`): the
    optimizer's, with a stateful privatizer's state first."""
    return accumulator_lib.init_state(params, self.optimizer, self.privatizer)

  def apply(self, params: Params, opt_state: optax.OptState, acc, step):
    """ĝ = the privatizer's release of acc.grad_sum at `step` ((Σ + N(0, σ²C²)) / b for the
    Gaussian one); one optax step on ĝ. Donates `acc`. Refuses (ValueError, before any
    compute) a step not after the last one applied (`noise_state.check_after`)."""
    self._check_step(step)
    return self._apply(params, opt_state, acc, step, self.keys)

  def _check_step(self, step) -> None:
    """This object noises each step once, in order (`noise_state.check_after`); a loop
    resumed in another process continues from its saved step (the noise is (seed, t)'s)."""
    if self.private and not self.allow_repeated_steps:
      self._last_applied = noise_state.check_after(step, self._last_applied, who='DPStep')

  def compiled_bytes(self, params, opt_state, logical, dataset=None) -> int:
    """Device bytes of the logical-step program for a buffer shaped like `logical`
    (`step_sizing.compiled_bytes`: XLA's memory analysis, nothing runs; compiled once per
    shapes, and not counted by `compile_count`)."""
    traces = dict(self._traces)
    try:
      return self.sizing.bytes_of(self._train_step, params, opt_state, logical, dataset, self.keys)
    finally:
      self._traces = traces

  def compile_count(self, fn: str | None = None) -> int:
    """Compilations so far of 'accumulate', 'apply' or 'train_step' (its one program, or the
    host loop's two); None: their total. Each trace of a body is one XLA compilation; a
    healthy run stays at 1 each whatever K is."""
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
