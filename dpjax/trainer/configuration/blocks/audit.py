"""The audit block of a training config: the empirical privacy audit with gradient canaries."""

from dpjax.trainer.configuration.field_spec import Field

FIELDS: tuple[Field, ...] = (
  Field(
    'audit.num_canaries',
    'int',
    0,
    'm gradient canaries, each in the data by a fair coin '
    '(N + m examples for sampler and accountant); 0 = off',
    0,
  ),
  Field(
    'audit.kind',
    'str',
    'gradient',
    "gradient: a canary's gradient is a fixed direction of norm > C",
    choices=('gradient',),
  ),
  Field(
    'audit.confidence',
    'float',
    0.95,
    '1 - β: the audit ε lower bound holds with at least this probability',
    0,
    1,
    low_open=True,
    high_open=True,
  ),
  Field(
    'audit.every_checkpoint',
    'bool',
    False,
    'also audit at every checkpoint (else the last step only)',
  ),
)
