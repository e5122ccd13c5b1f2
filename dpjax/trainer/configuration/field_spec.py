"""The declaration of one config field: its type, valid range, default and meaning.

`Field.is_valid` checks a value and `Field.message` states what a bad one must be, in
one line that names the field; `dpjax.trainer.configuration.config_fields.FIELDS` declares them all.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import ml_collections
import numpy as np

from dpjax.privacy.checks import is_int, is_number

KINDS = ('int', 'float', 'bool', 'str', 'text', 'floats', 'ints', 'texts', 'pairs')


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field.

  Attributes:
    path: dotted path, e.g. 'privacy.delta'.
    kind: 'int', 'float', 'bool', 'str' (one of `choices`), 'text' (any string),
      'floats' / 'ints' (a non-empty tuple of numbers), 'texts' (a tuple of strings),
      'pairs' (a tuple of (str, str)).
    default: the value of `default_config()`.
    doc: what the field is (docs/config.md, and the message of a bad value).
    low, high, low_open, high_open: the valid interval (None = unbounded); floats must
      also be finite.
    choices: the valid values of a 'str' field.
    optional: None is allowed (e.g. σ = None: calibrate).
    hint: a sentence appended to the message of a bad value (how to fix it).
    when: the field is checked only if this predicate of the config holds.
    accounting: needed to account for a run (the account CLI's and the planner's configs).
  """

  path: str
  kind: str
  default: Any
  doc: str = ''
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  choices: tuple[str, ...] = ()
  optional: bool = False
  hint: str = ''
  when: Callable[[ml_collections.ConfigDict], bool] | None = None
  accounting: bool = False

  def valid_range(self) -> str:
    """The valid values in words, e.g. 'an integer >= 1' or 'a finite number in (0, 1)'."""
    if self.kind == 'bool':
      return 'True or False'
    if self.kind == 'str':
      return 'one of ' + ', '.join(repr(c) for c in self.choices)
    if self.kind in ('text', 'texts', 'pairs'):
      return {
        'text': 'a string',
        'texts': 'a tuple of strings',
        'pairs': 'a tuple of (regex, replacement) string pairs',
      }[self.kind]
    fmt = lambda v: str(int(v)) if self.kind in ('int', 'ints') else f'{v:g}'
    noun = {
      'int': 'an integer',
      'float': 'a finite number',
      'ints': 'a tuple of integers',
      'floats': 'a tuple of finite numbers',
    }[self.kind]
    if self.low is not None and self.high is not None:
      text = (
        f'{noun} in {"(" if self.low_open else "["}{fmt(self.low)}, {fmt(self.high)}'
        f'{")" if self.high_open else "]"}'
      )
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
    if self.kind in ('float', 'floats') and not math.isfinite(x):
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
    if self.kind == 'text':
      return isinstance(value, str)
    if self.kind == 'int':
      return is_int(value) and self._in_range(value)
    if self.kind == 'float':
      return is_number(value) and self._in_range(float(value))
    if not isinstance(value, (tuple, list)):
      return False
    if self.kind == 'texts':
      return all(isinstance(v, str) for v in value)
    if self.kind == 'pairs':
      return all(
        isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(s, str) for s in v)
        for v in value
      )
    if not value:
      return False
    check = is_int if self.kind == 'ints' else is_number
    return all(check(v) and self._in_range(float(v) if self.kind == 'floats' else v) for v in value)

  def message(self, value) -> str:
    doc = f' ({self.doc})' if self.doc else ''
    hint = f' {self.hint}' if self.hint else ''
    return f'{self.path} = {value!r}: must be {self.valid_range()}{doc}.{hint}'
