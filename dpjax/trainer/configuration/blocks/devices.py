"""The device and speed fields of a training config, and the mesh's (`mesh.*`).

None enters ε, except precision, through η, the float rounding the accountant pays for; the
mesh changes where the state lives, never what a step releases.
"""

from dpjax.privacy import param_sharding
from dpjax.privacy.ghost_clipping import form_timing
from dpjax.trainer.configuration.field_spec import Field

FIELDS: tuple[Field, ...] = (
  Field(
    'num_devices',
    'int',
    0,
    'devices of the mesh: 0 = all; n > 0 = the first n (single '
    'process); P must be a multiple of n / (mesh.fsdp · mesh.tensor)',
    0,
  ),
  Field(
    'mesh.fsdp',
    'int',
    1,
    'devices that split each large parameter, its optimiser state and EMA (FSDP / ZeRO-3, '
    'dpjax/privacy/param_sharding.py) and hold different examples; mesh.fsdp · mesh.tensor '
    'must divide the device count, whose rest is the data axis; 1 = data parallel only',
    1,
  ),
  Field(
    'mesh.tensor',
    'int',
    1,
    'devices that share each example (the tensor axis): the state is split over them only '
    'with mesh.tensor_parallel',
    1,
  ),
  Field(
    'mesh.tensor_parallel',
    'bool',
    False,
    "split attention by head and MLP kernels column/row-wise over mesh.tensor (Megatron-LM's "
    'rules)',
  ),
  Field(
    'mesh.min_sharded_size',
    'int',
    param_sharding.MIN_SHARDED_SIZE,
    'parameters with fewer elements stay whole on every device (biases, norms)',
    1,
  ),
  Field(
    'precision',
    'str',
    'default',
    "default (the backend's matmul precision) | highest "
    '(float32) | bfloat16 (float32 master weights, bf16 compute); enters ε through η, the '
    'float rounding the accountant pays for (dpjax/privacy/rounding.py)',
    choices=('default', 'highest', 'bfloat16'),
  ),
  Field(
    'steps_per_call',
    'int',
    0,
    'logical steps per compiled call; 0 = automatic (16 on the '
    'device, fewer for slow steps so that a signal stops the run within about a step)',
    0,
    4096,
  ),
  Field(
    'compilation_cache_dir',
    'text',
    '',
    "persistent XLA cache: '' = $DPJAX_CACHE_DIR or "
    "~/.cache/dpjax/xla; 'none' = off; else a directory",
  ),
  Field(
    'clipping_forms',
    'str',
    'flops',
    "ghost clipping's form of each layer: flops (the "
    'FLOP rule of Bu et al. 2022) | measured (both forms of each layer timed on the device '
    'at the first compile, kept only if the whole clipped sum runs faster with them, cached '
    'beside the compilation cache; adds 20-300 s to the first compile on the CPU: '
    'scripts/results/bench_clipping_forms_cpu.json); speed only',
    choices=form_timing.FORM_RULES,
  ),
)
