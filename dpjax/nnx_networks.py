"""Flax NNX versions of the MLP, tanh CNN and ViT of `dpjax.networks`.

Each mirrors its linen twin in `dpjax.networks`: the same layers in the same
order, the same activations (`networks.ACTIVATIONS`), parameters of the same
shapes (so the same count for the same hyper-parameters) and the same function
of them. NNX layers are built eagerly and need their input sizes, so each
constructor takes the shape of one example (`input_shape`, without the batch
axis) before the linen hyper-parameters, and a keyword `rngs: nnx.Rngs`;
`model(x)` maps [n, *input_shape] to logits [n, num_classes].

Per-example and deterministic, as the linen networks: no BatchNorm, no
dropout, so an example's gradient is a function of (parameters, example) and
`dpjax.nnx_model.Functional` can differentiate them per example. Every
parameter is read by one call of a layer ghost clipping covers
(`dpjax.ghost_clipping.nnx_layers`), except the ViT's positional embedding,
declared in the model body, which gets per-example copies.
"""

from __future__ import annotations

from collections.abc import Sequence
import math

from flax import nnx
import jax
import jax.numpy as jnp

from dpjax import networks


class MLP(nnx.Module):
  """Flatten -> [Linear -> activation] * len(hidden_sizes) -> Linear logits."""

  def __init__(self, input_shape: Sequence[int], num_classes: int,
               hidden_sizes: Sequence[int], activation: str = 'tanh', *, rngs: nnx.Rngs):
    self.activation = networks.ACTIVATIONS[activation]
    sizes = [math.prod(input_shape), *hidden_sizes]
    self.hidden = nnx.List([nnx.Linear(m, c, rngs=rngs)
                            for m, c in zip(sizes[:-1], sizes[1:])])
    self.head = nnx.Linear(sizes[-1], num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.reshape((x.shape[0], -1))
    for layer in self.hidden:
      x = self.activation(layer(x))
    return self.head(x)


def _max_pool(x: jax.Array) -> jax.Array:
  """networks.CNN's pooling: max over 2x2 windows, stride 1, 'VALID'."""
  return nnx.max_pool(x, (2, 2), strides=(1, 1), padding='VALID')


class CNN(nnx.Module):
  """The tanh CNN of Papernot et al. 2021, as `networks.CNN`.

  conv 16 8x8/2 -> tanh -> maxpool 2/1 -> conv 32 4x4/2 -> tanh -> maxpool 2/1
  -> Linear 32 -> tanh -> Linear classes (by default, on [H, W, C] images).
  """

  def __init__(self, input_shape: Sequence[int], num_classes: int,
               features: Sequence[int] = (16, 32), kernel_sizes: Sequence[int] = (8, 4),
               strides: Sequence[int] = (2, 2), paddings: Sequence[str] = ('SAME', 'VALID'),
               hidden_size: int = 32, activation: str = 'tanh', *, rngs: nnx.Rngs):
    self.activation = networks.ACTIVATIONS[activation]
    channels = [input_shape[-1], *features]
    self.convs = nnx.List([
        nnx.Conv(c_in, c_out, (k, k), strides=(s, s), padding=p, rngs=rngs)
        for c_in, c_out, k, s, p in zip(channels[:-1], channels[1:], kernel_sizes,
                                        strides, paddings)])
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


class EncoderBlock(nnx.Module):
  """Pre-LN transformer block: x += attention(LN(x)); x += MLP(LN(x)), GELU MLP."""

  def __init__(self, width: int, num_heads: int, mlp_dim: int, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(width, rngs=rngs)
    # linen's MultiHeadDotProductAttention(num_heads, qkv_features=width), self-attention.
    self.attention = nnx.MultiHeadAttention(
        num_heads=num_heads, in_features=width, qkv_features=width, out_features=width,
        decode=False, deterministic=True, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
    self.mlp_in = nnx.Linear(width, mlp_dim, rngs=rngs)
    self.mlp_out = nnx.Linear(mlp_dim, width, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attention(self.attention_norm(x))
    gelu = networks.ACTIVATIONS['gelu']
    return x + self.mlp_out(gelu(self.mlp_in(self.mlp_norm(x))))


class ViT(nnx.Module):
  """Vision transformer, as `networks.ViT`: patch embedding, pre-LN blocks, GAP, head.

  A stride-`patch_size` conv cuts the [H, W, C] image into (H/p)·(W/p) tokens of
  width `width`; a learned positional embedding (an `nnx.Param` of the model
  itself) is added; num_layers x `EncoderBlock`; final LayerNorm; mean over
  tokens; Linear classifier. No dropout, no class token.
  """

  def __init__(self, input_shape: Sequence[int], num_classes: int, patch_size: int = 4,
               num_layers: int = 12, num_heads: int = 6, width: int = 384,
               mlp_dim: int = 1536, *, rngs: nnx.Rngs):
    height, width_px, channels = input_shape
    p = patch_size
    self.width = width
    self.patch_embedding = nnx.Conv(channels, width, (p, p), strides=(p, p),
                                    padding='VALID', rngs=rngs)
    tokens = ((height - p) // p + 1) * ((width_px - p) // p + 1)
    self.pos_embedding = nnx.Param(
        nnx.initializers.normal(0.02)(rngs.params(), (tokens, width)))
    self.blocks = nnx.List([EncoderBlock(width, num_heads, mlp_dim, rngs=rngs)
                            for _ in range(num_layers)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.patch_embedding(x)
    x = x.reshape(x.shape[0], -1, self.width) + self.pos_embedding[...]  # [n, tokens, width].
    for block in self.blocks:
      x = block(x)
    return self.head(jnp.mean(self.norm(x), axis=-2))
