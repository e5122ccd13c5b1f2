"""The device mesh of data-parallel training, and where batches and state live.

One mesh axis, 'data', spans every device of every process. Each physical
batch [P, ...] is split along it (P/D rows per device, D devices); parameters,
optimiser state and the accumulator are replicated. Under `jax.jit` with these
shardings XLA's SPMD partitioner (GSPMD, Xu et al. 2021) splits the
per-example work and turns the sum of clipped gradients over the batch axis
into a cross-device reduction; nothing here hand-writes a collective.

The Gaussian noise stays outside the reduction: it is drawn in `DPStep.apply`
from noise_key(seed, step), a replicated input every process computes
identically, so it is added exactly once per logical step to the already
reduced sum (docs/accounting.md: noise std on the *sum* is σ·C) and every
device holds the same update.

Multi-host: call `initialize_distributed` before anything touches a device.
Every process computes the same LogicalBatch (the sampler is a pure function
of (seed, step)), gathers only the rows of its own devices (`local_rows`) and
`shard_batch` assembles the global array from the process-local rows.
Launch: `python -m dpjax.train ... --distributed` on every host (README,
"Scaling").
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

DATA_AXIS = 'data'


def initialize_distributed(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
) -> None:
  """`jax.distributed.initialize`: joins this process to a multi-host job.

  Must run before any JAX computation. Arguments left as None are found by
  JAX: the coordinator from the environment variable JAX_COORDINATOR_ADDRESS
  (host:port of process 0), and all three under SLURM, Open MPI, Kubernetes or
  Cloud TPU. On CPU the cross-process reductions use gloo.
  """
  for name, value, low in (('num_processes', num_processes, 1), ('process_id', process_id, 0)):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
      raise ValueError(f'{name} must be an integer >= {low}, got {value!r}.')
  if num_processes is not None and process_id is not None and process_id >= num_processes:
    raise ValueError(f'process_id = {process_id} must be < num_processes = {num_processes}.')
  jax.distributed.initialize(
    coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
  )


def make_mesh(num_devices: int = 0) -> jax.sharding.Mesh:
  """A 1-D mesh with axis 'data' over all global devices (0) or the first `num_devices`.

  A subset is for single-process runs only: in a multi-host job every process
  must hold part of the mesh.
  """
  available = jax.device_count()
  if (
    isinstance(num_devices, bool)
    or not isinstance(num_devices, int)
    or not (0 <= num_devices <= available)
  ):
    raise ValueError(
      f'num_devices must be an integer in [0, {available}] (0 = all '
      f'{available} devices), got {num_devices!r}.'
    )
  if num_devices and num_devices != available and jax.process_count() > 1:
    raise ValueError(
      f'num_devices = {num_devices} selects a subset of the {available} devices, '
      f'which a {jax.process_count()}-process job cannot use; set num_devices = 0.'
    )
  devices = jax.devices()[: num_devices or available]
  return jax.make_mesh(
    (len(devices),), (DATA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices
  )


def replicated(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """A full copy on every device (parameters, optimiser state, accumulator, keys)."""
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def batch_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """The leading (example) axis split over 'data'; other axes whole."""
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(DATA_AXIS))


def logical_batch_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """A logical-batch buffer [K_max, P, ...]: the row axis (1) split over 'data'."""
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, DATA_AXIS))


def chunk_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """Stacked logical batches [S, K_max, P, ...] (`dpjax.privacy.multi_step`): the row axis (2) split."""
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, DATA_AXIS))


def check_physical_batch_size(physical_batch_size: int, mesh: jax.sharding.Mesh) -> None:
  """ValueError unless P splits evenly over the mesh's devices."""
  num_devices = mesh.devices.size
  if physical_batch_size % num_devices:
    raise ValueError(
      f'sampler.physical_batch_size = {physical_batch_size} must be a multiple of the number '
      f'of devices ({num_devices} in the data mesh, over {jax.process_count()} process(es)), so '
      'that every device takes P/D rows; see num_devices.'
    )


def local_rows(mesh: jax.sharding.Mesh, physical_batch_size: int) -> np.ndarray:
  """Rows of a physical batch held by this process's devices, in increasing order.

  All rows on one process; a 1/num_processes share of them on each of several.
  """
  check_physical_batch_size(physical_batch_size, mesh)
  index_map = batch_sharding(mesh).addressable_devices_indices_map((physical_batch_size,))
  rows = set()
  for (block,) in index_map.values():
    rows.update(range(*block.indices(physical_batch_size)))
  return np.asarray(sorted(rows), np.int64)


def shard_batch(
  mesh: jax.sharding.Mesh, local_batch: dict[str, np.ndarray]
) -> dict[str, np.ndarray | jax.Array]:
  """The batch [P, ...] for a function jitted with in_shardings `batch_sharding(mesh)`.

  Several processes: the global array sharded over 'data', assembled from
  each process's `local_rows`. One process: the numpy rows unchanged, which
  jit splits over the devices itself on its fast path (a Python-side
  device_put costs ~0.2 ms per batch, a third of a digits-MLP step).
  """
  if jax.process_count() == 1:
    return local_batch
  return jax.make_array_from_process_local_data(batch_sharding(mesh), local_batch)


def shard_chunk(
  mesh: jax.sharding.Mesh, local_buffer: dict[str, np.ndarray]
) -> dict[str, np.ndarray | jax.Array]:
  """`shard_batch` for stacked buffers [S, K_max, rows, ...] of this process's `local_rows`."""
  if jax.process_count() == 1:
    return local_buffer
  return jax.make_array_from_process_local_data(chunk_sharding(mesh), local_buffer)


def replicate(mesh: jax.sharding.Mesh, tree: Any) -> Any:
  """A pytree as global arrays replicated on every device of the mesh.

  Every process must pass the same values (e.g. parameters initialised from
  the same seed); a single-process run merely copies them to each device.
  """
  host = jax.tree.map(np.asarray, jax.device_get(tree))
  return jax.make_array_from_process_local_data(replicated(mesh), host)


def is_primary_process() -> bool:
  """Whether this process writes metrics, logs and the resolved config (process 0)."""
  return jax.process_index() == 0
