"""A logical batch as the compiled DP step reads it: a buffer of K_max physical batches.

The buffer has a leading axis K_max = ⌈B/P⌉, fixed for the run, so one executable serves
every step: {'x': [K_max, P, ...], 'y': [K_max, P (, classes)], 'weight': [K_max, P]}, or,
when the training set is on the device (a `dpjax.data.device.DeviceDataset`),
{'index': int32 [K_max, P], 'weight': [K_max, P]} and the rows are gathered inside the
program. Only the first K physical batches (K data, `clamp_num_batches`) are read.
"""

from typing import Any

import jax
import jax.numpy as jnp

from dpjax.privacy import augmult as augmult_lib

Batch = dict[str, jax.Array]


def num_slots(logical: Batch) -> int:
  """K_max, the buffer's number of physical batches (static)."""
  return jax.tree.leaves(logical)[0].shape[0]


def clamp_num_batches(num_batches, k_max: int) -> jax.Array:
  """K as int32 data, clamped to [0, K_max]."""
  return jnp.clip(jnp.asarray(num_batches, jnp.int32), 0, k_max)


def physical_batch(
  logical: Batch,
  i,
  step,
  dataset: Any = None,
  augmult: augmult_lib.Augmult | None = None,
  views_seed=None,
) -> Batch:
  """Physical batch i (traced) of `logical`, gathered from `dataset` if given.

  With `augmult`, its x becomes the rows' views [P, K, ...], made on the device from
  (views_seed, step, batch['index']) (`augmult.make_views`).
  """
  batch = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), logical)
  if dataset is not None:
    batch = dataset.gather(batch['index']) | {'weight': batch['weight'], 'index': batch['index']}
  if augmult is not None:
    if 'index' not in batch:
      raise ValueError(
        "augmult: the logical buffer must carry each row's example "
        "'index' (device_data.index_buffer / host_buffer do)."
      )
    batch = batch | {'x': augmult.views(batch['x'], batch['index'], step, seed=views_seed)}
  return batch
