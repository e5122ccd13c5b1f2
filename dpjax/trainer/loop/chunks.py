"""The host side of the loop's calls: the batcher, and each call's stacked logical batches.

A call runs S logical steps (`dpjax.privacy.multi_step`); its chunk holds their
logical batches as [S, K_max, P] buffers of this host's rows: indices into the
training set on the device, or the rows themselves gathered on the host.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import jax

from dpjax.data import device as device_data
from dpjax.data import sources as data
from dpjax.privacy import batching
from dpjax.privacy import multi_step
from dpjax.privacy import sharding
from dpjax.trainer.planning import plan as plan_lib


def serial_dispatch(mesh: jax.sharding.Mesh) -> bool:
  """Whether calls run one at a time with no thread beside them: XLA:CPU with several devices.

  There a call's collectives share the host's cores with everything else: the
  loop waits for each call before the next call's buffers are sent, prepares
  chunks inline (no prefetch thread) and computes ε when asked (no thread ahead).
  Accelerators keep the asynchronous queue and the overlap.
  """
  return mesh.devices.size > 1 and jax.devices()[0].platform == 'cpu'


def make_batcher(plan: plan_lib.RunPlan) -> batching.Batcher:
  """The batcher of the plan's sampler, B (the accountant's) and (resolved) P: the pure
  function of (seed, t), whose step counter is the loop's checkpointed step."""
  cap = plan.privacy.max_batch_size if plan.private else plan.max_batch_size
  return batching.Batcher(plan.sampler, plan.perf.physical_batch_size, cap)


def make_chunks(
  calls: Iterable[tuple[int, int]],
  batcher: batching.Batcher,
  train_source: data.DataSource,
  dataset,
  mesh: jax.sharding.Mesh,
  size: int,
  serial: bool,
):
  """A context manager over (call, `multi_step.Chunk`) for each (first step, count) of `calls`.

  With the training set on the device (`dataset`) a chunk holds indices, made
  when asked; otherwise the rows are gathered on the host, prefetched on a
  thread (inline with `serial`).
  """
  rows = sharding.local_rows(mesh, batcher.physical_batch_size)

  def prepare(call: tuple[int, int]) -> multi_step.Chunk:
    """The logical batches of a call as [S, K_max, P] buffers (this host's rows) and their K."""
    first, count = call
    prepared = []
    for t in range(first, first + count):
      logical = batcher.logical_batch(t)
      buffer, k = (
        device_data.index_buffer(logical, batcher.max_physical_batches, rows, num_rows=len(dataset))
        if dataset is not None
        else device_data.host_buffer(train_source, logical, batcher.max_physical_batches, rows)
      )
      prepared.append((logical, buffer, k))
    chunk = multi_step.stack(first, prepared, size)
    chunk.buffer = sharding.shard_chunk(mesh, chunk.buffer)
    return chunk

  if dataset is not None or serial:
    return contextlib.nullcontext((call, prepare(call)) for call in calls)
  return device_data.Prefetcher(prepare, calls)
