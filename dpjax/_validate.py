"""Config validation from declared field specs: one clear line per bad field, before any compute.

Every field a training config may hold is declared once in `FIELDS` with its
type and valid range; `validate(config)` checks them all in declaration order
and raises `ConfigError` (a `ValueError`) for the first bad one, with a message
that names the field, shows the value and states the valid range, e.g.

  privacy.noise_multiplier = 0.0: must be a finite number > 0 (σ; None = calibrate to
  privacy.target_epsilon). To train without privacy, set privacy.enabled=False.

The checks here depend on the config alone; checks that need the data (b ≤ N)
or the devices (P a multiple of the device count) live where those are known,
with messages in the same form. The model block is validated by
`dpjax.models.make_model`, which names `config.model.<field>`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Callable

import ml_collections
import numpy as np

from dpjax import clipping
from dpjax import data
from dpjax import samplers
from dpjax._checks import _is_int, _is_number, check_int, check_number  # pylint: disable=unused-import
from dpjax.accounting import accountant

NON_PRIVATE_HINT = 'To train without privacy, set privacy.enabled=False.'


class ConfigError(ValueError):
  """A config field is missing or out of its valid range (one line, names the field)."""


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field: its type, valid range, and when it matters.

  Attributes:
    path: dotted path in the config, e.g. 'privacy.delta'.
    kind: 'int', 'float', 'bool', 'str', 'floats' (a tuple of numbers) or 'ints'.
    low, high: the valid interval (None = unbounded); `low_open`/`high_open`
      make an end exclusive. Floats must also be finite.
    choices: the valid values of a 'str' field.
    optional: None is allowed (e.g. σ = None: calibrate).
    meaning: what the field is, shown in the message.
    hint: a sentence appended to the message (how to fix it).
    when: the field is checked only if this predicate of the config holds.
  """

  path: str
  kind: str
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  choices: tuple[str, ...] = ()
  optional: bool = False
  meaning: str = ''
  hint: str = ''
  when: Callable[[ml_collections.ConfigDict], bool] | None = None
  accounting: bool = False  # Needed to account for a run (the planner's and account's configs).

  def valid_range(self) -> str:
    """The valid values in words, e.g. 'an integer >= 1' or 'a finite number in (0, 1)'."""
    if self.kind == 'bool':
      return 'True or False'
    if self.kind == 'str':
      return 'one of ' + ', '.join(repr(c) for c in self.choices)
    fmt = lambda v: str(int(v)) if self.kind in ('int', 'ints') else f'{v:g}'
    noun = {'int': 'an integer', 'float': 'a finite number', 'ints': 'a tuple of integers',
            'floats': 'a tuple of finite numbers'}[self.kind]
    if self.low is not None and self.high is not None:
      text = (f'{noun} in {"(" if self.low_open else "["}{fmt(self.low)}, {fmt(self.high)}'
              f'{")" if self.high_open else "]"}')
    elif self.low is not None:
      text = f'{noun} {">" if self.low_open else ">="} {fmt(self.low)}'
    elif self.high is not None:
      text = f'{noun} {"<" if self.high_open else "<="} {fmt(self.high)}'
    else:
      text = noun
    if self.kind in ('ints', 'floats') and (self.low is not None or self.high is not None):
      text = text.replace(noun, noun + ', each')
    return text + (' or None' if self.optional else '')

  def _in_range(self, x) -> bool:
    if self.kind == 'float' and not math.isfinite(x):
      return False
    if self.low is not None and (x < self.low or (self.low_open and x == self.low)):
      return False
    if self.high is not None and (x > self.high or (self.high_open and x == self.high)):
      return False
    return True

  def is_valid(self, value) -> bool:
    if value is None:
      return self.optional
    if self.kind == 'bool':
      return isinstance(value, (bool, np.bool_))
    if self.kind == 'str':
      return isinstance(value, str) and value in self.choices
    if self.kind == 'int':
      return _is_int(value) and self._in_range(value)
    if self.kind == 'float':
      return _is_number(value) and self._in_range(float(value))
    items = value if isinstance(value, (tuple, list)) else None
    if items is None or not items:
      return False
    check = _is_int if self.kind == 'ints' else _is_number
    return all(check(v) and self._in_range(float(v) if self.kind == 'floats' else v)
               for v in items)

  def message(self, value) -> str:
    meaning = f' ({self.meaning})' if self.meaning else ''
    hint = f' {self.hint}' if self.hint else ''
    return f'{self.path} = {value!r}: must be {self.valid_range()}{meaning}.{hint}'


def _private(config) -> bool:
  return bool(config.privacy.enabled)


FIELDS: tuple[Field, ...] = (
    Field('seed', 'int', 0, 2**63 - 1, optional=True,
          meaning='root seed of every random stream; None = drawn from OS entropy'),
    # --- data
    Field('data.source', 'str', choices=data.SOURCES),
    Field('data.label_format', 'str', choices=data.LABEL_FORMATS),
    Field('data.scale', 'float', 0, low_open=True, meaning='raw values are divided by it'),
    Field('data.mean', 'floats', meaning='public per-channel mean'),
    Field('data.std', 'floats', 0, low_open=True, meaning='public per-channel std'),
    Field('data.num_examples', 'int', 0, meaning='synthetic training-set size'),
    Field('data.num_classes', 'int', 2, meaning='synthetic classes'),
    Field('data.input_shape', 'ints', 1, meaning='synthetic per-example shape'),
    # --- sampler and batching
    Field('sampler.name', 'str', choices=samplers.SAMPLER_NAMES, accounting=True),
    Field('sampler.batch_size', 'int', 1, accounting=True,
          meaning='b, the expected logical batch size'),
    Field('sampler.physical_batch_size', 'int', 0, accounting=True,
          meaning='P, rows per compiled call; 0 = the largest that fits the device'),
    Field('sampler.max_batch_size', 'int', 0, accounting=True,
          meaning='B, the cap on the logical batch; 0 = auto'),
    # --- privacy
    Field('privacy.enabled', 'bool', accounting=True),
    Field('privacy.clip_norm', 'float', 0, low_open=True, when=_private, accounting=True,
          meaning='C, the per-example clip norm', hint=NON_PRIVATE_HINT),
    Field('privacy.noise_multiplier', 'float', 0, low_open=True, optional=True, when=_private,
          accounting=True, meaning='σ; None = calibrate it to privacy.target_epsilon',
          hint=NON_PRIVATE_HINT),
    Field('privacy.target_epsilon', 'float', 0, when=_private, accounting=True,
          meaning='the ε budget; 0 = none'),
    Field('privacy.delta', 'float', 0, 1, low_open=True, high_open=True, when=_private,
          accounting=True),
    Field('privacy.allow_large_delta', 'bool', when=_private),
    Field('privacy.accountant', 'str', choices=accountant.ACCOUNTANTS, when=_private,
          accounting=True),
    Field('privacy.group_size', 'int', 1, when=_private, accounting=True,
          meaning='k, the group size'),
    Field('privacy.monte_carlo_workers', 'int', 1, optional=True, when=_private,
          meaning='processes of the Monte-Carlo estimate; None = the available cores'),
    Field('privacy.random_allocation_timeout', 'float', 0, low_open=True, when=_private,
          meaning='seconds for the balls-and-bins random-allocation bound'),
    Field('privacy.clipping', 'str', choices=clipping.CLIPPING_METHODS),
    # --- optimiser
    Field('optimizer.name', 'str', choices=('sgd', 'adam')),
    Field('optimizer.learning_rate', 'float', 0, low_open=True),
    Field('optimizer.momentum', 'float', 0, 1, high_open=True),
    Field('optimizer.schedule', 'str', choices=('constant', 'cosine', 'step')),
    Field('optimizer.warmup_steps', 'int', 0, meaning='cosine: linear warm-up steps'),
    Field('optimizer.decay_steps', 'ints', 1, when=lambda c: c.optimizer.schedule == 'step',
          meaning='step: the steps at which the rate decays'),
    Field('optimizer.decay_factor', 'float', 0, 1, low_open=True,
          meaning='step: the rate is multiplied by it at each decay step'),
    # --- recipe: augmentation multiplicity, EMA, fine-tuning (post-processing; none enters ε)
    Field('augmult.num_views', 'int', 0, meaning='K views per example; 0 or 1 = off'),
    Field('augmult.crop_padding', 'int', 0, meaning='reflect padding of the random crop'),
    Field('augmult.flip', 'bool'),
    Field('ema_decay', 'float', 0, 1, high_open=True, meaning='EMA decay; 0 = off'),
    Field('lora.rank', 'int', 0, meaning='LoRA rank r; 0 = off'),
    Field('lora.alpha', 'float', 0, low_open=True, meaning='LoRA scale alpha (W + alpha/r·A·B)'),
    Field('precision', 'str', choices=('default', 'highest', 'bfloat16'),
          meaning='matmul precision; the clip bound C holds in every mode'),
    # --- devices, length, periodic actions
    Field('num_devices', 'int', 0, meaning='0 = all devices'),
    Field('steps_per_call', 'int', 0, 4096,
          meaning='logical steps per compiled call; 0 = automatic'),
    Field('num_epochs', 'int', 0, accounting=True,
          meaning='0 = unset; exactly one of num_epochs, num_steps > 0'),
    Field('num_steps', 'int', 0, accounting=True,
          meaning='0 = unset; exactly one of num_epochs, num_steps > 0'),
    Field('log_every_steps', 'int', 1),
    Field('eval_every_steps', 'int', 1),
    Field('checkpoint_every_steps', 'int', 1),
    Field('keep_checkpoints', 'int', 1),
)
FIELDS_BY_PATH = {f.path: f for f in FIELDS}


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


def closest_field(name: str, config: ml_collections.ConfigDict) -> str | None:
  """The declared field whose path is closest to `name` (for 'did you mean')."""
  candidates = field_paths(config)
  match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
  if not match:  # A typo in the last part only: compare leaf names.
    leaf = name.rsplit('.', 1)[-1]
    by_leaf = {p.rsplit('.', 1)[-1]: p for p in candidates}
    hits = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
    match = [by_leaf[hits[0]]] if hits else []
  return match[0] if match else None


def validate(config: ml_collections.ConfigDict, *, accounting_only: bool = False) -> None:
  """Checks every declared field (and the cross-field rules); ConfigError on the first bad one.

  With `accounting_only`, the config need only hold the fields that enter ε (those marked
  `accounting`); other fields are checked when present.
  """
  for field in FIELDS:
    try:
      value = get(config, field.path)
    except KeyError:
      if accounting_only and not field.accounting:
        continue
      raise ConfigError(f'{field.path}: missing from the config (declare it as '
                        f'configs/digits_mlp.py does).') from None
    if field.when is not None and not field.when(config):
      continue
    if not field.is_valid(value):
      raise ConfigError(field.message(value))
  if (config.num_steps > 0) == (config.num_epochs > 0):
    raise ConfigError(f'num_steps = {config.num_steps}, num_epochs = {config.num_epochs}: exactly '
                      'one must be > 0 (the other 0).')
  privacy = config.privacy
  if privacy.enabled and privacy.noise_multiplier is None and not privacy.target_epsilon:
    raise ConfigError('privacy.noise_multiplier or privacy.target_epsilon must be set (σ = None, '
                      'target ε = 0): set σ, or a target ε > 0 to calibrate σ to, or both (σ fixed, '
                      'the target a budget). ' + NON_PRIVATE_HINT)
  max_batch, physical = config.sampler.max_batch_size, config.sampler.physical_batch_size
  if max_batch and physical and max_batch % physical:
    raise ConfigError(f'sampler.max_batch_size = {max_batch}: must be 0 (auto) or a multiple of '
                      f'sampler.physical_batch_size = {physical}.')
