"""Builds a model from a config's `model` block, over a registry of model families.

Per-example privacy needs per-example gradients, so no layer may mix examples
of a batch: there is no BatchNorm (its batch statistics make one example's
gradient depend on the others, and its running averages leak them), only
GroupNorm / LayerNorm, which normalise within one example. All models are
deterministic (no dropout), so the gradient of an example is a well-defined
function of (params, example). Every model maps a batch `x: [n, *input_shape]`
to logits `[n, num_classes]`, and row i of the output depends on row i only.

`make_model(config.model, num_classes, input_shape)` is the one entry point;
`default_model_config(name)` declares, with a comment, every field a model
reads, so configs can start from it and override a few fields. Each family
(`mlp`, `cnn`, `wrn`, `transformer`, `vit`: one module each, which cites its
papers) is one entry of `FAMILIES` (`dpjax.models.family.Family`).
"""

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp
import ml_collections

from dpjax.models import cnn
from dpjax.models import family
from dpjax.models import layers
from dpjax.models import mlp
from dpjax.models import transformer
from dpjax.models import vit
from dpjax.models import wrn

FAMILIES = {
  'mlp': mlp.FAMILY,
  'cnn': cnn.FAMILY,
  'wrn': wrn.FAMILY,
  'transformer': transformer.FAMILY,
  'vit': vit.FAMILY,
}
MODEL_NAMES = tuple(FAMILIES)
FRAMEWORKS = ('linen', 'nnx')


def default_model_config(name: str) -> ml_collections.ConfigDict:
  """Every field model `name` reads, with its default and meaning."""
  if name not in MODEL_NAMES:
    raise ValueError(f'config.model.name={name!r} is not a model; valid: {MODEL_NAMES}.')
  c = ml_collections.ConfigDict()
  c.name = name  # mlp | cnn | wrn | transformer | vit
  if FAMILIES[name].nnx:
    c.framework = 'linen'  # linen | nnx (Flax NNX: the family's NNX twin, the same network).
  FAMILIES[name].add_fields(c)
  return c


def _refuse_batchnorm(raw: dict, name) -> None:
  """Raises ValueError, with the reason, if any field asks for BatchNorm."""
  for field, value in raw.items():
    asks_batchnorm = (field == 'normalization' and 'batch' in str(value).lower()) or (
      'batch' in field.lower() and 'norm' in field.lower() and value
    )
    if asks_batchnorm:
      valid = FAMILIES[name].normalizations if name in FAMILIES else ('groupnorm', 'layernorm')
      raise ValueError(
        f'config.model.{field}={value!r}: BatchNorm is not allowed in DP '
        "training. Its batch statistics make each example's gradient "
        'depend on the other examples of the batch (so per-example clipping '
        "no longer bounds one example's influence), and its running "
        'statistics are an un-noised release of the data. Use '
        f'normalization in {valid} for model {name!r}.'
      )


def _checked_config(model_config) -> ml_collections.ConfigDict:
  """`model_config` over its family's defaults, after the checks every family shares."""
  raw = model_config.to_dict() if hasattr(model_config, 'to_dict') else dict(model_config)
  name = raw.get('name')
  _refuse_batchnorm(raw, name)
  defaults = default_model_config(name)  # Validates the name.
  unknown = sorted(set(raw) - set(defaults.keys()))
  if unknown:
    raise ValueError(
      f'config.model has unknown field(s) {unknown} for model '
      f'{name!r}; valid fields: {sorted(defaults.keys())}.'
    )
  cfg = ml_collections.ConfigDict({**defaults.to_dict(), **raw})
  normalizations = FAMILIES[name].normalizations
  if cfg.normalization not in normalizations:
    raise ValueError(
      f'config.model.normalization={cfg.normalization!r} is not valid for '
      f'model {name!r}; valid: {normalizations}.'
    )
  return cfg


def make_model(
  model_config: ml_collections.ConfigDict, num_classes: int, input_shape: Sequence[int]
) -> nn.Module:
  """Builds the model named by `model_config.name` (fields as in defaults).

  Missing fields take the values of `default_model_config(name)`; unknown
  fields, bad values and any request for batch norm raise ValueError.

  Args:
    model_config: `config.model`.
    num_classes: number of output logits.
    input_shape: shape of one example (no batch axis), e.g. (28, 28, 1), (L,)
      for tokens or (L, D_in) for sequence features.

  Returns:
    A module with linen's init / apply (a flax.linen Module, or an NNX network
    wrapped as `dpjax.models.functional.NNXModule`) mapping [n, *input_shape] to
    logits [n, num_classes].
  """
  cfg = _checked_config(model_config)
  family.check_positive(cfg.name, num_classes, 'num_classes (from the data)')
  input_shape = tuple(int(d) for d in input_shape)
  if not input_shape or any(d <= 0 for d in input_shape):
    raise ValueError(f'input_shape must be non-empty and positive, got {input_shape}.')
  if 'activation' in cfg and cfg.activation not in layers.ACTIVATIONS:
    raise ValueError(
      f'config.model.activation={cfg.activation!r}; valid: {tuple(layers.ACTIVATIONS)}.'
    )
  if cfg.get('framework', 'linen') not in FRAMEWORKS:
    raise ValueError(f'config.model.framework={cfg.framework!r}; valid: {FRAMEWORKS}.')
  return FAMILIES[cfg.name].build(cfg, num_classes, input_shape)


def input_dtype(model: nn.Module) -> jnp.dtype:
  """dtype of the model's input: its `input_dtype` (int32 tokens) if declared, else float32."""
  return getattr(model, 'input_dtype', None) or jnp.float32
