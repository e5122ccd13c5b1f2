"""Flax (linen) models for DP-SGD: MLP, tanh CNN, WideResNet, Transformer, ViT.

Per-example privacy needs per-example gradients, so no layer may mix examples
of a batch: there is no BatchNorm (its batch statistics make one example's
gradient depend on the others, and its running averages leak them), only
GroupNorm / LayerNorm, which normalise within one example. All models are
deterministic (no dropout), so the gradient of an example is a well-defined
function of (params, example). Every model maps a batch `x: [n, *input_shape]`
to logits `[n, num_classes]`, and row i of the output depends on row i only.

`make_model(config.model, num_classes, input_shape)` is the one entry point;
`default_model_config(name)` declares, with a comment, every field a model
reads, so configs can start from it and override a few fields.

References:
  Papernot et al. 2021, "Tempered Sigmoid Activations for Deep Learning with
    Differential Privacy" (AAAI): the small tanh CNN.
  Tramèr & Boneh 2021, "Differentially Private Learning Needs Better Features
    (or Much More Data)" (ICLR): the same CNN as the end-to-end baseline.
  De et al. 2022, "Unlocking High-Accuracy Differentially Private Image
    Classification through Scale" (arXiv 2204.13650): WRN-16-4 with GroupNorm
    and weight standardisation.
  Zagoruyko & Komodakis 2016, "Wide Residual Networks".
  Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words: Transformers for
    Image Recognition at Scale" (ICLR): the ViT, here with global average
    pooling instead of a class token (Beyer et al. 2022, "Better plain ViT
    baselines for ImageNet-1k").
"""

from collections.abc import Sequence
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from dpjax import ghost_clipping

ACTIVATIONS = {
    'relu': nn.relu,
    'tanh': nn.tanh,
    'gelu': nn.gelu,
    'elu': nn.elu,
    'silu': nn.silu,
}

# Normalisations each model supports. BatchNorm is deliberately absent.
_NORMALIZATIONS = {
    'mlp': ('none',),
    'cnn': ('none',),
    'wrn': ('groupnorm', 'none'),
    'transformer': ('layernorm',),
    'vit': ('layernorm',),
}
MODEL_NAMES = tuple(_NORMALIZATIONS)


def default_model_config(name: str) -> ml_collections.ConfigDict:
  """Every field model `name` reads, with its default and meaning."""
  if name not in MODEL_NAMES:
    raise ValueError(
        f'config.model.name={name!r} is not a model; valid: {MODEL_NAMES}.')
  c = ml_collections.ConfigDict()
  c.name = name  # mlp | cnn | wrn | transformer | vit
  if name == 'mlp':
    c.normalization = 'none'  # MLP has no normalisation layers.
    c.hidden_sizes = (256, 128)  # Widths of the hidden Dense layers.
    # relu | tanh | gelu | elu | silu (tanh: Papernot et al. 2021).
    c.activation = 'tanh'
  elif name == 'cnn':
    c.normalization = 'none'  # The paper's CNN has no normalisation layers.
    c.features = (16, 32)  # Output channels of the two conv layers.
    c.kernel_sizes = (8, 4)  # Square kernel size of each conv layer.
    c.strides = (2, 2)  # Stride of each conv layer.
    # Padding of each conv. ('SAME', 'VALID') is the paper's (28x28 -> 4x4x32);
    # inputs smaller than 16x16 (e.g. 8x8 digits) need ('SAME', 'SAME').
    c.paddings = ('SAME', 'VALID')
    c.hidden_size = 32  # Width of the Dense layer before the classifier.
    c.activation = 'tanh'  # Tempered sigmoid (Papernot et al. 2021).
  elif name == 'wrn':
    c.normalization = 'groupnorm'  # groupnorm | none (never batchnorm).
    c.depth = 16  # Total depth; (depth - 4) must be divisible by 6.
    c.width = 4  # Widening factor k: group widths are 16k, 32k, 64k.
    c.groups = 16  # GroupNorm groups (De et al. 2022 use 16).
    c.weight_standardization = True  # Scaled WS on every conv (De et al. 2022).
    c.activation = 'relu'
  elif name == 'transformer':
    c.normalization = 'layernorm'  # Pre-LayerNorm blocks.
    # 0: inputs are float features [L, D_in]; > 0: int tokens [L] < vocab.
    c.vocab_size = 0
    c.num_layers = 2  # Encoder blocks.
    c.num_heads = 4  # Attention heads; must divide model_dim.
    c.model_dim = 64  # Residual stream width.
    c.mlp_dim = 128  # Hidden width of each block's MLP.
  elif name == 'vit':
    c.normalization = 'layernorm'  # Pre-LayerNorm blocks (LN is per example).
    c.patch_size = 4  # Square patches; must divide the image height and width.
    c.num_layers = 12  # Encoder blocks (ViT-S: 12).
    c.num_heads = 6  # Attention heads; must divide width (ViT-S: 6).
    c.width = 384  # Token width (ViT-S: 384).
    c.mlp_dim = 1536  # Hidden width of each block's MLP (4 x width).
  return c


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
ghost_clipping.register_norm_rule(WSConv, name='wsconv', params=ghost_clipping.conv.WS_CONV_PARAMS)(
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
                    mlp_dim: int) -> jax.Array:
  """num_layers x (x += MHA(LN(x)); x += MLP(LN(x))), final LN, mean over tokens.

  Called inside a compact `__call__`: the layers are the caller's submodules
  (LayerNorm_i, MultiHeadDotProductAttention_i, Dense_i, numbered in order).
  """
  for _ in range(num_layers):
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=num_heads, qkv_features=width, deterministic=True)(y, y)
    y = nn.LayerNorm()(x)
    x = x + nn.Dense(width)(nn.gelu(nn.Dense(mlp_dim)(y)))
  return jnp.mean(nn.LayerNorm()(x), axis=-2)


class Transformer(nn.Module):
  """Pre-LayerNorm transformer encoder classifier for sequences.

  Inputs are int tokens [n, L] (vocab_size > 0, nn.Embed) or float features
  [n, L, D_in] (vocab_size = 0, Dense projection; trailing axes beyond L are
  flattened into D_in); plus a learned positional
  embedding; num_layers x (x += MHA(LN(x)); x += MLP(LN(x))); final LN; mean
  over positions; Dense classifier. No attention masks: every position counts.
  """
  num_classes: int
  max_length: int
  vocab_size: int = 0
  num_layers: int = 2
  num_heads: int = 4
  model_dim: int = 64
  mlp_dim: int = 128

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
                        self.mlp_dim)
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


def _check_positive(name: str, value, field: str) -> None:
  if not isinstance(value, int) or value <= 0:
    raise ValueError(f'config.model.{field} must be a positive int for model '
                     f'{name!r}, got {value!r}.')


def _cnn_output_size(size: int, cfg) -> int:
  for k, s, p in zip(cfg.kernel_sizes, cfg.strides, cfg.paddings):
    size = -(-size // s) if p == 'SAME' else (size - k) // s + 1
    size -= 1  # maxpool 2, stride 1, VALID.
  return size


def make_model(model_config: ml_collections.ConfigDict, num_classes: int,
               input_shape: Sequence[int]) -> nn.Module:
  """Builds the model named by `model_config.name` (fields as in defaults).

  Missing fields take the values of `default_model_config(name)`; unknown
  fields, bad values and any request for batch norm raise ValueError.

  Args:
    model_config: `config.model`.
    num_classes: number of output logits.
    input_shape: shape of one example (no batch axis), e.g. (28, 28, 1), (L,)
      for tokens or (L, D_in) for sequence features.

  Returns:
    A flax.linen Module mapping [n, *input_shape] to logits [n, num_classes].
  """
  raw = (model_config.to_dict() if hasattr(model_config, 'to_dict')
         else dict(model_config))
  name = raw.get('name')
  for field, value in raw.items():
    asks_batchnorm = (
        (field == 'normalization' and 'batch' in str(value).lower()) or
        ('batch' in field.lower() and 'norm' in field.lower() and value))
    if asks_batchnorm:
      valid = _NORMALIZATIONS.get(name, ('groupnorm', 'layernorm'))
      raise ValueError(
          f'config.model.{field}={value!r}: BatchNorm is not allowed in DP '
          'training. Its batch statistics make each example\'s gradient '
          'depend on the other examples of the batch (so per-example clipping '
          'no longer bounds one example\'s influence), and its running '
          'statistics are an un-noised release of the data. Use '
          f'normalization in {valid} for model {name!r}.')
  defaults = default_model_config(name)  # Validates the name.
  unknown = sorted(set(raw) - set(defaults.keys()))
  if unknown:
    raise ValueError(f'config.model has unknown field(s) {unknown} for model '
                     f'{name!r}; valid fields: {sorted(defaults.keys())}.')
  cfg = ml_collections.ConfigDict({**defaults.to_dict(), **raw})
  if cfg.normalization not in _NORMALIZATIONS[name]:
    raise ValueError(
        f'config.model.normalization={cfg.normalization!r} is not valid for '
        f'model {name!r}; valid: {_NORMALIZATIONS[name]}.')
  _check_positive(name, num_classes, 'num_classes (from the data)')
  input_shape = tuple(int(d) for d in input_shape)
  if not input_shape or any(d <= 0 for d in input_shape):
    raise ValueError(f'input_shape must be non-empty and positive, got '
                     f'{input_shape}.')
  if 'activation' in cfg and cfg.activation not in ACTIVATIONS:
    raise ValueError(f'config.model.activation={cfg.activation!r}; valid: '
                     f'{tuple(ACTIVATIONS)}.')

  if name == 'mlp':
    for h in cfg.hidden_sizes:
      _check_positive(name, h, 'hidden_sizes[i]')
    return MLP(num_classes, tuple(cfg.hidden_sizes), cfg.activation)

  if name == 'cnn':
    n = len(cfg.features)
    if not (len(cfg.kernel_sizes) == len(cfg.strides) == len(cfg.paddings)
            == n):
      raise ValueError('config.model.{features, kernel_sizes, strides, '
                       'paddings} must have the same length.')
    if any(p not in ('SAME', 'VALID') for p in cfg.paddings):
      raise ValueError(f'config.model.paddings={cfg.paddings}; each must be '
                       "'SAME' or 'VALID'.")
    if len(input_shape) != 3:
      raise ValueError(
          f'cnn needs images HxWxC, got input_shape={input_shape}.')
    out = min(_cnn_output_size(d, cfg) for d in input_shape[:2])
    if out < 1:
      raise ValueError(
          f'cnn: input_shape={input_shape} is too small for kernel_sizes='
          f'{tuple(cfg.kernel_sizes)}, paddings={tuple(cfg.paddings)} (spatial '
          "size reaches 0); use paddings=('SAME', 'SAME') for small images.")
    return CNN(num_classes, tuple(cfg.features), tuple(cfg.kernel_sizes),
               tuple(cfg.strides), tuple(cfg.paddings), cfg.hidden_size,
               cfg.activation)

  if name == 'wrn':
    _check_positive(name, cfg.depth, 'depth')
    _check_positive(name, cfg.width, 'width')
    _check_positive(name, cfg.groups, 'groups')
    if cfg.depth < 10 or (cfg.depth - 4) % 6:
      raise ValueError(f'config.model.depth={cfg.depth}: need depth = 6n + 4 '
                       'with n >= 1 (10, 16, 22, 28, ...).')
    if cfg.normalization == 'groupnorm' and 16 % cfg.groups:
      raise ValueError(f'config.model.groups={cfg.groups} must divide 16 (the '
                       'stem width; all widths are multiples of 16).')
    if len(input_shape) != 3:
      raise ValueError(
          f'wrn needs images HxWxC, got input_shape={input_shape}.')
    return WideResNet(num_classes, cfg.depth, cfg.width, cfg.groups,
                      cfg.normalization, bool(cfg.weight_standardization),
                      cfg.activation)

  if name == 'vit':
    for field in ('patch_size', 'num_layers', 'num_heads', 'width', 'mlp_dim'):
      _check_positive(name, cfg[field], field)
    if cfg.width % cfg.num_heads:
      raise ValueError(f'config.model.num_heads={cfg.num_heads} must divide '
                       f'width={cfg.width}.')
    if len(input_shape) != 3 or any(d % cfg.patch_size for d in input_shape[:2]):
      raise ValueError(f'vit needs images HxWxC with H and W multiples of '
                       f'config.model.patch_size={cfg.patch_size}, got '
                       f'input_shape={input_shape}.')
    return ViT(num_classes, cfg.patch_size, cfg.num_layers, cfg.num_heads,
               cfg.width, cfg.mlp_dim)

  # transformer
  for field in ('num_layers', 'num_heads', 'model_dim', 'mlp_dim'):
    _check_positive(name, cfg[field], field)
  if cfg.model_dim % cfg.num_heads:
    raise ValueError(f'config.model.num_heads={cfg.num_heads} must divide '
                     f'model_dim={cfg.model_dim}.')
  if not isinstance(cfg.vocab_size, int) or cfg.vocab_size < 0:
    raise ValueError('config.model.vocab_size must be an int >= 0 (0 = float '
                     f'features), got {cfg.vocab_size!r}.')
  if (len(input_shape) != 1) if cfg.vocab_size > 0 else (len(input_shape) < 2):
    raise ValueError(
        f'transformer with vocab_size={cfg.vocab_size} needs input_shape '
        f"{'(L,) of tokens' if cfg.vocab_size > 0 else '(L, D_in, ...) of features'}, got "
        f'{input_shape}.')
  return Transformer(num_classes, input_shape[0], cfg.vocab_size,
                     cfg.num_layers, cfg.num_heads, cfg.model_dim, cfg.mlp_dim)


def input_dtype(model: nn.Module) -> jnp.dtype:
  """dtype of the model's input: int32 tokens or float32 features/pixels."""
  if isinstance(model, Transformer) and model.vocab_size > 0:
    return jnp.int32
  return jnp.float32
