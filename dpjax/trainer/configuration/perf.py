"""Settings that change how fast a run goes and how much memory it takes, never what it releases.

`Perf` holds them as a type: the physical batch size P, the logical steps per compiled
call, the device count and the mesh's parameter axes with their placement rule, the
compilation cache and how clipping forms are chosen. The privacy fingerprint (`dpjax.trainer.planning.fingerprint.run_fingerprint`) takes no
`Perf`, so none of these can enter ε or block a resume: that is by construction, not a list
of exceptions. P matters to privacy only through the cap B (a multiple of P), which the plan
resolves and fingerprints itself.
`config.precision` is not among them: its matmul format sets η, the float rounding that ε
pays for (`dpjax.privacy.rounding`).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from dpjax.privacy import param_sharding
from dpjax.trainer.configuration import config_fields

# Perf field -> its config path (the config file keeps its familiar layout).
CONFIG_PATHS = {
  'physical_batch_size': 'sampler.physical_batch_size',
  'steps_per_call': 'steps_per_call',
  'num_devices': 'num_devices',
  'compilation_cache_dir': 'compilation_cache_dir',
  'clipping_forms': 'clipping_forms',
  'fsdp': 'mesh.fsdp',
  'tensor': 'mesh.tensor',
  'tensor_parallel': 'mesh.tensor_parallel',
  'min_sharded_size': 'mesh.min_sharded_size',
}


@dataclasses.dataclass(frozen=True)
class Perf:
  """Speed and memory settings of a run (none of them enters ε).

  Attributes:
    physical_batch_size: P, rows per physical batch (0 = the largest that fits the device,
      resolved by `dpjax.trainer.planning.physical_batch.resolve_physical_batch_size`).
    steps_per_call: logical steps per compiled call (0 = adaptive).
    num_devices: devices of the mesh (0 = all).
    compilation_cache_dir: jax's persistent compilation cache ('' = default, 'none' = off).
    clipping_forms: how ghost clipping picks each layer's form: 'flops' (the FLOP rule) or
      'measured' (timed on the device, `dpjax.privacy.ghost_clipping.form_timing`).
    fsdp, tensor: the mesh's parameter axes (`dpjax.privacy.sharding.make_mesh`).
    tensor_parallel, min_sharded_size: the placement rule (`param_sharding.ShardingRules`).
  """

  physical_batch_size: int
  steps_per_call: int
  num_devices: int
  compilation_cache_dir: str
  clipping_forms: str = 'flops'
  fsdp: int = 1
  tensor: int = 1
  tensor_parallel: bool = False
  min_sharded_size: int = param_sharding.MIN_SHARDED_SIZE

  @property
  def rules(self) -> param_sharding.ShardingRules:
    """Where the state lives on the mesh (`dpjax.privacy.param_sharding`)."""
    return param_sharding.ShardingRules(self.tensor_parallel, self.min_sharded_size)

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> Perf:
    """The Perf of a validated config; a field it lacks (an accounting-only config) has its
    declared default (`config_fields.FIELDS`)."""
    return cls(
      **{
        name: config_fields.get(config, path, config_fields.FIELDS_BY_PATH[path].default)
        for name, path in CONFIG_PATHS.items()
      }
    )
