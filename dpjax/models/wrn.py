"""WideResNet with GroupNorm and weight standardisation, the DP network of De et al. 2022.

References:
  Zagoruyko & Komodakis 2016, "Wide Residual Networks" (BMVC).
  De et al. 2022, "Unlocking High-Accuracy Differentially Private Image
    Classification through Scale" (arXiv 2204.13650): WRN-16-4 with GroupNorm
    and weight standardisation.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from dpjax.models import family
from dpjax.models import layers


class WideResNet(nn.Module):
  """WRN-depth-width with GroupNorm, as used for DP by De et al. 2022.

  Stem conv 16 -> three groups of (depth-4)/6 pre-activation blocks of width
  16k, 32k, 64k (stride 1, 2, 2) -> activation -> norm -> global mean pool ->
  Dense. Each block is 2 x (activation -> norm -> conv 3x3); the first block
  of a group has a 1x1 projection shortcut (same ordering as De et al.'s
  reference implementation).
  """

  num_classes: int
  depth: int = 16
  width: int = 4
  groups: int = 16
  normalization: str = 'groupnorm'
  weight_standardization: bool = True
  activation: str = 'relu'

  def _conv(self, features, kernel, strides=1):
    if self.weight_standardization:
      return layers.WSConv(features, (kernel, kernel), (strides, strides))
    return nn.Conv(features, (kernel, kernel), strides=(strides, strides), padding='SAME')

  def _norm(self):
    if self.normalization == 'groupnorm':
      return nn.GroupNorm(num_groups=self.groups)
    return lambda x: x

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    act = layers.ACTIVATIONS[self.activation]
    blocks_per_group = (self.depth - 4) // 6
    x = self._conv(16, 3)(x)
    for mult, stride in ((1, 1), (2, 2), (4, 2)):
      features = 16 * mult * self.width
      for i in range(blocks_per_group):
        s = stride if i == 0 else 1
        shortcut = x
        if i == 0:
          shortcut = self._conv(features, 1, s)(self._norm()(act(x)))
        y = self._conv(features, 3, s)(self._norm()(act(x)))
        y = self._conv(features, 3)(self._norm()(act(y)))
        x = shortcut + y
    x = self._norm()(act(x))
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


def add_fields(c: ml_collections.ConfigDict) -> None:
  """The WideResNet's `config.model` fields."""
  c.normalization = 'groupnorm'  # groupnorm | none (never batchnorm).
  c.depth = 16  # Total depth; (depth - 4) must be divisible by 6.
  c.width = 4  # Widening factor k: group widths are 16k, 32k, 64k.
  c.groups = 16  # GroupNorm groups (De et al. 2022 use 16).
  c.weight_standardization = True  # Scaled WS on every conv (De et al. 2022).
  c.activation = 'relu'


def build(cfg: ml_collections.ConfigDict, num_classes: int, input_shape: tuple[int, ...]):
  """The WideResNet of a checked config."""
  family.check_positive_fields('wrn', cfg, ('depth', 'width', 'groups'))
  if cfg.depth < 10 or (cfg.depth - 4) % 6:
    raise ValueError(
      f'config.model.depth={cfg.depth}: need depth = 6n + 4 with n >= 1 (10, 16, 22, 28, ...).'
    )
  if cfg.normalization == 'groupnorm' and 16 % cfg.groups:
    raise ValueError(
      f'config.model.groups={cfg.groups} must divide 16 (the '
      'stem width; all widths are multiples of 16).'
    )
  if len(input_shape) != 3:
    raise ValueError(f'wrn needs images HxWxC, got input_shape={input_shape}.')
  return WideResNet(
    num_classes,
    cfg.depth,
    cfg.width,
    cfg.groups,
    cfg.normalization,
    bool(cfg.weight_standardization),
    cfg.activation,
  )


FAMILY = family.Family(normalizations=('groupnorm', 'none'), add_fields=add_fields, build=build)
