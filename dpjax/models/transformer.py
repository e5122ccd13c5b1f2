"""A pre-LayerNorm transformer encoder for sequences (tokens or features), linen.

Classifies a sequence (mean over positions) or, with `causal`, is a causal language model
with logits per position. Per-example: LayerNorm normalises within one example and there
is no dropout.

References:
  Vaswani et al. 2017, "Attention Is All You Need" (NeurIPS).
  Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture"
    (ICML): the pre-LayerNorm block.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from dpjax.models import family
from dpjax.models import layers


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
    pos = self.param(
      'pos_embedding', nn.initializers.normal(0.02), (self.max_length, self.model_dim)
    )
    x = x + pos[: x.shape[-2]]
    x = layers.pre_ln_encoder(
      x, self.num_layers, self.num_heads, self.model_dim, self.mlp_dim, self.causal
    )
    return nn.Dense(self.num_classes)(x)


def add_fields(c: ml_collections.ConfigDict) -> None:
  """The transformer's `config.model` fields."""
  c.normalization = 'layernorm'  # Pre-LayerNorm blocks.
  # 0: inputs are float features [L, D_in]; > 0: int tokens [L] < vocab.
  c.vocab_size = 0
  c.num_layers = 2  # Encoder blocks.
  c.num_heads = 4  # Attention heads; must divide model_dim.
  c.model_dim = 64  # Residual stream width.
  c.mlp_dim = 128  # Hidden width of each block's MLP.
  # True: a causal language model, logits per position (loss sequence_cross_entropy).
  c.causal = False


def build(cfg: ml_collections.ConfigDict, num_classes: int, input_shape: tuple[int, ...]):
  """The transformer of a checked config."""
  family.check_positive_fields(
    'transformer', cfg, ('num_layers', 'num_heads', 'model_dim', 'mlp_dim')
  )
  if cfg.model_dim % cfg.num_heads:
    raise ValueError(
      f'config.model.num_heads={cfg.num_heads} must divide model_dim={cfg.model_dim}.'
    )
  if not isinstance(cfg.vocab_size, int) or cfg.vocab_size < 0:
    raise ValueError(
      f'config.model.vocab_size must be an int >= 0 (0 = float features), got {cfg.vocab_size!r}.'
    )
  if (len(input_shape) != 1) if cfg.vocab_size > 0 else (len(input_shape) < 2):
    raise ValueError(
      f'transformer with vocab_size={cfg.vocab_size} needs input_shape '
      f'{"(L,) of tokens" if cfg.vocab_size > 0 else "(L, D_in, ...) of features"}, got '
      f'{input_shape}.'
    )
  return Transformer(
    num_classes,
    input_shape[0],
    cfg.vocab_size,
    cfg.num_layers,
    cfg.num_heads,
    cfg.model_dim,
    cfg.mlp_dim,
    bool(cfg.causal),
  )


FAMILY = family.Family(normalizations=('layernorm',), add_fields=add_fields, build=build)
