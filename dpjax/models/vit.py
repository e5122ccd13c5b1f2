"""The vision transformer (global average pooling, no class token), linen and NNX.

References:
  Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words: Transformers for
    Image Recognition at Scale" (ICLR): the ViT, here with global average
    pooling instead of a class token (Beyer et al. 2022, "Better plain ViT
    baselines for ImageNet-1k").
"""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from dpjax.models import family
from dpjax.models import layers


class ViT(nn.Module):
  """Vision transformer: patch embedding, pre-LN blocks, GAP, linear head.

  A stride-`patch_size` conv cuts the image into (H/p)·(W/p) tokens of width
  `width`; a learned positional embedding is added; num_layers x (x +=
  MHA(LN(x)); x += MLP(LN(x))) with a GELU MLP; final LN; mean over tokens;
  Dense classifier. No dropout, no class token. Every layer is covered by
  ghost clipping (Conv, DenseGeneral, Dense, LayerNorm; the positional
  embedding gets per-example copies).
  """

  num_classes: int
  patch_size: int = 4
  num_layers: int = 12
  num_heads: int = 6
  width: int = 384
  mlp_dim: int = 1536

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    p = self.patch_size
    x = nn.Conv(self.width, (p, p), strides=(p, p), padding='VALID')(x)
    x = x.reshape(x.shape[0], -1, self.width)  # [n, tokens, width].
    pos = self.param('pos_embedding', nn.initializers.normal(0.02), (x.shape[1], self.width))
    x = layers.pre_ln_encoder(x + pos, self.num_layers, self.num_heads, self.width, self.mlp_dim)
    return nn.Dense(self.num_classes)(x)


class NNXViT(nnx.Module):
  """`ViT` in Flax NNX: patch embedding, pre-LN blocks, GAP, head.

  A stride-`patch_size` conv cuts the [H, W, C] image into (H/p)·(W/p) tokens of
  width `width`; a learned positional embedding (an `nnx.Param` of the model
  itself, which ghost clipping gives per-example copies) is added; num_layers x
  `layers.EncoderBlock`; final LayerNorm; mean over tokens; Linear classifier. No
  dropout, no class token.
  """

  def __init__(
    self,
    input_shape: Sequence[int],
    num_classes: int,
    patch_size: int = 4,
    num_layers: int = 12,
    num_heads: int = 6,
    width: int = 384,
    mlp_dim: int = 1536,
    *,
    rngs: nnx.Rngs,
  ):
    height, width_px, channels = input_shape
    p = patch_size
    self.width = width
    self.patch_embedding = nnx.Conv(
      channels, width, (p, p), strides=(p, p), padding='VALID', rngs=rngs
    )
    tokens = ((height - p) // p + 1) * ((width_px - p) // p + 1)
    self.pos_embedding = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (tokens, width)))
    self.blocks = nnx.List(
      [layers.EncoderBlock(width, num_heads, mlp_dim, rngs=rngs) for _ in range(num_layers)]
    )
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.patch_embedding(x)
    x = x.reshape(x.shape[0], -1, self.width) + self.pos_embedding[...]  # [n, tokens, width].
    for block in self.blocks:
      x = block(x)
    return self.head(jnp.mean(self.norm(x), axis=-2))


def add_fields(c: ml_collections.ConfigDict) -> None:
  """The ViT's `config.model` fields."""
  c.normalization = 'layernorm'  # Pre-LayerNorm blocks (LN is per example).
  c.patch_size = 4  # Square patches; must divide the image height and width.
  c.num_layers = 12  # Encoder blocks (ViT-S: 12).
  c.num_heads = 6  # Attention heads; must divide width (ViT-S: 6).
  c.width = 384  # Token width (ViT-S: 384).
  c.mlp_dim = 1536  # Hidden width of each block's MLP (4 x width).


def build(cfg: ml_collections.ConfigDict, num_classes: int, input_shape: tuple[int, ...]):
  """The ViT (linen, or NNX with `cfg.framework = 'nnx'`) of a checked config."""
  family.check_positive_fields(
    'vit', cfg, ('patch_size', 'num_layers', 'num_heads', 'width', 'mlp_dim')
  )
  if cfg.width % cfg.num_heads:
    raise ValueError(f'config.model.num_heads={cfg.num_heads} must divide width={cfg.width}.')
  if len(input_shape) != 3 or any(d % cfg.patch_size for d in input_shape[:2]):
    raise ValueError(
      f'vit needs images HxWxC with H and W multiples of '
      f'config.model.patch_size={cfg.patch_size}, got '
      f'input_shape={input_shape}.'
    )
  args = (num_classes, cfg.patch_size, cfg.num_layers, cfg.num_heads, cfg.width, cfg.mlp_dim)
  if cfg.framework == 'nnx':
    return family.as_linen('vit', lambda rngs: NNXViT(input_shape, *args, rngs=rngs))
  return ViT(*args)


FAMILY = family.Family(normalizations=('layernorm',), add_fields=add_fields, build=build, nnx=True)
