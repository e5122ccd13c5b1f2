"""Where each array of the training state lives on a mesh with parameter axes (FSDP, tensor).

The mesh is ('data', 'fsdp', 'tensor') (`dpjax.privacy.sharding.make_mesh`). Every array of
the state (parameters, optimiser state, EMA, the accumulator, a correlated privatizer's
noise state) is replicated over 'data' and placed over 'fsdp' and 'tensor' by one rule
applied to the parameter it belongs to:

* tensor parallel (`ShardingRules.tensor_parallel`, Shoeybi et al. 2019, "Megatron-LM"):
  attention projections split by head (flax's query / key / value kernels [D, H, d_h] on
  H, their biases [H, d_h] on H; the out kernel [H, d_h, D] on H), dense kernels [in, out]
  that widen (out > in: an MLP's first layer) split on out, and those that narrow (in > out:
  its second layer) on in; 1-D biases stay whole (small). Megatron's pairing — the partial sums of a
  row-parallel layer reduced once — falls out of XLA's SPMD partitioner (GSPMD, Xu et al.
  2021); nothing here writes a collective.
* FSDP (Rajbhandari et al. 2020, "ZeRO" stage 3; Zhao et al. 2023, "PyTorch FSDP"): the
  largest dimension still free and divisible by the 'fsdp' size is split over 'fsdp'
  (the first such, on ties); arrays under `min_sharded_size` elements, or with no divisible
  dimension, stay replicated.

A state leaf that is not a parameter itself (Adam's μ and ν, an EMA, the accumulator's sum,
a banded noise history [b−1, *shape]) takes the placement of the parameter whose path ends
its own path and whose shape ends its own shape, on its trailing axes; every other leaf
(counters, keys, scalars) is replicated. Placement changes where a value is computed, never
the value: what a step releases is the same on every layout up to float32 reduction order
(tests/privacy/test_param_sharding.py), and the Gaussian noise is bit-identical (threefry is
partitionable: each shard draws its own coordinates' normals).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from dpjax.privacy import sharding

P = jax.sharding.PartitionSpec
MIN_SHARDED_SIZE = 2**10  # Elements (4 KiB in float32): smaller arrays (biases, norms) stay whole.
ATTENTION_HEAD_PROJECTIONS = ('query', 'key', 'value')
ATTENTION_OUTPUT = 'out'


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """How parameters are placed over the mesh's 'fsdp' and 'tensor' axes (module docstring).

  Attributes:
    tensor_parallel: apply the tensor-parallel rules for attention and dense layers (needs a
      'tensor' axis of size > 1 to have an effect).
    min_sharded_size: arrays with fewer elements are not split over 'fsdp'.
  """

  tensor_parallel: bool = False
  min_sharded_size: int = MIN_SHARDED_SIZE

  def __post_init__(self):
    value = self.min_sharded_size
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'min_sharded_size must be an integer >= 1, got {value!r}.')


def path_names(path) -> tuple[str, ...]:
  """A pytree key path as plain names: dict keys, attribute names, sequence indices."""
  names = []
  for key in path:
    for attribute in ('key', 'name', 'idx'):
      if hasattr(key, attribute):
        names.append(str(getattr(key, attribute)))
        break
    else:
      names.append(str(key))
  return tuple(names)


def _tensor_axis(names: tuple[str, ...], shape: tuple[int, ...], size: int) -> int | None:
  """The axis a tensor-parallel rule splits over 'tensor' (None: no rule applies)."""
  layer = names[-2] if len(names) >= 2 else ''
  leaf = names[-1] if names else ''
  heads = layer in ATTENTION_HEAD_PROJECTIONS
  axis = None
  if heads and leaf == 'kernel' and len(shape) == 3:
    axis = 1  # [D, H, d_h]: split by head.
  elif (heads and leaf == 'bias' and len(shape) == 2) or (
    layer == ATTENTION_OUTPUT and leaf == 'kernel' and len(shape) == 3
  ):
    axis = 0  # [H, d_h] or [H, d_h, D]: split by head.
  elif leaf == 'kernel' and len(shape) == 2 and shape[0] != shape[1]:
    axis = 1 if shape[1] > shape[0] else 0
  return axis if axis is not None and shape[axis] % size == 0 else None


def parameter_spec(
  names: tuple[str, ...], shape: tuple[int, ...], mesh: jax.sharding.Mesh, rules: ShardingRules
) -> P:
  """The PartitionSpec of the parameter at path `names` with `shape` (module docstring)."""
  axes: list[str | None] = [None] * len(shape)
  tensor = sharding.mesh_axis_size(mesh, sharding.TENSOR_AXIS)
  if rules.tensor_parallel and tensor > 1:
    axis = _tensor_axis(names, shape, tensor)
    if axis is not None:
      axes[axis] = sharding.TENSOR_AXIS
  fsdp = sharding.mesh_axis_size(mesh, sharding.FSDP_AXIS)
  if fsdp > 1 and int(np.prod(shape, dtype=np.int64)) >= rules.min_sharded_size:
    free = [i for i, a in enumerate(axes) if a is None and shape[i] % fsdp == 0]
    if free:
      axes[max(free, key=lambda i: (shape[i], -i))] = sharding.FSDP_AXIS
  while axes and axes[-1] is None:
    axes.pop()
  return P(*axes)


def parameter_specs(params: Any, mesh: jax.sharding.Mesh, rules: ShardingRules) -> Any:
  """The PartitionSpec of every parameter, as a tree like params."""
  return jax.tree_util.tree_map_with_path(
    lambda path, p: parameter_spec(path_names(path), tuple(np.shape(p)), mesh, rules), params
  )


def state_specs(
  tree: Any, params: Any, mesh: jax.sharding.Mesh, rules: ShardingRules = ShardingRules()
) -> Any:
  """The PartitionSpec of every leaf of a state tree (params, optimiser or noise state, EMA,
  accumulator): the placement of the parameter whose path and shape end the leaf's, on its
  trailing axes, else replicated (module docstring)."""
  by_path = {}
  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    names, shape = path_names(path), tuple(np.shape(p))
    by_path[names] = (shape, parameter_spec(names, shape, mesh, rules))

  def spec(path, leaf) -> P:
    names, shape = path_names(path), tuple(np.shape(leaf))
    for start in range(len(names)):
      match = by_path.get(names[start:])
      if match is None:
        continue
      param_shape, param_spec = match
      extra = len(shape) - len(param_shape)
      if extra >= 0 and shape[extra:] == param_shape:
        return P(*([None] * extra), *param_spec)
    return P()

  return jax.tree_util.tree_map_with_path(spec, tree)


def state_shardings(
  tree: Any, params: Any, mesh: jax.sharding.Mesh, rules: ShardingRules = ShardingRules()
) -> Any:
  """`state_specs` as NamedShardings over mesh (what jit's in/out_shardings take)."""
  return jax.tree.map(
    lambda spec: jax.sharding.NamedSharding(mesh, spec),
    state_specs(tree, params, mesh, rules),
    is_leaf=lambda x: isinstance(x, P),
  )


def constrain(
  tree: Any, params: Any, mesh: jax.sharding.Mesh | None, rules: ShardingRules = ShardingRules()
) -> Any:
  """`tree` (traced) held to `state_shardings` inside a jitted program, so what a program
  returns keeps the layout its state came in (no mesh: `tree` unchanged)."""
  if mesh is None:
    return tree
  return jax.lax.with_sharding_constraint(tree, state_shardings(tree, params, mesh, rules))


def place(tree: Any, shardings: Any) -> Any:
  """A pytree of host values as global arrays with these shardings (a tree like it). Every
  process passes the same full values (e.g. parameters from the same seed); each keeps its
  own devices' shards."""
  host = jax.tree.map(np.asarray, jax.device_get(tree))
  return jax.tree.map(
    lambda sharding_, x: jax.make_array_from_callback(x.shape, sharding_, lambda i: x[i]),
    shardings,
    host,
  )


def bytes_per_device(tree: Any, shardings: Any) -> int:
  """The largest number of bytes of `tree` (arrays or ShapeDtypeStructs) that any one device
  holds under `shardings` (a tree like it): the size of each leaf's shard on that device."""
  totals: dict[Any, int] = {}
  for leaf, sharding_ in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
    itemsize = np.dtype(leaf.dtype).itemsize
    for device, index in sharding_.devices_indices_map(tuple(np.shape(leaf))).items():
      shape = [len(range(*s.indices(n))) for s, n in zip(index, np.shape(leaf), strict=True)]
      totals[device] = totals.get(device, 0) + int(np.prod(shape, dtype=np.int64)) * itemsize
  return max(totals.values(), default=0)


def is_sharded(spec: P) -> bool:
  """Whether a PartitionSpec splits any axis (False: replicated)."""
  return any(axis is not None for axis in spec)


def describe(mesh: jax.sharding.Mesh, rules: ShardingRules) -> str:
  """One line: the mesh's axes and the placement rule."""
  shape = sharding.layout_name(mesh)
  rule = []
  if shape[sharding.FSDP_AXIS] > 1:
    rule.append(f'FSDP over {shape[sharding.FSDP_AXIS]} (arrays >= {rules.min_sharded_size})')
  if rules.tensor_parallel and shape[sharding.TENSOR_AXIS] > 1:
    rule.append(f'tensor parallel over {shape[sharding.TENSOR_AXIS]}')
  where = ', '.join(rule) or 'replicated state (data parallel)'
  return f'mesh data={shape["data"]} fsdp={shape["fsdp"]} tensor={shape["tensor"]}: {where}'
