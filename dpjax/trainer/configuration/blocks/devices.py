"""The device and speed fields of a training config.

None enters ε, except precision, through η, the float rounding the accountant pays for.
"""

from dpjax.privacy.ghost_clipping import form_timing
from dpjax.trainer.configuration.field_spec import Field

FIELDS: tuple[Field, ...] = (
  Field(
    'num_devices',
    'int',
    0,
    'data-parallel devices: 0 = all; n > 0 = the first n (single '
    'process); P must be a multiple of it',
    0,
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
