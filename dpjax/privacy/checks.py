"""One-line argument checks shared by dpjax's modules (no dpjax imports: any module may use them).

Each names the field or flag and its valid range in the message, the form every
refusal of dpjax takes (docs/errors.md). The quantities that enter ε (σ, C, b, δ) have one
validator each here; every module that takes them calls it, under the argument's own name
(the trainer passes its config paths as `name`).
"""

import math
import warnings

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


def check_number(
  name: str, value, *, low: float, high: float = math.inf, open_high: bool = False
) -> float:
  """`value` as a float if finite, > low and <= high (< high if open_high); else ValueError."""
  if not (
    is_number(value)
    and math.isfinite(value)
    and value > low
    and (value < high if open_high else value <= high)
  ):
    upper = f' and < {high:g}' if open_high else (f' and <= {high:g}' if high < math.inf else '')
    raise ValueError(f'{name} must be a finite number > {low:g}{upper}, got {value!r}.')
  return float(value)


class LargeDeltaWarning(UserWarning):
  """δ > 1/(10·N): allowed, but weak (a few records could be released with probability δ·N)."""


def check_noise_multiplier(value, name: str = 'noise_multiplier') -> float:
  """σ: a finite number > 0 (σ = 0 releases the clipped sum without noise: no guarantee)."""
  return check_number(name, value, low=0.0)


def check_clip_norm(value, name: str = 'clip_norm', *, allow_inf: bool = False) -> float:
  """C: a finite number > 0 (C = ∞ makes the noise σ·C infinite or the sensitivity unbounded).

  allow_inf: accept ∞ too, for computing gradients and their norms without clipping (never for
  what is noised: the privatizer, the plan and the step refuse it).
  """
  if not allow_inf:
    return check_number(name, value, low=0.0)
  if not (is_number(value) and value > 0):  # NaN too.
    raise ValueError(f'{name} must be a number > 0 (inf: no clipping), got {value!r}.')
  return float(value)


def check_expected_batch_size(value, name: str = 'expected_batch_size') -> float:
  """b: a finite number > 0 (the sampler's expected_batch_size, the divisor of the noisy sum)."""
  return check_number(name, value, low=0.0)


def check_delta(
  value,
  name: str = 'delta',
  *,
  num_examples: int | None = None,
  allow_large_delta: bool = False,
  flag: str = 'allow_large_delta=True',
  allow_zero: bool = False,
  warn: bool = True,
) -> float:
  """δ in (0, 1) ([0, 1) if allow_zero); given N, also < 1/N unless allow_large_delta (`flag`
  names how to allow it), with a `LargeDeltaWarning` above 1/(10·N) if warn."""
  if allow_zero and is_number(value) and value == 0:
    return 0.0
  delta = check_number(name, value, low=0.0, high=1.0, open_high=True)
  if num_examples is None:
    return delta
  if delta >= 1.0 / num_examples and not allow_large_delta:
    raise ValueError(
      f'{name} = {delta:g} is >= 1/N = {1.0 / num_examples:.3g} (N = {num_examples}): such a '
      'guarantee allows publishing a random record in the clear. Use δ well below 1/N '
      f'(e.g. <= 1/(10·N)), or set {flag} to accept it.'
    )
  if warn and delta > 0.1 / num_examples:
    warnings.warn(
      f'{name} = {delta:g} exceeds 1/(10·N) = {0.1 / num_examples:.3g}: the '
      f'guarantee is weak for N = {num_examples}.',
      LargeDeltaWarning,
      stacklevel=2,
    )
  return delta
