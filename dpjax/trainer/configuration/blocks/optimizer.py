"""The optimizer block of a training config: the update rule and its learning-rate schedule."""

from dpjax.trainer.configuration.field_spec import Field

FIELDS: tuple[Field, ...] = (
  Field('optimizer.name', 'str', 'sgd', 'sgd | adam', choices=('sgd', 'adam')),
  Field('optimizer.learning_rate', 'float', 1.0, 'the learning rate', 0, low_open=True),
  Field('optimizer.momentum', 'float', 0.0, 'sgd only; 0 disables', 0, 1, high_open=True),
  Field(
    'optimizer.schedule',
    'str',
    'constant',
    'constant | cosine (linear warm-up, then '
    'cosine decay to 0 at the last step) | step (piecewise constant)',
    choices=('constant', 'cosine', 'step'),
  ),
  Field('optimizer.warmup_steps', 'int', 0, 'cosine: steps of linear warm-up from 0', 0),
  Field(
    'optimizer.decay_steps',
    'ints',
    (),
    'step: the steps at which the rate is multiplied by decay_factor',
    1,
    when=lambda c: c.optimizer.schedule == 'step',
  ),
  Field(
    'optimizer.decay_factor', 'float', 0.1, 'step: the factor of each decay', 0, 1, low_open=True
  ),
)
