"""Every field of a training config, declared once: type, valid range, default and meaning.

`FIELDS` is the one table: the run's own fields (seed, loss) and each block's,
declared in `dpjax.trainer.configuration.blocks` (one module per block), in the order of
docs/config.md. From it come the default config (`default_config()`, which every
config file starts from), the checks (`validate`: each field's type and range, the
cross-field rules, and `check_known_fields`: a field that is not declared, e.g. a
typo, is refused with "did you mean"), and the documentation (`python -m
dpjax.trainer.configuration.config_fields` prints docs/config.md). The model block's fields are
declared by the model (`models.default_model_config`). A bad field raises `ConfigError` (a
ValueError) with one line that names it, shows the value and states the valid
range, e.g.

  privacy.noise_multiplier = 0.0: must be a finite number > 0 or None (σ; None =
  calibrate it to privacy.target_epsilon). To train without privacy, set
  privacy.enabled=False.

Checks that need the data (b ≤ N, labels) or the devices (P a multiple of the
device count) live where those are known, with messages in the same form.
"""

from __future__ import annotations

import difflib
import sys
from typing import Any

import ml_collections
from ml_collections import config_dict

from dpjax.privacy import losses
from dpjax.models import factory as models
from dpjax.trainer.configuration.blocks import audit
from dpjax.trainer.configuration.blocks import data
from dpjax.trainer.configuration.blocks import devices
from dpjax.trainer.configuration.blocks import length
from dpjax.trainer.configuration.blocks import optimizer
from dpjax.trainer.configuration.blocks import privacy as privacy_block
from dpjax.trainer.configuration.blocks import recipe
from dpjax.trainer.configuration.blocks import sampler
from dpjax.trainer.configuration.field_spec import Field

NON_PRIVATE_HINT = privacy_block.NON_PRIVATE_HINT


class ConfigError(ValueError):
  """A config field is missing, unknown or out of its valid range (one line, names the field)."""


def _synthetic(config) -> bool:
  return config.data.source == 'synthetic'


FIELDS: tuple[Field, ...] = (
  Field(
    'seed',
    'int',
    None,
    'root seed of sampling, noise and init; None = a secret one drawn '
    'from OS entropy (kept in <workdir>/private/seed.json). A given seed must be secret '
    'for ε to hold, and every run of a sweep needs its own',
    0,
    2**63 - 1,
    optional=True,
  ),
  Field(
    'loss',
    'str',
    'softmax_cross_entropy',
    'the per-example loss: softmax_cross_entropy '
    '(classes) | mse (float targets y [N] or [N, d]; npz/memmap) | sequence_cross_entropy '
    "(int tokens x, y [N, T], y = -1 padding; npz/memmap; the mean over a sequence's "
    'tokens, so the unit of privacy is the sequence)',
    choices=losses.LOSSES,
  ),
  *data.FIELDS,
  *sampler.FIELDS,
  *privacy_block.FIELDS,
  *optimizer.FIELDS,
  *recipe.FIELDS,
  *devices.FIELDS,
  *length.FIELDS,
  *audit.FIELDS,
)
FIELDS_BY_PATH = {f.path: f for f in FIELDS}
# Fields that no longer exist, and what replaced them (a config still setting one is refused).
REMOVED_FIELDS = {
  'max_nonfinite_fraction': 'it stopped a run on the exact count of examples with a '
  'non-finite loss or gradient, a statistic of the private data without noise, so whether '
  'a model was released depended on one record. Such examples are dropped (they add exactly '
  'zero), the run stops only on non-finite parameters, and features beyond '
  'data.max_abs_feature are refused when the data is opened. Delete the field (from the '
  "workdir's config.json too, when resuming)",
}
DEFAULT_MODEL = 'mlp'
DEFAULT_HIDDEN_SIZES = (64,)  # Small: the noise norm grows with √(#params).


def default_config() -> ml_collections.ConfigDict:
  """Every declared field at its default (the digits MLP run); config files start from it."""
  config = ml_collections.ConfigDict()
  for field in FIELDS:
    *parents, leaf = field.path.split('.')
    node = config
    for name in parents:
      if name not in node:
        node[name] = ml_collections.ConfigDict()
      node = node[name]
    if field.default is None:
      node[leaf] = config_dict.placeholder(float if field.kind == 'float' else int)
    else:
      node[leaf] = field.default
  config.model = models.default_model_config(DEFAULT_MODEL)
  config.model.hidden_sizes = DEFAULT_HIDDEN_SIZES
  return config


def get(config: ml_collections.ConfigDict, path: str, default: Any = KeyError) -> Any:
  """config['a.b.c'], or `default` when a part is missing (KeyError if no default)."""
  node = config
  for part in path.split('.'):
    if not isinstance(node, (ml_collections.ConfigDict, dict)) or part not in node:
      if default is KeyError:
        raise KeyError(path)
      return default
    node = node[part]
  return node


def field_paths(config: ml_collections.ConfigDict, prefix: str = '') -> list[str]:
  """Every leaf field of `config` as a dotted path."""
  paths = []
  for key, value in config.items():
    path = f'{prefix}{key}'
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      paths.extend(field_paths(value, path + '.'))
    else:
      paths.append(path)
  return paths


def declared_paths(config: ml_collections.ConfigDict | None = None) -> list[str]:
  """The declared fields: FIELDS and the model block of `config.model.name`."""
  name = DEFAULT_MODEL
  if config is not None and isinstance(config.get('model'), (ml_collections.ConfigDict, dict)):
    name = config.model.get('name', DEFAULT_MODEL)
  model = (
    models.default_model_config(name)
    if name in models.MODEL_NAMES
    else ml_collections.ConfigDict({'name': name})
  )
  return [f.path for f in FIELDS] + [f'model.{p}' for p in field_paths(model)]


def closest_field(name: str, candidates: list[str]) -> str | None:
  """The declared path closest to `name` (for 'did you mean')."""
  match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
  if not match:  # A typo in the last part only: compare leaf names.
    leaf = name.rsplit('.', 1)[-1]
    by_leaf = {p.rsplit('.', 1)[-1]: p for p in candidates}
    hits = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
    match = [by_leaf[hits[0]]] if hits else []
  return match[0] if match else None


def removed_field_message(path: str) -> str | None:
  """One line for a field that was removed (`REMOVED_FIELDS`), else None."""
  if path not in REMOVED_FIELDS:
    return None
  return f'{path}: this field was removed: {REMOVED_FIELDS[path]}.'


def check_known_fields(config: ml_collections.ConfigDict) -> None:
  """ConfigError for the first field that is not declared (a typo), with 'did you mean'."""
  name = get(config, 'model.name', DEFAULT_MODEL)
  if name not in models.MODEL_NAMES:
    raise ConfigError(
      f'model.name = {name!r}: must be one of {", ".join(repr(n) for n in models.MODEL_NAMES)}.'
    )
  declared = declared_paths(config)
  known = set(declared)
  for path in field_paths(config):
    if path in REMOVED_FIELDS:
      raise ConfigError(removed_field_message(path))
    if path not in known:
      _check_model_block(path, name)
      guess = closest_field(path, declared)
      hint = f' Did you mean {guess}?' if guess else ''
      raise ConfigError(
        f'{path}: not a field of a dpjax config.{hint} (Every field is listed in docs/config.md.)'
      )


def _check_model_block(path: str, name: str) -> None:
  """ConfigError for a field of another model's block (`--config.model.name` changed the model
  and left the old one's fields): "did you mean" would name a field the command line cannot add."""
  owners = [
    other
    for other in models.MODEL_NAMES
    if path.startswith('model.')
    and path[len('model.') :] in field_paths(models.default_model_config(other))
  ]
  if owners and name not in owners:
    fields = ', '.join(f'model.{p}' for p in field_paths(models.default_model_config(name)))
    raise ConfigError(
      f'{path}: a field of model {owners[0]!r}, not of model.name = {name!r}, whose fields are '
      f"{fields}. Overriding model.name keeps the other model's fields and cannot add these: "
      f'write a config file with `config.model = dpjax.models.factory.default_model_config('
      f'{name!r})` (as the packaged configs do), then override its fields.'
    )


def validate(config: ml_collections.ConfigDict, *, accounting_only: bool = False) -> None:
  """Checks every declared field (and the cross-field rules); ConfigError on the first bad one.

  With `accounting_only`, the config need only hold the fields that enter ε (those marked
  `accounting`); other fields are checked when present, and undeclared fields are allowed.
  """
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(
      f'the config is a {type(config).__name__}, not an '
      'ml_collections.ConfigDict: get_config() must return one (start from '
      'dpjax.trainer.configuration.config_fields.default_config()).'
    )
  if not accounting_only:
    check_known_fields(config)
  for field in FIELDS:
    try:
      value = get(config, field.path)
    except KeyError:
      if accounting_only and not field.accounting:
        continue
      raise ConfigError(
        f'{field.path}: missing from the config (start from '
        'dpjax.trainer.configuration.config_fields.default_config(), which declares every field).'
      ) from None
    if field.when is not None and not field.when(config):
      continue
    if not field.is_valid(value):
      raise ConfigError(field.message(value))
  if (config.num_steps > 0) == (config.num_epochs > 0):
    raise ConfigError(
      f'num_steps = {config.num_steps}, num_epochs = {config.num_epochs}: exactly '
      'one must be > 0 (the other 0).'
    )
  privacy = config.privacy
  if privacy.enabled and privacy.noise_multiplier is None and not privacy.target_epsilon:
    raise ConfigError(
      'privacy.noise_multiplier or privacy.target_epsilon must be set (σ = None, '
      'target ε = 0): set σ, or a target ε > 0 to calibrate σ to, or both (σ fixed, '
      'the target a budget). ' + NON_PRIVATE_HINT
    )
  max_batch, physical = config.sampler.max_batch_size, config.sampler.physical_batch_size
  if max_batch and physical and max_batch % physical:
    raise ConfigError(
      f'sampler.max_batch_size = {max_batch}: must be 0 (auto) or a multiple of '
      f'sampler.physical_batch_size = {physical}.'
    )
  if accounting_only:
    return
  if _synthetic(config):
    if config.data.num_examples < 1:
      raise ConfigError(
        f'data.num_examples = {config.data.num_examples}: must be an integer >= 1 '
        "for data.source = 'synthetic'."
      )
    if config.data.num_classes < 2:
      raise ConfigError(
        f'data.num_classes = {config.data.num_classes}: must be an integer >= 2 '
        "for data.source = 'synthetic'."
      )


def markdown() -> str:
  """docs/config.md: every field with its default, valid values and meaning."""
  lines = [
    '# Config fields',
    '',
    'Generated by `python -m dpjax.trainer.configuration.config_fields` from '
    '`dpjax/trainer/configuration/config_fields.py` (the one declaration of every field). Config files '
    'start from `dpjax.trainer.configuration.config_fields.default_config()` and override a few fields; '
    'a field that is not listed here is refused with "did you mean". The model block is declared by '
    '`dpjax.models.factory.default_model_config(name)`.',
    '',
    '| field | default | valid values | meaning |',
    '|---|---|---|---|',
  ]
  for f in FIELDS:
    default = 'None' if f.default is None else repr(f.default)
    lines.append(f'| `{f.path}` | `{default}` | {f.valid_range()} | {f.doc} |')
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  sys.stdout.write(markdown())
