"""Layers the model families share: activations, weight-standardised conv, pre-LN encoder.

Per-example by construction: no layer mixes the examples of a batch (no
BatchNorm; GroupNorm / LayerNorm only) and none is random (no dropout), so row
i of a model's output depends on row i of its input only and an example's
gradient is a function of (params, example).
"""

import math

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp

from dpjax.privacy import ghost_clipping

ACTIVATIONS = {
  'relu': nn.relu,
  'tanh': nn.tanh,
  'gelu': nn.gelu,
  'elu': nn.elu,
  'silu': nn.silu,
}


class WSConv(nn.Module):
  """Conv with scaled weight standardisation and a learnable gain.

  W' = gain · (W − mean(W)) / sqrt(fan_in · var(W)), statistics per output
  channel (Qiao et al. 2019, "Micro-Batch Training with Batch-Channel
  Normalization and Weight Standardization"; Brock et al. 2021, "Characterizing
  signal propagation to close the performance gap in unnormalized ResNets"; used
  by De et al. 2022). It normalises weights, not activations, so examples stay
  independent.
  """

  features: int
  kernel_size: tuple[int, int] = (3, 3)
  strides: tuple[int, int] = (1, 1)
  eps: float = 1e-4

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    shape = (*self.kernel_size, x.shape[-1], self.features)
    w = self.param('kernel', nn.initializers.variance_scaling(1.0, 'fan_in', 'normal'), shape)
    gain = self.param('gain', nn.initializers.ones, (self.features,))
    bias = self.param('bias', nn.initializers.zeros, (self.features,))
    mean = jnp.mean(w, axis=(0, 1, 2), keepdims=True)
    var = jnp.var(w, axis=(0, 1, 2), keepdims=True)
    fan_in = math.prod(shape[:-1])
    w = (w - mean) * jax.lax.rsqrt(jnp.maximum(var * fan_in, self.eps)) * gain
    y = jax.lax.conv_general_dilated(
      x, w, window_strides=self.strides, padding='SAME', dimension_numbers=('NHWC', 'HWIO', 'NHWC')
    )
    return y + bias


# Ghost clipping's closed-form rule for this layer (dpjax.privacy.ghost_clipping.conv restates
# the standardisation above); the clipping code imports no model.
ghost_clipping.register_norm_rule(
  WSConv,
  name='wsconv',
  params=ghost_clipping.conv.WS_CONV_PARAMS,
  form=ghost_clipping.conv.ws_conv_form,
)(ghost_clipping.conv.ws_conv_sq_norms)


def pre_ln_encoder(
  x: jax.Array, num_layers: int, num_heads: int, width: int, mlp_dim: int, causal: bool = False
) -> jax.Array:
  """num_layers x (x += MHA(LN(x)); x += MLP(LN(x))), final LN, mean over tokens (linen).

  causal: each position attends to itself and earlier ones, and the final LN's output is
  returned per position (no mean). Called inside a compact `__call__`: the layers are the
  caller's submodules (LayerNorm_i, MultiHeadDotProductAttention_i, Dense_i, in order).
  """
  mask = nn.make_causal_mask(jnp.ones(x.shape[:-1])) if causal else None
  for _ in range(num_layers):
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(
      num_heads=num_heads, qkv_features=width, deterministic=True
    )(y, y, mask=mask)
    y = nn.LayerNorm()(x)
    x = x + nn.Dense(width)(nn.gelu(nn.Dense(mlp_dim)(y)))
  x = nn.LayerNorm()(x)
  return x if causal else jnp.mean(x, axis=-2)


class EncoderBlock(nnx.Module):
  """One block of `pre_ln_encoder` in NNX: x += attention(LN(x)); x += MLP(LN(x)), GELU MLP."""

  def __init__(self, width: int, num_heads: int, mlp_dim: int, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(width, rngs=rngs)
    # linen's MultiHeadDotProductAttention(num_heads, qkv_features=width), self-attention.
    self.attention = nnx.MultiHeadAttention(
      num_heads=num_heads,
      in_features=width,
      qkv_features=width,
      out_features=width,
      decode=False,
      deterministic=True,
      rngs=rngs,
    )
    self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
    self.mlp_in = nnx.Linear(width, mlp_dim, rngs=rngs)
    self.mlp_out = nnx.Linear(mlp_dim, width, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attention(self.attention_norm(x))
    gelu = ACTIVATIONS['gelu']
    return x + self.mlp_out(gelu(self.mlp_in(self.mlp_norm(x))))
