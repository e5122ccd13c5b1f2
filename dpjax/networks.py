"""The Flax (linen) networks of dpjax: MLP, tanh CNN, WideResNet, Transformer, ViT.

Per-example by construction: no layer mixes the examples of a batch (no
BatchNorm; GroupNorm / LayerNorm only) and none is random (no dropout), so row
i of the logits depends on row i of the input only and an example's gradient
is a function of (params, example). Built from a config by `dpjax.models`,
which cites the papers.
"""

from collections.abc import Sequence
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from dpjax import ghost_clipping

ACTIVATIONS = {
    'relu': nn.relu,
    'tanh': nn.tanh,
    'gelu': nn.gelu,
    'elu': nn.elu,
    'silu': nn.silu,
}


class MLP(nn.Module):
  """Flatten -> [Dense -> activation] * len(hidden_sizes) -> Dense logits."""
  num_classes: int
  hidden_sizes: Sequence[int]
  activation: str = 'tanh'

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.reshape((x.shape[0], -1))
    for width in self.hidden_sizes:
      x = ACTIVATIONS[self.activation](nn.Dense(width)(x))
    return nn.Dense(self.num_classes)(x)


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
    act = ACTIVATIONS[self.activation]
    for f, k, s, p in zip(self.features, self.kernel_sizes, self.strides,
                          self.paddings):
      x = act(nn.Conv(f, (k, k), strides=(s, s), padding=p)(x))
      x = nn.max_pool(x, (2, 2), strides=(1, 1), padding='VALID')
    x = x.reshape((x.shape[0], -1))
    x = act(nn.Dense(self.hidden_size)(x))
    return nn.Dense(self.num_classes)(x)


class WSConv(nn.Module):
  """Conv with scaled weight standardisation and a learnable gain.

  W' = gain · (W − mean(W)) / sqrt(fan_in · var(W)), statistics per output
  channel (Qiao et al. 2019; Brock et al. 2021; used by De et al. 2022). It
  normalises weights, not activations, so examples stay independent.
  """
  features: int
  kernel_size: tuple[int, int] = (3, 3)
  strides: tuple[int, int] = (1, 1)
  eps: float = 1e-4

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    shape = (*self.kernel_size, x.shape[-1], self.features)
    w = self.param('kernel', nn.initializers.variance_scaling(
        1.0, 'fan_in', 'normal'), shape)
    gain = self.param('gain', nn.initializers.ones, (self.features,))
    bias = self.param('bias', nn.initializers.zeros, (self.features,))
    mean = jnp.mean(w, axis=(0, 1, 2), keepdims=True)
    var = jnp.var(w, axis=(0, 1, 2), keepdims=True)
    fan_in = math.prod(shape[:-1])
    w = (w - mean) * jax.lax.rsqrt(jnp.maximum(var * fan_in, self.eps)) * gain
    y = jax.lax.conv_general_dilated(
        x, w, window_strides=self.strides, padding='SAME',
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    return y + bias


# Ghost clipping's closed-form rule for this layer (dpjax.ghost_clipping.conv._ws_sq_norms
# restates the standardisation above); the clipping code imports no model.
ghost_clipping.register_norm_rule(WSConv, name='wsconv', params=ghost_clipping.conv.WS_CONV_PARAMS,
                                  form=ghost_clipping.conv.ws_conv_form)(
    ghost_clipping.conv.ws_conv_sq_norms)


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
      return WSConv(features, (kernel, kernel), (strides, strides))
    return nn.Conv(features, (kernel, kernel), strides=(strides, strides),
                   padding='SAME')

  def _norm(self):
    if self.normalization == 'groupnorm':
      return nn.GroupNorm(num_groups=self.groups)
    return lambda x: x

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    act = ACTIVATIONS[self.activation]
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


def _pre_ln_encoder(x: jax.Array, num_layers: int, num_heads: int, width: int,
                    mlp_dim: int, causal: bool = False) -> jax.Array:
  """num_layers x (x += MHA(LN(x)); x += MLP(LN(x))), final LN, mean over tokens.

  causal: each position attends to itself and earlier ones, and the final LN's output is
  returned per position (no mean). Called inside a compact `__call__`: the layers are the
  caller's submodules (LayerNorm_i, MultiHeadDotProductAttention_i, Dense_i, in order).
  """
  mask = nn.make_causal_mask(jnp.ones(x.shape[:-1])) if causal else None
  for _ in range(num_layers):
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=num_heads, qkv_features=width, deterministic=True)(y, y, mask=mask)
    y = nn.LayerNorm()(x)
    x = x + nn.Dense(width)(nn.gelu(nn.Dense(mlp_dim)(y)))
  x = nn.LayerNorm()(x)
  return x if causal else jnp.mean(x, axis=-2)


class Transformer(nn.Module):
  """Pre-LayerNorm transformer encoder classifier for sequences.

  Inputs are int tokens [n, L] (vocab_size > 0, nn.Embed) or float features
  [n, L, D_in] (vocab_size = 0, Dense projection; trailing axes beyond L are
  flattened into D_in); plus a learned positional
  embedding; num_layers x (x += MHA(LN(x)); x += MLP(LN(x))); final LN; mean
  over positions; Dense classifier. No attention masks: every position counts.
  causal=True makes it a causal language model: a causal attention mask and logits
  [n, L, num_classes] per position (loss sequence_cross_entropy).
  """
  num_classes: int
  max_length: int
  vocab_size: int = 0
  num_layers: int = 2
  num_heads: int = 4
  model_dim: int = 64
  mlp_dim: int = 128
  causal: bool = False

  @property
  def input_dtype(self):
    """int32 tokens (vocab_size > 0) or float32 features."""
    return jnp.int32 if self.vocab_size > 0 else jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if self.vocab_size > 0:
      x = nn.Embed(self.vocab_size, self.model_dim)(x)
    else:
      # Float features [n, L, ...]: trailing axes are one token's features
      # (e.g. an 8x8x1 image as 8 tokens of 8 pixels).
      x = nn.Dense(self.model_dim)(x.reshape(*x.shape[:2], -1))
    pos = self.param('pos_embedding', nn.initializers.normal(0.02),
                     (self.max_length, self.model_dim))
    x = x + pos[:x.shape[-2]]
    x = _pre_ln_encoder(x, self.num_layers, self.num_heads, self.model_dim,
                        self.mlp_dim, self.causal)
    return nn.Dense(self.num_classes)(x)


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
    pos = self.param('pos_embedding', nn.initializers.normal(0.02),
                     (x.shape[1], self.width))
    x = _pre_ln_encoder(x + pos, self.num_layers, self.num_heads, self.width,
                        self.mlp_dim)
    return nn.Dense(self.num_classes)(x)
