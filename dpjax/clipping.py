"""Weighted sums of per-example clipped gradients over one physical batch.

DP-SGD's sensitivity bound: each example contributes w_i · clip_C(g_i) with

  clip_C(g) = g · min(1, C / ‖g‖₂),

where ‖·‖₂ is the global L2 norm over *all* parameters (Abadi et al. 2016,
"Deep Learning with Differential Privacy", Alg. 1) and w_i ∈ {0, 1} is the row
weight (0 for padding rows of a static-shape physical batch, the masked DP-SGD
of Beltran et al., seed 002, Alg. 2). So ‖w_i · clip_C(g_i)‖ ≤ C whatever the
example, which is what the accountant assumes (docs/accounting.md: each
clipped gradient is a query of norm ≤ 1 after dividing by C).

A per-example gradient with any NaN/inf entry, or whose squared norm
overflows, or whose loss is not finite, is replaced by zero (still a function
of that example alone with norm ≤ C, so the bound holds) and counted in
`num_nonfinite`. (The two methods compute ‖g_i‖² in different orders, so an
example at the edge of float32 overflow may be finite for one and not the
other; either way its contribution has norm ≤ C.)

Loss functions act on ONE example: `loss_fn(params, x_i, y_i) -> (loss_i,
logits_i)`; y_i is an int label or a one-hot vector. The statistics
(`ClipStats`) are for monitoring and are NOT differentially private.

Methods (`config.privacy.clipping`), all giving the same clipped sum:
  'vmap': per-example gradients with `jax.vmap(jax.grad(...))` (Subramani et
    al. 2021, "Enabling Fast Differentially Private SGD via Just-in-Time
    Compilation and Vectorization"); memory P × #params.
  'ghost': per-example norms from layer inputs and output gradients, then
    the clipped sum book-kept layer by layer (`dpjax.ghost_clipping`: Li et
    al. 2022, Bu et al. 2022/2023); no per-example gradients of the large
    layers, about the cost and memory of one non-private step plus the
    norms. Only for models whose every parameter it covers (ValueError
    otherwise, at trace time).
  'auto' (default): 'ghost' when it covers every parameter, else 'vmap' with
    a log line naming the uncovered parameters. Decided at trace time from
    the shapes, so it costs no recompilation.
"""

from collections.abc import Callable
import functools
import logging
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dpjax import ghost_clipping

Params = Any
Batch = dict[str, jax.Array]
LossFn = Callable[[Params, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
ClippedSumFn = Callable[[Params, Batch], tuple[Params, 'ClipStats']]

CLIPPING_METHODS = ('auto', 'vmap', 'ghost')


class ClipStats(NamedTuple):
  """Sums over the real (weight > 0) rows of a physical batch. Not private."""
  num_rows: jax.Array  # Σ w_i (float32).
  num_clipped: jax.Array  # #{finite rows with ‖g_i‖ > C} (int32).
  num_nonfinite: jax.Array  # #{rows with non-finite gradient or loss} (int32).
  loss_sum: jax.Array  # Σ w_i · loss_i over finite rows (float32).
  correct: jax.Array  # Σ w_i · [argmax logits_i = label_i] (float32).
  grad_norm_sum: jax.Array  # Σ w_i · ‖g_i‖ over finite rows, before clipping.

  @classmethod
  def zeros(cls) -> 'ClipStats':
    # Distinct buffers: the accumulator holding them is donated.
    f = lambda: jnp.zeros((), jnp.float32)
    i = lambda: jnp.zeros((), jnp.int32)
    return cls(f(), i(), i(), f(), f(), f())


def _labels(y: jax.Array, logits: jax.Array) -> jax.Array:
  """Int labels from int labels [P] or one-hot labels [P, classes]."""
  return jnp.argmax(y, axis=-1) if y.ndim == logits.ndim else y


def _row_sq_norms(grads: Params) -> jax.Array:
  """‖g_i‖² over all parameters; per-example gradients have a leading axis."""
  leaves = jax.tree.leaves(grads)
  return sum(jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), axis=1)
             for g in leaves)


def _weighted_row_sum(factor: jax.Array, grads: Params,
                      keep: jax.Array) -> Params:
  """Σ_i factor_i · g_i, with rows where keep is False set to exact zeros."""
  def one(g):
    mask = keep.reshape((-1,) + (1,) * (g.ndim - 1))
    return jnp.tensordot(factor, jnp.where(mask, g, 0.0), axes=1)
  return jax.tree.map(one, grads)


def _clip_and_sum(losses: jax.Array, logits: jax.Array, sq_norms: jax.Array,
                  weighted_sum: Callable[[jax.Array, jax.Array], Params],
                  batch: Batch, clip_norm: float) -> tuple[Params, ClipStats]:
  """Clip factors from ‖g_i‖², the weighted sum, and the statistics.

  A row is finite iff its loss and ‖g_i‖ are finite; other rows contribute
  exactly zero (weighted_sum must not let 0 · NaN through) and are counted.
  """
  w = batch['weight'].astype(jnp.float32)
  norms = jnp.sqrt(sq_norms)
  finite = jnp.isfinite(norms) & jnp.isfinite(losses)
  scale = jnp.where(finite, jnp.minimum(1.0, clip_norm / norms), 0.0)
  grad_sum = weighted_sum(w * scale, finite)
  real = w > 0
  stats = ClipStats(
      num_rows=jnp.sum(w),
      num_clipped=jnp.sum(real & finite & (norms > clip_norm), dtype=jnp.int32),
      num_nonfinite=jnp.sum(real & ~finite, dtype=jnp.int32),
      loss_sum=jnp.sum(jnp.where(real & finite, w * losses, 0.0)),
      correct=jnp.sum(w * (jnp.argmax(logits, -1) == _labels(batch['y'],
                                                              logits))),
      grad_norm_sum=jnp.sum(jnp.where(real & finite, w * norms, 0.0)))
  return grad_sum, stats


def per_example_clipped_sum(loss_fn: LossFn, params: Params, batch: Batch,
                            clip_norm: float) -> tuple[Params, ClipStats]:
  """Σ_i w_i · clip_C(g_i) over one physical batch (vmap per-example grads).

  Args:
    loss_fn: `(params, x_i, y_i) -> (loss_i, logits_i)` for a single example.
    params: model parameters (pytree).
    batch: {'x': [P, ...], 'y': [P] int or [P, classes] one-hot,
      'weight': [P] float32 in {0, 1}}.
    clip_norm: C > 0 (math.inf disables clipping; it still zeroes non-finite
      rows).

  Returns:
    (grad_sum, stats): grad_sum has the structure of params.
  """
  grad_fn = jax.vmap(jax.value_and_grad(loss_fn, has_aux=True),
                     in_axes=(None, 0, 0))
  (losses, logits), grads = grad_fn(params, batch['x'], batch['y'])
  return _clip_and_sum(losses, logits, _row_sq_norms(grads),
                       lambda factor, keep: _weighted_row_sum(factor, grads,
                                                              keep),
                       batch, clip_norm)


def ghost_clipped_sum(
    loss_fn: LossFn, params: Params, batch: Batch, clip_norm: float,
    coverage: ghost_clipping.Coverage | None = None,
) -> tuple[Params, ClipStats]:
  """Σ_i w_i · clip_C(g_i) by ghost norms and book-keeping (same result).

  Same arguments and result as `per_example_clipped_sum`; no per-example
  gradient is formed (see `dpjax.ghost_clipping`). Raises ValueError (at
  trace time) if some parameter is not covered.
  """
  out = ghost_clipping.ghost_pass(loss_fn, params, batch['x'], batch['y'],
                                  coverage)
  return _clip_and_sum(out.losses, out.logits, out.sq_norms,
                       out.weighted_sum, batch, clip_norm)


def grad_sum(loss_fn: LossFn, params: Params,
             batch: Batch) -> tuple[Params, ClipStats]:
  """Non-private Σ_i w_i · g_i by one backward pass of Σ_i w_i · loss_i.

  No clipping. Rows with a non-finite input or loss are dropped and counted.
  A non-finite value that arises inside the network from a finite input cannot
  be traced to its row without per-example gradients: if the summed gradient is
  non-finite, the whole physical batch is dropped (zero gradient) and all its
  rows are counted as non-finite. `num_clipped` and `grad_norm_sum` are 0.
  """
  x, y = batch['x'], batch['y']
  w = batch['weight'].astype(jnp.float32)
  real = w > 0
  x_finite = jnp.all(jnp.isfinite(x.reshape(x.shape[0], -1)), axis=1)
  x = jnp.where(x_finite.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)

  def weighted_loss(p):
    losses, logits = jax.vmap(loss_fn, in_axes=(None, 0, 0))(p, x, y)
    keep = real & x_finite & jnp.isfinite(losses)
    return jnp.sum(jnp.where(keep, w * losses, 0.0)), (logits, keep)

  (loss_sum, (logits, keep)), g = jax.value_and_grad(
      weighted_loss, has_aux=True)(params)
  ok = jnp.isfinite(sum(jnp.sum(jnp.square(l)) for l in jax.tree.leaves(g)))
  g = jax.tree.map(lambda l: jnp.where(ok, l, 0.0), g)
  num_nonfinite = jnp.sum(real & ~keep, dtype=jnp.int32)
  zero = jnp.zeros((), jnp.float32)
  stats = ClipStats(
      num_rows=jnp.sum(w),
      num_clipped=jnp.zeros((), jnp.int32),
      num_nonfinite=jnp.where(ok, num_nonfinite,
                              jnp.sum(real, dtype=jnp.int32)),
      loss_sum=jnp.where(ok, loss_sum, zero),
      correct=jnp.sum(w * (jnp.argmax(logits, -1) == _labels(y, logits))),
      grad_norm_sum=zero)
  return g, stats


def validate_clip_norm(clip_norm: float) -> float:
  """C must be a number > 0 (math.inf allowed); ValueError otherwise."""
  try:
    c = float(clip_norm)
  except (TypeError, ValueError):
    c = math.nan
  if not c > 0:  # Also rejects NaN.
    raise ValueError(f'config.privacy.clip_norm must be > 0 (inf disables '
                     f'clipping), got {clip_norm!r}.')
  return c


def make_clipped_sum_fn(method: str, loss_fn: LossFn,
                        clip_norm: float) -> ClippedSumFn:
  """`(params, batch) -> (Σ_i w_i · clip_C(g_i), ClipStats)` for `method`.

  The function's `choice` (a list of lines) says what it runs: per-example
  gradients, or ghost clipping with each layer's form; set when first traced
  for 'auto' and 'ghost' (the choice depends on the shapes).

  Args:
    method: `config.privacy.clipping`: 'auto' (ghost where it covers every
      parameter, else vmap, logged), 'vmap', or 'ghost' (ValueError at trace
      time if a parameter is uncovered).
    loss_fn: single-example loss, see `per_example_clipped_sum`.
    clip_norm: C > 0.
  """
  if method not in CLIPPING_METHODS:
    raise ValueError(f'config.privacy.clipping={method!r}; valid: '
                     f'{CLIPPING_METHODS}.')
  clip_norm = validate_clip_norm(clip_norm)
  vmap_choice = ['per-example gradients (vmap), memory P x #params']
  if method == 'vmap':
    clipped_sum = functools.partial(per_example_clipped_sum, loss_fn, clip_norm=clip_norm)
    clipped_sum.choice = vmap_choice
    return clipped_sum

  def clipped_sum(params: Params, batch: Batch) -> tuple[Params, ClipStats]:
    # Trace time: the coverage depends only on the model and the shapes.
    coverage = ghost_clipping.analyse_coverage(
        loss_fn, params, batch['x'][0], batch['y'][0])
    if coverage.complete:
      logging.info("clipping=%r: ghost clipping: %s", method,
                   coverage.describe())
      clipped_sum.choice[:] = ['ghost clipping, per layer (mixed rule of Bu et al. 2022: '
                               'ghost where S²(m + c) < S·m·c):', *coverage.layer_forms()]
      return ghost_clipped_sum(loss_fn, params, batch, clip_norm, coverage)
    if method == 'ghost':
      raise ValueError(
          "config.privacy.clipping='ghost' does not cover every parameter of "
          f"this model: {coverage.describe()}. Use 'auto' (falls back to "
          "'vmap') or 'vmap'.")
    uncovered = ', '.join(f'{p} ({why})' for p, why in coverage.uncovered)
    logging.warning(
        "clipping='auto': ghost clipping does not cover %s; using per-example "
        'gradients (vmap) for this model.', uncovered)
    clipped_sum.choice[:] = [f'{vmap_choice[0]}; ghost clipping does not cover {uncovered}']
    return per_example_clipped_sum(loss_fn, params, batch, clip_norm)
  clipped_sum.choice = []  # Known once traced.
  return clipped_sum
