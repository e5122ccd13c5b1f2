"""The tanh CNN of Papernot et al. 2021, linen and NNX.

References:
  Papernot et al. 2021, "Tempered Sigmoid Activations for Deep Learning with
    Differential Privacy" (AAAI): the small tanh CNN.
  Tramèr & Boneh 2021, "Differentially Private Learning Needs Better Features
    (or Much More Data)" (ICLR): the same CNN as the end-to-end baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
import math

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from dpjax.models import family
from dpjax.models import layers


class CNN(nn.Module):
  """The tanh CNN of Papernot et al. 2021 (Tramèr & Boneh 2021's baseline).

  conv 16 8x8/2 -> tanh -> maxpool 2/1 -> conv 32 4x4/2 -> tanh -> maxpool 2/1
  -> Dense 32 -> tanh -> Dense classes. 26,010 parameters on 28x28x1.
  """

  num_classes: int
  features: Sequence[int] = (16, 32)
  kernel_sizes: Sequence[int] = (8, 4)
  strides: Sequence[int] = (2, 2)
  paddings: Sequence[str] = ('SAME', 'VALID')
  hidden_size: int = 32
  activation: str = 'tanh'

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    act = layers.ACTIVATIONS[self.activation]
    for f, k, s, p in zip(self.features, self.kernel_sizes, self.strides, self.paddings):
      x = act(nn.Conv(f, (k, k), strides=(s, s), padding=p)(x))
      x = nn.max_pool(x, (2, 2), strides=(1, 1), padding='VALID')
    x = x.reshape((x.shape[0], -1))
    x = act(nn.Dense(self.hidden_size)(x))
    return nn.Dense(self.num_classes)(x)


def _max_pool(x: jax.Array) -> jax.Array:
  """`CNN`'s pooling: max over 2x2 windows, stride 1, 'VALID'."""
  return nnx.max_pool(x, (2, 2), strides=(1, 1), padding='VALID')


class NNXCNN(nnx.Module):
  """`CNN` in Flax NNX, on [H, W, C] images of shape `input_shape`.

  conv 16 8x8/2 -> tanh -> maxpool 2/1 -> conv 32 4x4/2 -> tanh -> maxpool 2/1
  -> Linear 32 -> tanh -> Linear classes (by default); parameters of the same shapes.
  """

  def __init__(
    self,
    input_shape: Sequence[int],
    num_classes: int,
    features: Sequence[int] = (16, 32),
    kernel_sizes: Sequence[int] = (8, 4),
    strides: Sequence[int] = (2, 2),
    paddings: Sequence[str] = ('SAME', 'VALID'),
    hidden_size: int = 32,
    activation: str = 'tanh',
    *,
    rngs: nnx.Rngs,
  ):
    self.activation = layers.ACTIVATIONS[activation]
    channels = [input_shape[-1], *features]
    self.convs = nnx.List(
      [
        nnx.Conv(c_in, c_out, (k, k), strides=(s, s), padding=p, rngs=rngs)
        for c_in, c_out, k, s, p in zip(
          channels[:-1], channels[1:], kernel_sizes, strides, paddings
        )
      ]
    )
    # The flattened size of the conv features, from the shapes alone.
    out = jax.eval_shape(self._features, jax.ShapeDtypeStruct((1, *input_shape), jnp.float32))
    self.hidden = nnx.Linear(math.prod(out.shape[1:]), hidden_size, rngs=rngs)
    self.head = nnx.Linear(hidden_size, num_classes, rngs=rngs)

  def _features(self, x: jax.Array) -> jax.Array:
    for conv in self.convs:
      x = _max_pool(self.activation(conv(x)))
    return x.reshape((x.shape[0], -1))

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.activation(self.hidden(self._features(x)))
    return self.head(x)


def add_fields(c: ml_collections.ConfigDict) -> None:
  """The CNN's `config.model` fields."""
  c.normalization = 'none'  # The paper's CNN has no normalisation layers.
  c.features = (16, 32)  # Output channels of the two conv layers.
  c.kernel_sizes = (8, 4)  # Square kernel size of each conv layer.
  c.strides = (2, 2)  # Stride of each conv layer.
  # Padding of each conv. ('SAME', 'VALID') is the paper's (28x28 -> 4x4x32);
  # inputs smaller than 16x16 (e.g. 8x8 digits) need ('SAME', 'SAME').
  c.paddings = ('SAME', 'VALID')
  c.hidden_size = 32  # Width of the Dense layer before the classifier.
  c.activation = 'tanh'  # Tempered sigmoid (Papernot et al. 2021).


def _output_size(size: int, cfg: ml_collections.ConfigDict) -> int:
  """The spatial size `size` becomes after the convs and pools."""
  for k, s, p in zip(cfg.kernel_sizes, cfg.strides, cfg.paddings):
    size = -(-size // s) if p == 'SAME' else (size - k) // s + 1
    size -= 1  # maxpool 2, stride 1, VALID.
  return size


def build(cfg: ml_collections.ConfigDict, num_classes: int, input_shape: tuple[int, ...]):
  """The CNN (linen, or NNX with `cfg.framework = 'nnx'`) of a checked config."""
  n = len(cfg.features)
  if not (len(cfg.kernel_sizes) == len(cfg.strides) == len(cfg.paddings) == n):
    raise ValueError(
      'config.model.{features, kernel_sizes, strides, paddings} must have the same length.'
    )
  if any(p not in ('SAME', 'VALID') for p in cfg.paddings):
    raise ValueError(f"config.model.paddings={cfg.paddings}; each must be 'SAME' or 'VALID'.")
  if len(input_shape) != 3:
    raise ValueError(f'cnn needs images HxWxC, got input_shape={input_shape}.')
  out = min(_output_size(d, cfg) for d in input_shape[:2])
  if out < 1:
    raise ValueError(
      f'cnn: input_shape={input_shape} is too small for kernel_sizes='
      f'{tuple(cfg.kernel_sizes)}, paddings={tuple(cfg.paddings)} (spatial '
      "size reaches 0); use paddings=('SAME', 'SAME') for small images."
    )
  args = (
    num_classes,
    tuple(cfg.features),
    tuple(cfg.kernel_sizes),
    tuple(cfg.strides),
    tuple(cfg.paddings),
    cfg.hidden_size,
    cfg.activation,
  )
  if cfg.framework == 'nnx':
    return family.as_linen('cnn', lambda rngs: NNXCNN(input_shape, *args, rngs=rngs))
  return CNN(*args)


FAMILY = family.Family(normalizations=('none',), add_fields=add_fields, build=build, nnx=True)
