"""The MLP: flatten, [Dense -> activation] per hidden width, Dense logits; linen and NNX.

Per-example and deterministic (no normalisation, no dropout). `tanh` is the tempered
sigmoid of Papernot et al. 2021, "Tempered Sigmoid Activations for Deep Learning with
Differential Privacy" (AAAI).
"""

from __future__ import annotations

from collections.abc import Sequence
import math

from flax import nnx
import flax.linen as nn
import jax
import ml_collections

from dpjax.models import family
from dpjax.models import layers


class MLP(nn.Module):
  """Flatten -> [Dense -> activation] * len(hidden_sizes) -> Dense logits."""

  num_classes: int
  hidden_sizes: Sequence[int]
  activation: str = 'tanh'

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.reshape((x.shape[0], -1))
    for width in self.hidden_sizes:
      x = layers.ACTIVATIONS[self.activation](nn.Dense(width)(x))
    return nn.Dense(self.num_classes)(x)


class NNXMLP(nnx.Module):
  """`MLP` in Flax NNX: Flatten -> [Linear -> activation] * len(hidden_sizes) -> Linear.

  Parameters of the same shapes as the linen twin; NNX layers need their input sizes, so
  the constructor takes one example's `input_shape` (no batch axis) first.
  """

  def __init__(
    self,
    input_shape: Sequence[int],
    num_classes: int,
    hidden_sizes: Sequence[int],
    activation: str = 'tanh',
    *,
    rngs: nnx.Rngs,
  ):
    self.activation = layers.ACTIVATIONS[activation]
    sizes = [math.prod(input_shape), *hidden_sizes]
    self.hidden = nnx.List([nnx.Linear(m, c, rngs=rngs) for m, c in zip(sizes[:-1], sizes[1:])])
    self.head = nnx.Linear(sizes[-1], num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.reshape((x.shape[0], -1))
    for layer in self.hidden:
      x = self.activation(layer(x))
    return self.head(x)


def add_fields(c: ml_collections.ConfigDict) -> None:
  """The MLP's `config.model` fields."""
  c.normalization = 'none'  # MLP has no normalisation layers.
  c.hidden_sizes = (256, 128)  # Widths of the hidden Dense layers.
  # relu | tanh | gelu | elu | silu (tanh: Papernot et al. 2021).
  c.activation = 'tanh'


def build(cfg: ml_collections.ConfigDict, num_classes: int, input_shape: tuple[int, ...]):
  """The MLP (linen, or NNX with `cfg.framework = 'nnx'`) of a checked config."""
  for h in cfg.hidden_sizes:
    family.check_positive('mlp', h, 'hidden_sizes[i]')
  if cfg.framework == 'nnx':
    return family.as_linen(
      'mlp',
      lambda rngs: NNXMLP(
        input_shape, num_classes, tuple(cfg.hidden_sizes), cfg.activation, rngs=rngs
      ),
    )
  return MLP(num_classes, tuple(cfg.hidden_sizes), cfg.activation)


FAMILY = family.Family(normalizations=('none',), add_fields=add_fields, build=build, nnx=True)
