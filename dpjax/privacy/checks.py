"""One-line argument checks shared by dpjax's modules (no dpjax imports: any module may use them).

Each names the field or flag and its valid range in the message, the form every
refusal of dpjax takes (docs/errors.md).
"""

import math

import numpy as np


def is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value) -> bool:
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int, maximum: int | None = None) -> int:
  """`value` if it is an int (not a bool) in [minimum, maximum]; else ValueError naming `name`."""
  if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
    upper = f' and <= {maximum}' if maximum is not None else ''
    raise ValueError(f'{name} must be an integer >= {minimum}{upper}, got {value!r}.')
  return int(value)


def check_number(name: str, value, *, low: float, high: float = math.inf,
                 open_high: bool = False) -> float:
  """`value` as a float if finite, > low and <= high (< high if open_high); else ValueError."""
  if not (is_number(value) and math.isfinite(value) and value > low
          and (value < high if open_high else value <= high)):
    upper = f' and < {high:g}' if open_high else (f' and <= {high:g}' if high < math.inf else '')
    raise ValueError(f'{name} must be a finite number > {low:g}{upper}, got {value!r}.')
  return float(value)
