"""The DP step's side of gradient canaries: inject them into the clipped sum, project on them.

`with_gradient_canaries` wraps any `(params, batch) -> (Σ_i w_i clip_C(g_i), stats)`
function (`dpjax.privacy.clipping.make_clipped_sum_fn`, or `clipping.grad_sum` for a
non-private run). For a batch with a `canary_id` column (see
`canaries.CanarySource`) it gives

  Σ_{ordinary i} w_i · clip_C(g_i)  +  Σ_{canary rows i} w_i · S_{j(i)} · min(λ, C) · u_{j(i)},

where S_j ∈ {0, 1} is canary j's coin and u_j = s_j e_{c_j}: the canary's raw
gradient λ·u_j (λ = gradient_scale·C ≥ C) is clipped like any gradient. Its
norm is ≤ C, so the sensitivity the accountant assumes holds; an excluded
canary contributes exactly zero (an absent example). The canary rows' own
inputs are ignored (weight 0 in the wrapped call, so they do not count in the
monitoring statistics either).
"""

from __future__ import annotations

import math

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

from dpjax.privacy.auditing import canaries as canaries_lib


def with_gradient_canaries(
  clipped_sum_fn, canaries: canaries_lib.CanarySet, *, canary_norm: float, clip_norm: float
):
  """`clipped_sum_fn` with canary rows' gradients replaced by clip_C(λ·u_j), times their coin.

  Args:
    clipped_sum_fn: `(params, batch) -> (grad_sum pytree, stats)`; batch without `canary_id`.
    canaries: the run's canaries (coins, coordinates, signs).
    canary_norm: λ, the raw norm of a canary's gradient (canaries.gradient_scale · C).
    clip_norm: the clip bound applied to it (math.inf: no clipping, the non-private baseline).
  """
  if not canary_norm > 0:
    raise ValueError(f'canary_norm must be > 0, got {canary_norm}.')
  contribution = min(float(canary_norm), float(clip_norm))
  if not math.isfinite(contribution):
    raise ValueError('canary_norm and clip_norm cannot both be infinite.')
  member = jnp.asarray(canaries.membership, jnp.float32)
  coordinates = jnp.asarray(canaries.coordinates, jnp.int32)
  signs = jnp.asarray(canaries.signs, jnp.float32)

  def fn(params, batch):
    batch = dict(batch)
    canary_id = batch.pop('canary_id')
    is_canary = canary_id >= 0
    w = batch['weight'].astype(jnp.float32)
    batch['weight'] = jnp.where(is_canary, 0.0, w)
    grad_sum, stats = clipped_sum_fn(params, batch)
    j = jnp.where(is_canary, canary_id, 0)
    amount = jnp.where(is_canary, w, 0.0) * member[j] * signs[j] * contribution
    flat, unravel = jax.flatten_util.ravel_pytree(grad_sum)
    return unravel(flat.at[coordinates[j]].add(amount.astype(flat.dtype))), stats

  return fn


def project(tree, canaries: canaries_lib.CanarySet) -> np.ndarray:
  """⟨tree, u_j⟩ for every canary: s_j · (flattened tree)[c_j], float64 [m]."""
  flat = np.asarray(jax.flatten_util.ravel_pytree(tree)[0], np.float64)
  if flat.size != canaries.num_params:
    raise ValueError(
      f'the parameters have {flat.size} entries, the canaries were drawn for '
      f'{canaries.num_params}; not the run that drew them.'
    )
  return canaries.signs.astype(np.float64) * flat[canaries.coordinates]


def canary_counts(canary_id: np.ndarray, weights: np.ndarray, num_canaries: int) -> np.ndarray:
  """How many times each canary row is in a logical batch (weight > 0), int [m]."""
  canary_id, weights = np.ravel(canary_id), np.ravel(weights)
  keep = (canary_id >= 0) & (weights > 0)
  return np.bincount(canary_id[keep], minlength=num_canaries)
