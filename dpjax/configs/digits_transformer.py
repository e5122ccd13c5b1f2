"""DP-SGD transformer encoder on digits read as sequences (offline).

Each 8x8 digit is a sequence of its 8 rows (8 features per token): a small
sequence task that needs no download. For token inputs set
`model.vocab_size` > 0 and feed int tokens.

Run:
  python -m dpjax.train --config configs/digits_transformer.py --workdir workdirs/digits_transformer
"""

from dpjax.trainer.configuration import config_fields
from dpjax import configs
from dpjax.models import factory as models


def get_config(arg: str | None = None):
  c = config_fields.default_config()
  c.data.input_shape = (8, 8)  # Only read by the synthetic source; digits rows are tokens.
  c.model = models.default_model_config('transformer')
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.model_dim = 32
  c.model.mlp_dim = 64
  c.optimizer.name = 'adam'
  c.optimizer.learning_rate = 3e-3
  c.optimizer.momentum = 0.0
  c.num_epochs = 40
  if configs.runlocal(arg):
    c.num_epochs = 0
    c.num_steps = 3
  return c
