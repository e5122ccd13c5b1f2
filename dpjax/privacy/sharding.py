"""The device mesh of DP training, and where batches live.

Three mesh axes span every device of every process: 'data' × 'fsdp' × 'tensor'
(`make_mesh`). Each physical batch [P, ...] is split over the devices that hold
different examples, 'data' × 'fsdp' (P/(data·fsdp) rows each); the 'tensor'
devices of one example group see the same rows. Where parameters, optimiser
state, EMA and the accumulator live is `dpjax.privacy.param_sharding`'s rule:
replicated over 'data', split over 'fsdp' (FSDP / ZeRO-3) and, with tensor
parallelism, over 'tensor'. With fsdp = tensor = 1 (the default) it is plain
data parallelism: everything but the batch replicated. Under `jax.jit` with these
shardings XLA's SPMD partitioner (GSPMD, Xu et al. 2021) splits the
per-example work and turns the sum of clipped gradients over the batch axis
into a cross-device reduction; nothing here hand-writes a collective.

The noise stays outside the reduction: it is drawn in the release from
noise_key(seed, step), a replicated input every process computes identically,
and added once per logical step to the already reduced sum (docs/accounting.md:
noise std on the *sum* is σ·C). Threefry is partitionable, so each device draws
only the coordinates of its own shard of a split parameter, bit-identical to a
one-device draw (`noise.standard_normals_like`). Ghost clipping's per-example
squared norms are sums over every parameter, hence over every shard, before the
clip factor; per-example gradients of a split parameter are refused
(`step_layout.check_vmap`).

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
FSDP_AXIS = 'fsdp'
TENSOR_AXIS = 'tensor'
MESH_AXES = (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS)
# The axes over which devices hold different examples: a batch's row axis is split over both.
EXAMPLE_AXES = (DATA_AXIS, FSDP_AXIS)


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


def make_mesh(num_devices: int = 0, fsdp: int = 1, tensor: int = 1) -> jax.sharding.Mesh:
  """The mesh ('data', 'fsdp', 'tensor') over all global devices (num_devices = 0) or the
  first `num_devices`: fsdp × tensor devices share each example group's state, and
  'data' takes the remaining num_devices / (fsdp · tensor).

  A subset is for single-process runs only: in a multi-host job every process must hold part
  of the mesh. fsdp · tensor must divide the device count.
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
  check_parameter_axes(len(devices), fsdp, tensor)
  shape = (len(devices) // (fsdp * tensor), fsdp, tensor)
  return jax.make_mesh(
    shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices
  )


def check_parameter_axes(num_devices: int, fsdp: int, tensor: int) -> None:
  """ValueError (one line, naming the field) unless fsdp and tensor are positive integers whose
  product divides the number of devices."""
  for name, value in (('fsdp', fsdp), ('tensor', tensor)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'mesh.{name} must be an integer >= 1, got {value!r}.')
  if num_devices % (fsdp * tensor):
    raise ValueError(
      f'mesh.fsdp × mesh.tensor = {fsdp} × {tensor} must divide the number of devices '
      f'({num_devices}); the data axis takes the rest.'
    )


def mesh_axis_size(mesh: jax.sharding.Mesh, axis: str) -> int:
  """The size of `axis` in mesh (1 for an axis the mesh does not have)."""
  return int(mesh.shape.get(axis, 1))


def example_groups(mesh: jax.sharding.Mesh) -> int:
  """How many devices hold different examples of a batch: data × fsdp."""
  return mesh_axis_size(mesh, DATA_AXIS) * mesh_axis_size(mesh, FSDP_AXIS)


def layout_name(mesh: jax.sharding.Mesh | None) -> dict[str, int]:
  """{'data': d, 'fsdp': f, 'tensor': t} of mesh (one device, no mesh: all 1): what a
  checkpoint records; never in the privacy fingerprint."""
  return {axis: 1 if mesh is None else mesh_axis_size(mesh, axis) for axis in MESH_AXES}


def _example_spec(*leading) -> jax.sharding.PartitionSpec:
  """leading Nones, then the row axis split over the example axes present in the mesh."""
  return jax.sharding.PartitionSpec(*leading, EXAMPLE_AXES)


def replicated(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """A full copy on every device (keys, counters, metrics; the state where it is not split)."""
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def batch_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """The leading (example) axis split over 'data' × 'fsdp'; other axes whole."""
  return jax.sharding.NamedSharding(mesh, _example_spec())


def logical_batch_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """A logical-batch buffer [K_max, P, ...]: the row axis (1) split over 'data' × 'fsdp'."""
  return jax.sharding.NamedSharding(mesh, _example_spec(None))


def chunk_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """Stacked logical batches [S, K_max, P, ...] (`dpjax.privacy.multi_step`): the row axis (2) split."""
  return jax.sharding.NamedSharding(mesh, _example_spec(None, None))


def check_physical_batch_size(physical_batch_size: int, mesh: jax.sharding.Mesh) -> None:
  """ValueError unless P splits evenly over the devices that hold different examples."""
  groups = example_groups(mesh)
  if physical_batch_size % groups:
    raise ValueError(
      f'sampler.physical_batch_size = {physical_batch_size} must be a multiple of the number '
      f'of devices that hold different examples ({groups} = data × fsdp of a '
      f'{mesh.devices.size}-device mesh over {jax.process_count()} process(es)), so that each '
      'takes P/(data·fsdp) rows; see num_devices and mesh.fsdp.'
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
