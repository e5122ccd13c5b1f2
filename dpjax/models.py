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

import flax.linen as nn
import jax.numpy as jnp
import ml_collections

from dpjax import nnx_model
from dpjax import nnx_networks

# The networks themselves (dpjax.networks), re-exported: models.MLP, models.ViT, ...
from dpjax.networks import (  # pylint: disable=unused-import
    ACTIVATIONS, CNN, MLP, Transformer, ViT, WideResNet, WSConv)

# Normalisations each model supports. BatchNorm is deliberately absent.
_NORMALIZATIONS = {
    'mlp': ('none',),
    'cnn': ('none',),
    'wrn': ('groupnorm', 'none'),
    'transformer': ('layernorm',),
    'vit': ('layernorm',),
}
MODEL_NAMES = tuple(_NORMALIZATIONS)
NNX_MODELS = ('mlp', 'cnn', 'vit')  # Also written in Flax NNX (`dpjax.nnx_networks`).
FRAMEWORKS = ('linen', 'nnx')


def default_model_config(name: str) -> ml_collections.ConfigDict:
  """Every field model `name` reads, with its default and meaning."""
  if name not in MODEL_NAMES:
    raise ValueError(
        f'config.model.name={name!r} is not a model; valid: {MODEL_NAMES}.')
  c = ml_collections.ConfigDict()
  c.name = name  # mlp | cnn | wrn | transformer | vit
  if name in NNX_MODELS:
    c.framework = 'linen'  # linen | nnx (Flax NNX: dpjax.nnx_networks, the same network).
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
    # True: a causal language model, logits per position (loss sequence_cross_entropy).
    c.causal = False
  elif name == 'vit':
    c.normalization = 'layernorm'  # Pre-LayerNorm blocks (LN is per example).
    c.patch_size = 4  # Square patches; must divide the image height and width.
    c.num_layers = 12  # Encoder blocks (ViT-S: 12).
    c.num_heads = 6  # Attention heads; must divide width (ViT-S: 6).
    c.width = 384  # Token width (ViT-S: 384).
    c.mlp_dim = 1536  # Hidden width of each block's MLP (4 x width).
  return c


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
  nnx = cfg.get('framework', 'linen') == 'nnx'
  if cfg.get('framework', 'linen') not in FRAMEWORKS:
    raise ValueError(f'config.model.framework={cfg.framework!r}; valid: {FRAMEWORKS}.')

  if name == 'mlp':
    for h in cfg.hidden_sizes:
      _check_positive(name, h, 'hidden_sizes[i]')
    if nnx:
      return _nnx(name, lambda rngs: nnx_networks.MLP(
          input_shape, num_classes, tuple(cfg.hidden_sizes), cfg.activation, rngs=rngs))
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
    args = (num_classes, tuple(cfg.features), tuple(cfg.kernel_sizes), tuple(cfg.strides),
            tuple(cfg.paddings), cfg.hidden_size, cfg.activation)
    if nnx:
      return _nnx(name, lambda rngs: nnx_networks.CNN(input_shape, *args, rngs=rngs))
    return CNN(*args)

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
    args = (num_classes, cfg.patch_size, cfg.num_layers, cfg.num_heads, cfg.width,
            cfg.mlp_dim)
    if nnx:
      return _nnx(name, lambda rngs: nnx_networks.ViT(input_shape, *args, rngs=rngs))
    return ViT(*args)

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
                     cfg.num_layers, cfg.num_heads, cfg.model_dim, cfg.mlp_dim,
                     bool(cfg.causal))


def _nnx(name: str, make) -> nnx_model.NNXModule:
  """The NNX network `make(rngs)` with linen's init/apply, so the trainer takes it unchanged."""
  return nnx_model.NNXModule(make, name=f'{name} (nnx)')


def input_dtype(model: nn.Module) -> jnp.dtype:
  """dtype of the model's input: its `input_dtype` (int32 tokens) if declared, else float32."""
  return getattr(model, 'input_dtype', None) or jnp.float32
