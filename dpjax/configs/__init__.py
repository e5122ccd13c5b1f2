"""The configs that ship with dpjax; each is `get_config(arg)` over `config_fields.default_config()`.

  python -m dpjax.train --config digits_mlp --workdir w        # a packaged config, by name
  python -m dpjax.train --config configs/digits_mlp.py --workdir w   # the repository's copy

| name | what |
|---|---|
| `digits_mlp` | MLP on scikit-learn's digits (the default run; embedded data) |
| `digits_transformer` | transformer encoder, each digit a sequence of 8 rows |
| `mnist_cnn` | tanh CNN of Papernot et al. 2021 on MNIST (TFDS, prepared) |
| `cifar10_wrn` | WRN-16-4 with GroupNorm (De et al. 2022) on CIFAR-10 (TFDS, prepared) |
| `cifar10_vit` | ViT-S/4 on CIFAR-10 (TFDS, prepared) |

Each accepts the argument `runlocal` (`--config digits_mlp:runlocal`): a few steps for a smoke
run; any other argument is refused.
"""

import os

NAMES = ('digits_mlp', 'digits_transformer', 'mnist_cnn', 'cifar10_wrn', 'cifar10_vit')
ARGS = ('runlocal',)


FROM_WORKDIR = os.path.join(os.path.dirname(__file__), 'from_workdir.py')  # --workdir alone.


def path_of(name: str) -> str | None:
  """The file of the packaged config `name`, or None."""
  return os.path.join(os.path.dirname(__file__), f'{name}.py') if name in NAMES else None


def runlocal(arg: str | None) -> bool:
  """Whether `arg` asks for the smoke run; ValueError for an argument the configs do not take."""
  if arg not in (None, '', *ARGS):
    raise ValueError(f'config argument {arg!r} is unknown; valid: {", ".join(ARGS)} (or none).')
  return arg == 'runlocal'
