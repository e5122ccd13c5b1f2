"""Evaluation of a whole split: the mean loss and accuracy of `losses.eval_step` sums.

Not covered by ε: the trainer reports these under `nonprivate_*` names (held-out data).
"""

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.data import sources as data
from dpjax.privacy import sharding


def evaluate(
  step_fn, params, source: data.DataSource, physical_batch_size: int, mesh: jax.sharding.Mesh
) -> dict[str, float]:
  """Loss and accuracy over a whole split, in zero-weight-padded batches sharded like training."""
  rows = sharding.local_rows(mesh, physical_batch_size)
  totals = None
  for start in range(0, len(source), physical_batch_size):
    indices = np.arange(start, min(start + physical_batch_size, len(source)))
    weights = np.zeros(physical_batch_size, np.float32)
    weights[: len(indices)] = 1
    padded = np.zeros(physical_batch_size, np.int64)
    padded[: len(indices)] = indices
    batch = source.gather(padded[rows])
    batch['weight'] = weights[rows]
    out = step_fn(params, sharding.shard_batch(mesh, batch))
    totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
  totals = jax.device_get(totals)
  return {
    'eval_loss': float(totals['loss_sum'] / totals['num_examples']),
    'eval_accuracy': float(totals['correct'] / totals['num_examples']),
  }
