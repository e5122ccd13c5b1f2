"""The monitoring values of a clipped sum: per row, and summed over a physical batch.

They come from the raw batch and are NOT differentially private (the trainer logs them; it
must not release them as if they were). `dpjax.privacy.clipping` returns them beside the sum.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class PerExample(NamedTuple):
  """Per-row values of one clipped sum (monitoring only: NOT differentially private)."""

  loss: jax.Array  # [P] loss_i.
  aux: Any  # The loss's aux, rows stacked ([P, ...] leaves); () without aux.
  norm: jax.Array  # [P] ‖g_i‖ before clipping.
  finite: jax.Array  # [P] bool: loss_i and ‖g_i‖ finite (else the row added exactly 0).


class ClipStats(NamedTuple):
  """Sums over the real (weight > 0) rows of a physical batch. Not private."""

  num_rows: jax.Array  # Σ w_i (float32).
  num_clipped: jax.Array  # #{finite rows with ‖g_i‖ > C} (int32).
  num_nonfinite: jax.Array  # #{rows with non-finite gradient or loss} (int32).
  loss_sum: jax.Array  # Σ w_i · loss_i over finite rows (float32).
  correct: jax.Array  # Σ w_i · aux_i['correct'] (a classification loss's aux), else 0.
  grad_norm_sum: jax.Array  # Σ w_i · ‖g_i‖ over finite rows, before clipping.

  @classmethod
  def zeros(cls) -> 'ClipStats':
    # Distinct buffers: the accumulator holding them is donated.
    f = lambda: jnp.zeros((), jnp.float32)
    i = lambda: jnp.zeros((), jnp.int32)
    return cls(f(), i(), i(), f(), f(), f())

  @classmethod
  def of(cls, rows: PerExample, weights: jax.Array, clip_norm: float) -> 'ClipStats':
    """The sums of `rows` with weights w (rows with w = 0 are padding)."""
    w = weights.astype(jnp.float32)
    real = w > 0
    ok = real & rows.finite
    correct = rows.aux.get('correct') if isinstance(rows.aux, dict) else None
    return cls(
      num_rows=jnp.sum(w),
      num_clipped=jnp.sum(ok & (rows.norm > clip_norm), dtype=jnp.int32),
      num_nonfinite=jnp.sum(real & ~rows.finite, dtype=jnp.int32),
      loss_sum=jnp.sum(jnp.where(ok, w * rows.loss, 0.0)),
      correct=(
        jnp.zeros((), jnp.float32)
        if correct is None
        else jnp.sum(jnp.where(ok, w * correct.astype(jnp.float32), 0.0))
      ),
      grad_norm_sum=jnp.sum(jnp.where(ok, w * rows.norm, 0.0)),
    )
