"""The length and periodic-action fields of a training config: steps or epochs, and how often
to log, evaluate and checkpoint.
"""

from dpjax.trainer.configuration.field_spec import Field

FIELDS: tuple[Field, ...] = (
  Field(
    'num_epochs',
    'int',
    20,
    'exactly one of num_epochs, num_steps is > 0; an epoch is ceil(N/b) steps',
    0,
    accounting=True,
  ),
  Field('num_steps', 'int', 0, 'exactly one of num_epochs, num_steps is > 0', 0, accounting=True),
  Field('log_every_steps', 'int', 20, 'steps between log rows (and the last step)', 1),
  Field('eval_every_steps', 'int', 100, 'steps between evaluations (and the first and last)', 1),
  Field('checkpoint_every_steps', 'int', 100, 'steps between checkpoints (and the last)', 1),
  Field('keep_checkpoints', 'int', 3, 'checkpoints kept (the last step always)', 1),
)
