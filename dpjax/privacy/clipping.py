"""Weighted sums of per-example clipped gradients over one physical batch.

DP-SGD's sensitivity bound: each example contributes w_i · clip_C(g_i) with

  clip_C(g) = g · min(1, C / ‖g‖₂),

where ‖·‖₂ is the global L2 norm over *all* parameters (Abadi et al. 2016,
"Deep Learning with Differential Privacy", Alg. 1) and w_i ∈ {0, 1} is the row
weight (0 for padding rows of a static-shape physical batch, the masked DP-SGD
of Beltran et al., seed 002, Alg. 2). So ‖w_i · clip_C(g_i)‖ ≤ C whatever the
example, which is what the accountant assumes (docs/accounting.md: each
clipped gradient is a query of norm ≤ 1 after dividing by C). Examples are
clipped at C exactly; what float rounding adds beyond C (the computed norm, the
sum) is paid for in ε (`dpjax.privacy.rounding`: sensitivity C(1 + η)). The rows
of per-example gradients are summed as a binary tree (`rounding.tree_row_sum`),
whose rounding η bounds.

A per-example gradient with any NaN/inf entry, or whose squared norm
overflows, or whose loss is not finite, is replaced by zero (still a function
of that example alone with norm ≤ C, so the bound holds) and counted in
`num_nonfinite`. (The two methods compute ‖g_i‖² in different orders, so an
example at the edge of float32 overflow may be finite for one and not the
other; either way its contribution has norm ≤ C.)

Loss functions act on ONE example: `loss_fn(params, example) -> loss` or,
with `has_aux=True`, `(loss, aux)`; `example` is one row of the batch (a
pytree: for the trainer `{'x': x_i, 'y': y_i}`). Any per-example loss works
(classification, regression, a sequence's per-token loss summed or averaged
over its tokens): the unit of privacy is what one row holds. Losses that mix
examples (contrastive, batch statistics) have no per-example gradient and are
out of scope. The statistics (`PerExample`, `ClipStats`) are for monitoring
and are NOT differentially private.

Methods (`method`), all giving the same clipped sum:
  'vmap': per-example gradients with `jax.vmap(jax.grad(...))` (Subramani et
    al. 2021, "Enabling Fast Differentially Private SGD via Just-in-Time
    Compilation and Vectorization"); memory P × #params.
  'ghost': per-example norms from layer inputs and output gradients, then
    the clipped sum book-kept layer by layer (`dpjax.privacy.ghost_clipping`: Li et
    al. 2022, Bu et al. 2022/2023); no per-example gradients of the large
    layers, about the cost and memory of one non-private step plus the
    norms. Only for models whose every parameter it covers (ValueError
    otherwise, at trace time).
  'auto' (default): 'ghost' when it covers every parameter, else 'vmap' with
    a log line naming the uncovered parameters. Decided at trace time from
    the shapes, so it costs no recompilation.
"""

from collections.abc import Callable
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp

from dpjax.privacy import checks
from dpjax.privacy import clip_stats
from dpjax.privacy import ghost_clipping
from dpjax.privacy import precision as precision_lib
from dpjax.privacy import rounding
from dpjax.privacy import stateful_layers

Params = Any
Example = Any  # One row: a pytree of arrays, e.g. {'x': x_i, 'y': y_i}.
Batch = dict[str, jax.Array]  # Example fields with a leading axis, plus 'weight' [P].
LossFn = Callable[[Params, Example], Any]  # -> loss, or (loss, aux) with has_aux.
ClippedSumFn = Callable[[Params, Batch], tuple[Params, 'ClipStats']]

CLIPPING_METHODS = ('auto', 'vmap', 'ghost')
MISSING_WEIGHTS = (
  "clipped_grad's weights are required: grad_fn(params, examples, weights) with the "
  "batcher's weights [P] (1 for a real row, 0 for padding, which holds a copy of example 0 "
  'and must add nothing).'
)


PerExample = clip_stats.PerExample
ClipStats = clip_stats.ClipStats


def examples_of(batch: Batch) -> dict[str, jax.Array]:
  """The example fields of a batch (everything but 'weight')."""
  return {k: v for k, v in batch.items() if k != 'weight'}


def with_aux(loss_fn: LossFn, has_aux: bool) -> LossFn:
  """loss_fn as `(params, example) -> (loss, aux)` (aux = () when it has none)."""
  if has_aux:
    return loss_fn
  return lambda params, example: (loss_fn(params, example), ())


def _row_sq_norms(grads: Params) -> jax.Array:
  """‖g_i‖² over all parameters; per-example gradients have a leading axis."""
  leaves = jax.tree.leaves(grads)
  return sum(jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), axis=1) for g in leaves)


def _clip_and_sum(
  losses: jax.Array,
  aux,
  sq_norms: jax.Array,
  weighted_sum: Callable[[jax.Array, jax.Array], Params],
  weights: jax.Array,
  clip_norm: float,
) -> tuple[Params, PerExample]:
  """Clip factors from ‖g_i‖², and the weighted sum Σ_i w_i · clip_C(g_i).

  A row is finite iff its loss and ‖g_i‖ are finite; other rows contribute
  exactly zero (weighted_sum must not let 0 · NaN through).
  """
  w = weights.astype(jnp.float32)
  norms = jnp.sqrt(sq_norms)
  finite = jnp.isfinite(norms) & jnp.isfinite(losses)
  scale = jnp.where(finite, jnp.minimum(1.0, clip_norm / norms), 0.0)
  return weighted_sum(w * scale, finite), PerExample(losses, aux, norms, finite)


def vmap_clipped_sum(
  loss_fn: LossFn, params: Params, examples: Example, weights: jax.Array, clip_norm: float
) -> tuple[Params, PerExample]:
  """Σ_i w_i · clip_C(g_i) by per-example gradients `jax.vmap(jax.grad(...))`.

  Args:
    loss_fn: `(params, example) -> (loss_i, aux_i)` for a single example.
    params: model parameters (pytree).
    examples: the rows, every leaf with a leading axis P.
    weights: [P] in {0, 1} (0: a padding row, which adds exactly zero).
    clip_norm: C > 0 (math.inf disables clipping; it still zeroes non-finite rows).
  """
  grad_fn = jax.vmap(jax.value_and_grad(loss_fn, has_aux=True), in_axes=(None, 0))
  (losses, aux), grads = grad_fn(params, examples)
  return _clip_and_sum(
    losses,
    aux,
    _row_sq_norms(grads),
    lambda factor, keep: jax.tree.map(lambda g: rounding.weighted_row_sum(factor, g, keep), grads),
    weights,
    clip_norm,
  )


def ghost_clipped_sum(
  loss_fn: LossFn,
  params: Params,
  examples: Example,
  weights: jax.Array,
  clip_norm: float,
  coverage: ghost_clipping.Coverage | None = None,
) -> tuple[Params, PerExample]:
  """Σ_i w_i · clip_C(g_i) by ghost norms and book-keeping (same result as vmap).

  No per-example gradient is formed (see `dpjax.privacy.ghost_clipping`). Raises ValueError (at
  trace time) if some parameter is not covered.
  """
  out = ghost_clipping.ghost_pass(loss_fn, params, examples, coverage)
  return _clip_and_sum(out.losses, out.aux, out.sq_norms, out.weighted_sum, weights, clip_norm)


def _finite_rows(examples: Example) -> jax.Array:
  """[P] bool: every floating leaf of the row is finite."""
  leaves = [l for l in jax.tree.leaves(examples) if jnp.issubdtype(l.dtype, jnp.inexact)]
  n = jax.tree.leaves(examples)[0].shape[0]
  ok = jnp.ones((n,), bool)
  for l in leaves:
    ok &= jnp.all(jnp.isfinite(l.reshape(n, -1)), axis=1)
  return ok


def grad_sum(loss_fn: LossFn, params: Params, batch: Batch) -> tuple[Params, ClipStats]:
  """Non-private Σ_i w_i · g_i by one backward pass of Σ_i w_i · loss_i.

  `loss_fn` returns (loss, aux). No clipping. Rows with a non-finite input or loss are
  dropped and counted. A non-finite value that arises inside the network from a finite
  input cannot be traced to its row without per-example gradients: if the summed gradient
  is non-finite, the whole physical batch is dropped (zero gradient) and all its rows are
  counted as non-finite. `num_clipped` and `grad_norm_sum` are 0.
  """
  examples = examples_of(batch)
  w = batch['weight'].astype(jnp.float32)
  real = w > 0
  x_finite = _finite_rows(examples)
  examples = jax.tree.map(
    lambda l: (
      jnp.where(x_finite.reshape((-1,) + (1,) * (l.ndim - 1)), l, 0)
      if jnp.issubdtype(l.dtype, jnp.inexact)
      else l
    ),
    examples,
  )

  def weighted_loss(p):
    losses, aux = jax.vmap(loss_fn, in_axes=(None, 0))(p, examples)
    keep = real & x_finite & jnp.isfinite(losses)
    return jnp.sum(jnp.where(keep, w * losses, 0.0)), (losses, aux, keep)

  (_, (losses, aux, keep)), g = jax.value_and_grad(weighted_loss, has_aux=True)(params)
  ok = jnp.isfinite(sum(jnp.sum(jnp.square(l)) for l in jax.tree.leaves(g)))
  g = jax.tree.map(lambda l: jnp.where(ok, l, 0.0), g)
  rows = PerExample(losses, aux, jnp.zeros_like(losses), keep & ok)
  stats = ClipStats.of(rows, w, math.inf)
  return g, stats._replace(grad_norm_sum=jnp.zeros((), jnp.float32))


def _ghost_forms(coverage, params, batch_size: int, forms: str, step=None) -> tuple[dict, list]:
  """({layer key: ghost?} for `mixed.chosen_forms`, log lines) of `forms` ('flops': the FLOP
  rule's, no table; 'measured': `form_timing.choose_forms`, timed at the first trace, checked
  on the whole clipped sum `step`)."""
  head = 'ghost clipping, per layer (mixed rule of Bu et al. 2022: ghost where S²(m + c) < S·m·c):'
  if forms == 'flops':
    return {}, [head]
  thetas = [ghost_clipping.coverage.subtree(params, l.param_path) for l in coverage.layers]
  choice = ghost_clipping.form_timing.choose_forms(coverage, thetas, batch_size, whole_step=step)
  if not choice.ghost and not choice.lines:
    return {}, [head]
  how = f'timed now in {choice.seconds:.1f} s' if choice.timed else 'read from the cache'
  return choice.ghost, [
    f'ghost clipping, per layer, forms measured on this device ({how}):',
    *choice.lines,
    'all layers:',
  ]


def clipped_sum_fn(
  loss_fn: LossFn, clip_norm: float, method: str = 'auto', forms: str = 'flops', check_vmap=None
):
  """`(params, examples, weights) -> (Σ_i w_i · clip_C(g_i), PerExample)` by `method`.

  The function's `choice` (a list of lines) says what it runs: per-example
  gradients, or ghost clipping with each layer's form; set when first traced
  for 'auto' and 'ghost' (the choice depends on the shapes).

  Args:
    loss_fn: `(params, example) -> (loss, aux)` for a single example (`with_aux`).
    clip_norm: C > 0.
    method: 'auto' (ghost where it covers every parameter, else vmap, logged),
      'vmap', or 'ghost' (ValueError at trace time if a parameter is uncovered).
    forms: how ghost clipping picks each layer's form: 'flops' (the mixed rule's FLOP
      counts) or 'measured' (`ghost_clipping.form_timing`: both forms timed on this device
      at the first trace, cached on disk beside jax's compilation cache). Speed only.
    check_vmap: optional `f(params)` called at trace time before per-example gradients are
      chosen (raises where they must not run, e.g. parameters split over a mesh).
  """
  if method not in CLIPPING_METHODS:
    raise ValueError(f'clipping method {method!r}; valid: {CLIPPING_METHODS}.')
  ghost_clipping.form_timing.check_form_rule(forms)
  clip_norm = checks.check_clip_norm(clip_norm, allow_inf=True)
  vmap_choice = ['per-example gradients (vmap), memory P x #params']

  def fn(params: Params, examples: Example, weights: jax.Array):
    if method == 'vmap':
      if check_vmap:
        check_vmap(params)
      fn.choice[:] = vmap_choice
      return vmap_clipped_sum(loss_fn, params, examples, weights, clip_norm)
    # Trace time: the coverage depends only on the model and the shapes.
    one = jax.tree.map(lambda l: l[0], examples)
    coverage = ghost_clipping.analyse_coverage(loss_fn, params, one)
    if coverage.complete:
      logging.info('clipping=%r: ghost clipping: %s', method, coverage.describe())
      step = ghost_clipping.whole_step.WholeStep(
        lambda p, ex, w: ghost_clipped_sum(loss_fn, p, ex, w, clip_norm, coverage),
        loss_fn,
        params,
        examples,
        weights,
      )  # Timed with both assignments of forms (random inputs of these shapes).
      table, head = _ghost_forms(coverage, params, weights.shape[0], forms, step)
      with ghost_clipping.mixed.chosen_forms(table):
        fn.choice[:] = [*head, *coverage.layer_forms()]
        return ghost_clipped_sum(loss_fn, params, examples, weights, clip_norm, coverage)
    if method == 'ghost':
      raise ValueError(
        "clipping='ghost' does not cover every parameter of this model: "
        f"{coverage.describe()}. Use 'auto' (falls back to 'vmap') or 'vmap'."
      )
    uncovered = ', '.join(f'{p} ({why})' for p, why in coverage.uncovered)
    if check_vmap:
      check_vmap(params)
    logging.warning(
      "clipping='auto': ghost clipping does not cover %s; using per-example "
      'gradients (vmap) for this model.',
      uncovered,
    )
    fn.choice[:] = [f'{vmap_choice[0]}; ghost clipping does not cover {uncovered}']
    return vmap_clipped_sum(loss_fn, params, examples, weights, clip_norm)

  fn.choice = list(vmap_choice) if method == 'vmap' else []  # Known once traced.
  return fn


def with_stats(sum_fn, clip_norm: float) -> ClippedSumFn:
  """`(params, batch) -> (sum, ClipStats)` from a `clipped_sum_fn` (batch: examples + weight)."""

  def fn(params: Params, batch: Batch) -> tuple[Params, ClipStats]:
    total, rows = sum_fn(params, examples_of(batch), batch['weight'])
    return total, ClipStats.of(rows, batch['weight'], clip_norm)

  fn.choice = sum_fn.choice
  return fn


def make_clipped_sum_fn(
  method: str, loss_fn: LossFn, clip_norm: float, forms: str = 'flops', check_vmap=None
) -> ClippedSumFn:
  """`(params, batch) -> (Σ_i w_i · clip_C(g_i), ClipStats)`: `clipped_sum_fn` on a batch dict.

  `loss_fn` returns (loss, aux); `choice`, `forms` and `check_vmap` as in `clipped_sum_fn`.
  """
  return with_stats(
    clipped_sum_fn(loss_fn, clip_norm, method, forms, check_vmap),
    checks.check_clip_norm(clip_norm, allow_inf=True),
  )


def per_example_clipped_sum(
  loss_fn: LossFn, params: Params, batch: Batch, clip_norm: float
) -> tuple[Params, ClipStats]:
  """`vmap_clipped_sum` on a batch dict, with its statistics."""
  total, rows = vmap_clipped_sum(loss_fn, params, examples_of(batch), batch['weight'], clip_norm)
  return total, ClipStats.of(rows, batch['weight'], clip_norm)


def clamp_weights(weights) -> jax.Array:
  """Row weights taken into [0, 1] (NaN: 0): a weight above 1 would multiply a row's
  sensitivity, a negative one would subtract a row."""
  weights = jnp.asarray(weights, jnp.float32)
  return jnp.where(weights > 0, jnp.minimum(weights, 1.0), 0.0)


def clipped_grad(
  loss_fn: LossFn,
  clip_norm: float,
  *,
  has_aux: bool = False,
  method: str = 'auto',
  precision: str = 'default',
  forms: str = 'flops',
):
  """DP-SGD's clipped gradient sum, shaped like `jax.grad`.

  Returns `grad_fn(params, examples, weights) -> (Σ_i w_i · clip_C(g_i), PerExample)`
  for any per-example loss `loss_fn(params, example) -> loss` (or `(loss, aux)` with
  has_aux; aux such as accuracy comes back per row in `PerExample.aux`). `examples` holds
  the rows (every leaf with a leading axis P); `weights` [P] is required: 1 for a real row,
  0 for padding (the batcher's `weights`; a padding row holds a copy of example 0 and must
  add exactly zero). Weights are taken into [0, 1] (a NaN is 0): a weight above 1 would
  multiply a row's sensitivity. Every row is clipped at C exactly; the float rounding of the
  norms and of the sum is paid for in ε, with the η of the `PrivacyPlan` (`plan.clipped_grad`
  binds C and the precision to the plan's accountant). Sum the physical batches of one
  logical step with `accumulator.GradSum` (η assumes a compensated sum) and add noise with
  `noise.gaussian_privatizer`.

  Args:
    loss_fn: a single example's loss; JAX-traceable, pure.
    clip_norm: C, finite and > 0.
    has_aux: whether loss_fn returns (loss, aux).
    method: 'auto' (ghost clipping where it covers every parameter, else vmap),
      'vmap' or 'ghost' (`dpjax.privacy.ghost_clipping`; linen and NNX layers).
    precision: 'default', 'highest' or 'bfloat16' (`dpjax.privacy.precision`): the matmul precision
      the gradients are computed in (bfloat16: the loss must cast itself, see `losses`).
    forms: 'flops' or 'measured': how ghost clipping picks each layer's form
      (`clipped_sum_fn`); speed only.
  """
  c = checks.check_clip_norm(clip_norm)  # Finite and > 0, as the noise transform checks it.
  precision_lib.check_precision(precision)
  # BatchNorm / Dropout state in the loss: Flax's error raised again with the fix.
  inner = clipped_sum_fn(with_aux(stateful_layers.explained(loss_fn), has_aux), c, method, forms)

  def grad_fn(params: Params, examples: Example, weights: jax.Array | None = None):
    if weights is None:
      raise TypeError(MISSING_WEIGHTS)
    weights = clamp_weights(weights)
    with precision_lib.matmul_precision(precision):
      return inner(params, examples, weights)

  grad_fn.choice = inner.choice
  grad_fn.clip_bound = c  # Each example is clipped at C itself.
  return grad_fn
