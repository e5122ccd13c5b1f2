"""DP-SGD MLP on the embedded 8x8 digits (1797 images, scikit-learn's; offline): the default run.

It needs no download and trains in seconds on two CPU cores: Poisson sampling
(b = 256) with PLD accounting, σ calibrated to ε = 3 at δ = 1e-5 after 20
epochs, pixels mapped to [-1, 1] by the data-independent constants mean = std =
0.5. Every field is `dpjax.trainer.configuration.config_fields.default_config()`'s (docs/config.md).

Run:
  python -m dpjax.train --config configs/digits_mlp.py --workdir workdirs/digits_mlp
Smoke run (a few steps):
  python -m dpjax.train --config configs/digits_mlp.py:runlocal --workdir /tmp/smoke
  python -m dpjax.train --config digits_mlp --workdir w   # the packaged copy, from any directory
"""

import ml_collections

from dpjax.trainer.configuration import config_fields
from dpjax import configs


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = config_fields.default_config()  # The digits MLP: every field at its declared default.
  if configs.runlocal(arg):
    c.num_epochs = 0
    c.num_steps = 5
    c.eval_every_steps = 5
    c.checkpoint_every_steps = 2
  return c
