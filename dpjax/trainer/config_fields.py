"""Every field of a training config, declared once: type, valid range, default and meaning.

`FIELDS` is the one declaration. From it come the default config
(`default_config()`, which every config file starts from), the checks
(`validate`: each field's type and range, the cross-field rules, and
`check_known_fields`: a field that is not declared, e.g. a typo, is refused
with "did you mean"), and the documentation (`python -m dpjax.trainer.config_fields`
prints docs/config.md). The model block's fields are declared by the model
(`models.default_model_config`). A bad field raises `ConfigError` (a
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

from dpjax.privacy import clipping
from dpjax.privacy.ghost_clipping import form_timing
from dpjax.data import sources as data
from dpjax.data import validation as data_validation
from dpjax.privacy import losses
from dpjax.models import factory as models
from dpjax.privacy import prng
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant
from dpjax.trainer.field_spec import Field

NON_PRIVATE_HINT = 'To train without privacy, set privacy.enabled=False.'


class ConfigError(ValueError):
  """A config field is missing, unknown or out of its valid range (one line, names the field)."""


def _private(config) -> bool:
  return bool(config.privacy.enabled)


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
  # --- data
  Field(
    'data.source',
    'str',
    'digits',
    'digits (embedded) | tfds | npz | memmap | synthetic',
    choices=data.SOURCES,
  ),
  Field('data.name', 'text', '', "TFDS dataset name (source 'tfds'), e.g. 'mnist'"),
  Field('data.data_dir', 'text', '', "a prepared TFDS data_dir (source 'tfds'); never downloaded"),
  Field(
    'data.path',
    'text',
    '',
    "an .npz with x_train, y_train, x_test, y_test (source 'npz'), "
    "or a directory of <split>/x.npy, <split>/y.npy (source 'memmap')",
  ),
  Field('data.train_split', 'text', 'train', 'the training split (tfds, memmap)'),
  Field('data.test_split', 'text', 'test', 'the test split (tfds, memmap)'),
  Field('data.image_key', 'text', 'image', 'the feature name of the inputs (tfds)'),
  Field('data.label_key', 'text', 'label', 'the feature name of the labels (tfds)'),
  Field('data.num_examples', 'int', 0, 'N of the synthetic source', 0),
  Field(
    'data.public_num_examples',
    'int',
    0,
    'a public upper bound on N, the training '
    'examples (e.g. N rounded up): q = b/N, the epochs, B, the δ check, σ, ε and the card '
    'use it and the exact N is never released (sampler poisson only; more rows are '
    'refused); 0 = the exact N, treated as public',
    0,
    accounting=True,
  ),
  Field('data.input_shape', 'ints', (8, 8, 1), 'per-example shape of the synthetic source', 1),
  Field(
    'data.num_classes',
    'int',
    0,
    'K, the classes (labels in [0, K)) or the token '
    "vocabulary: public, from the task's definition, never from the labels; 0 = the "
    "source's public description (digits: 10, tfds: its metadata); npz and memmap labels "
    'or tokens need it; the synthetic source needs K >= 2',
    0,
  ),
  Field(
    'data.scale',
    'float',
    0.0,
    "raw values are divided by it; 0 = from the data's public "
    "format, never its values: the source's documented range (digits: 16), 255 for uint8, "
    "the integer type's max, 1 for floats (the card records the value used)",
    0,
  ),
  Field(
    'data.mean',
    'floats',
    (0.5,),
    'public per-channel mean subtracted after scaling '
    '(never fitted on the private data); 0.5 and std 0.5 map [0, 1] to [-1, 1]',
  ),
  Field(
    'data.std',
    'floats',
    (0.5,),
    'public per-channel std: x = (raw / scale - mean) / std',
    0,
    low_open=True,
  ),
  Field('data.label_format', 'str', 'int', 'int | one_hot', choices=data.LABEL_FORMATS),
  Field(
    'data.max_abs_feature',
    'float',
    data_validation.MAX_ABS_FEATURE,
    'a public bound: an '
    'example with a feature beyond ±this after the preprocessing is refused when the data '
    'is opened (npz, memmap, digits), before training',
    0,
    low_open=True,
  ),
  # --- sampler and batching
  Field(
    'sampler.name',
    'str',
    'poisson',
    'the sampler; the accountant reads the same fields',
    choices=samplers.SAMPLER_NAMES,
    accounting=True,
  ),
  Field(
    'sampler.batch_size',
    'int',
    256,
    'b, the expected logical batch size (q = b/N)',
    1,
    accounting=True,
  ),
  Field(
    'sampler.physical_batch_size',
    'int',
    64,
    'P, rows per compiled call (static shape); 0 = the largest that fits the device',
    0,
    accounting=True,
  ),
  Field(
    'sampler.max_batch_size',
    'int',
    0,
    'B, the cap on a logical batch (a multiple of P; truncation is accounted); 0 = automatic',
    0,
    accounting=True,
  ),
  # --- privacy
  Field(
    'privacy.enabled',
    'bool',
    True,
    'False: the non-private baseline through the same pipeline',
    accounting=True,
  ),
  Field(
    'privacy.clip_norm',
    'float',
    1.0,
    'C, the per-example clip norm',
    0,
    low_open=True,
    when=_private,
    accounting=True,
    hint=NON_PRIVATE_HINT,
  ),
  Field(
    'privacy.noise_multiplier',
    'float',
    None,
    'σ; None = calibrate it to privacy.target_epsilon',
    0,
    low_open=True,
    optional=True,
    when=_private,
    accounting=True,
    hint=NON_PRIVATE_HINT,
  ),
  Field(
    'privacy.target_epsilon',
    'float',
    3.0,
    'the ε budget at the last step; 0 = none. σ '
    'None: calibrated to meet it; σ set: a run that would exceed it is refused',
    0,
    when=_private,
    accounting=True,
  ),
  Field(
    'privacy.delta',
    'float',
    1e-5,
    'δ; must be < 1/N (a warning above 1/(10·N))',
    0,
    1,
    low_open=True,
    high_open=True,
    when=_private,
    accounting=True,
  ),
  Field(
    'privacy.allow_large_delta', 'bool', False, 'accept δ >= 1/N (a weak guarantee)', when=_private
  ),
  Field(
    'privacy.accountant',
    'str',
    'auto',
    'auto | pld | rdp | monte_carlo',
    choices=accountant.ACCOUNTANTS,
    when=_private,
    accounting=True,
  ),
  Field(
    'privacy.group_size',
    'int',
    1,
    'k: the guarantee is for groups of k examples',
    1,
    when=_private,
    accounting=True,
  ),
  Field(
    'privacy.monte_carlo_workers',
    'int',
    None,
    'processes drawing the balls-and-bins '
    'Monte-Carlo samples; None = the available cores, as many as the samples pay to start '
    '(the estimate does not depend on it)',
    1,
    optional=True,
    when=_private,
  ),
  Field(
    'privacy.random_allocation_timeout',
    'float',
    300.0,
    'seconds for the provable '
    'balls-and-bins bound (cached on disk); past it the deterministic bound, labelled',
    0,
    low_open=True,
    when=_private,
  ),
  Field(
    'privacy.noise_prng',
    'str',
    'threefry',
    'the JAX generator of the noise: threefry '
    '(reproducible everywhere) | rbg | unsafe_rbg (faster; none is a cryptographic '
    'sampler; docs/threat_model.md)',
    choices=tuple(prng.NOISE_IMPLS),
  ),
  Field(
    'privacy.clipping',
    'str',
    'auto',
    'how per-example norms are computed: auto (ghost '
    'where it covers every parameter, else vmap) | vmap | ghost',
    choices=clipping.CLIPPING_METHODS,
  ),
  # --- optimiser
  Field('optimizer.name', 'str', 'sgd', 'sgd | adam', choices=('sgd', 'adam')),
  Field('optimizer.learning_rate', 'float', 1.0, 'the learning rate', 0, low_open=True),
  Field('optimizer.momentum', 'float', 0.0, 'sgd only; 0 disables', 0, 1, high_open=True),
  Field(
    'optimizer.schedule',
    'str',
    'constant',
    'constant | cosine (linear warm-up, then '
    'cosine decay to 0 at the last step) | step (piecewise constant)',
    choices=('constant', 'cosine', 'step'),
  ),
  Field('optimizer.warmup_steps', 'int', 0, 'cosine: steps of linear warm-up from 0', 0),
  Field(
    'optimizer.decay_steps',
    'ints',
    (),
    'step: the steps at which the rate is multiplied by decay_factor',
    1,
    when=lambda c: c.optimizer.schedule == 'step',
  ),
  Field(
    'optimizer.decay_factor', 'float', 0.1, 'step: the factor of each decay', 0, 1, low_open=True
  ),
  # --- recipe: augmentation multiplicity, EMA, fine-tuning (post-processing; none enters ε)
  Field(
    'augmult.num_views',
    'int',
    0,
    'K views per example, the gradient averaged over them '
    'before the one clipping (De et al. 2022); 0 or 1 = off',
    0,
  ),
  Field(
    'augmult.crop_padding', 'int', 0, 'images: reflect padding of the random crop; 0 = no crop', 0
  ),
  Field('augmult.flip', 'bool', False, 'images: random horizontal flip'),
  Field(
    'ema_decay',
    'float',
    0.0,
    'EMA of the parameters, decay min(d, (1+t)/(10+t)); 0 = off',
    0,
    1,
    high_open=True,
  ),
  Field(
    'init_from',
    'text',
    '',
    "pretrained params: an .npz ('/'-joined keys; assumed public "
    'unless a dpjax privacy card is inside or beside it), a dpjax export, a dpjax workdir '
    "or a checkpoint step directory, whose runs' privacy loss is composed into this run's "
    'ε; "" = the initialisation',
  ),
  Field(
    'init_from_rules',
    'pairs',
    (),
    "(regex, replacement) pairs renaming the file's keys; '' drops one",
  ),
  Field(
    'init_from_disjoint_data',
    'bool',
    False,
    "True declares that this run's data shares no "
    "individual with the dpjax run(s) init_from comes from: ε is then this run's alone; "
    "False composes their privacy loss with this run's",
  ),
  Field(
    'freeze',
    'texts',
    (),
    "regexes on '/'-joined parameter paths: frozen (no gradient, noise or clip cost)",
  ),
  Field('lora.rank', 'int', 0, 'r: LoRA adapters W + (alpha/r)·A·B on lora.targets; 0 = off', 0),
  Field('lora.alpha', 'float', 1.0, 'alpha > 0', 0, low_open=True),
  Field(
    'lora.targets',
    'texts',
    (),
    'regexes on kernel paths (Dense, Conv, attention); their W is frozen',
  ),
  # --- devices and speed (none enters ε, but precision does through η)
  Field(
    'num_devices',
    'int',
    0,
    'data-parallel devices: 0 = all; n > 0 = the first n (single '
    'process); P must be a multiple of it',
    0,
  ),
  Field(
    'precision',
    'str',
    'default',
    "default (the backend's matmul precision) | highest "
    '(float32) | bfloat16 (float32 master weights, bf16 compute); enters ε through η, the '
    'float rounding the accountant pays for (dpjax/privacy/rounding.py)',
    choices=('default', 'highest', 'bfloat16'),
  ),
  Field(
    'steps_per_call',
    'int',
    0,
    'logical steps per compiled call; 0 = automatic (16 on the '
    'device, fewer for slow steps so that a signal stops the run within about a step)',
    0,
    4096,
  ),
  Field(
    'compilation_cache_dir',
    'text',
    '',
    "persistent XLA cache: '' = $DPJAX_CACHE_DIR or "
    "~/.cache/dpjax/xla; 'none' = off; else a directory",
  ),
  Field(
    'clipping_forms',
    'str',
    'flops',
    "ghost clipping's form of each layer: flops (the "
    'FLOP rule of Bu et al. 2022) | measured (both forms of each layer timed alone on the '
    'device at the first compile, cached beside the compilation cache; on the CPU not yet '
    'faster on every model: scripts/results/bench_clipping_forms.json); speed only',
    choices=form_timing.FORM_RULES,
  ),
  # --- length and periodic actions
  Field(
    'num_epochs',
    'int',
    20,
    'exactly one of num_epochs, num_steps is > 0; an epoch is ceil(N/b) steps',
    0,
    accounting=True,
  ),
  Field('num_steps', 'int', 0, 'exactly one of num_epochs, num_steps is > 0', 0, accounting=True),
  Field('log_every_steps', 'int', 20, 'steps between log rows (and the last step)', 1),
  Field('eval_every_steps', 'int', 100, 'steps between evaluations (and the first and last)', 1),
  Field('checkpoint_every_steps', 'int', 100, 'steps between checkpoints (and the last)', 1),
  Field('keep_checkpoints', 'int', 3, 'checkpoints kept (the last step always)', 1),
  # --- empirical privacy audit
  Field(
    'audit.num_canaries',
    'int',
    0,
    'm gradient canaries, each in the data by a fair coin '
    '(N + m examples for sampler and accountant); 0 = off',
    0,
  ),
  Field(
    'audit.kind',
    'str',
    'gradient',
    "gradient: a canary's gradient is a fixed direction of norm > C",
    choices=('gradient',),
  ),
  Field(
    'audit.confidence',
    'float',
    0.95,
    '1 - β: the audit ε lower bound holds with at least this probability',
    0,
    1,
    low_open=True,
    high_open=True,
  ),
  Field(
    'audit.every_checkpoint',
    'bool',
    False,
    'also audit at every checkpoint (else the last step only)',
  ),
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
      'dpjax.trainer.config_fields.default_config()).'
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
        'dpjax.trainer.config_fields.default_config(), which declares every field).'
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
    'Generated by `python -m dpjax.trainer.config_fields` from '
    '`dpjax/trainer/config_fields.py` (the one declaration of every field). Config files '
    'start from `dpjax.trainer.config_fields.default_config()` and override a few fields; '
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
