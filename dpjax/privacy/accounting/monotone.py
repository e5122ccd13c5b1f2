"""Searches on monotone functions, on the safe side, by dp_accounting's bisection.

Every search of the accountants that needs no early stop runs through
`dp_accounting.pld.common.inverse_monotone_function` (bracket by doubling, then
bisect); these wrappers fix its edge cases and the side of the answer:

* integer searches give the unique answer (the largest n with ε(n) <= target, the
  smallest cap B whose truncation penalty is small enough): no rounding at all;
* the float search returns the upper end of its final bracket, a point where the
  condition was checked to hold (an ε rounded up, never down).

Evaluations are memoised: the library evaluates a bracket end again.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

from dp_accounting.pld import common


def largest_integer(
  fn: Callable[[int], float], value: float, *, lower: int, upper: int, first_guess: int
) -> int | None:
  """The largest integer n in [lower, upper] with fn(n) <= value, fn non-decreasing.

  None if fn(lower) > value. Doubling from `first_guess` brackets the answer; fn(upper)
  is evaluated only when every smaller candidate passed.
  """
  fn = functools.lru_cache(maxsize=None)(fn)
  found = common.inverse_monotone_function(
    fn,
    value,
    common.BinarySearchParameters(lower, upper, initial_guess=first_guess, discrete=True),
    increasing=True,
  )
  if found is None:
    return None
  if found == upper - 1 and fn(upper) <= value:  # The library never tries its upper bound.
    return upper
  return int(found)


def smallest_integer(
  fn: Callable[[int], float], value: float, *, above: int, first_guess: int
) -> int:
  """The smallest integer n > above with fn(n) <= value, fn non-increasing, fn(above) > value."""
  found = common.inverse_monotone_function(
    functools.lru_cache(maxsize=None)(fn),
    value,
    common.BinarySearchParameters(above, math.inf, initial_guess=first_guess, discrete=True),
  )
  return int(found)


def smallest_passing(ok: Callable[[float], bool], lo: float, hi: float, tolerance: float) -> float:
  """Bisects [lo, hi] (ok(lo) false, ok(hi) true, ok monotone there) to `tolerance`.

  Returns the upper end of the final bracket: ok holds there (checked, not assumed).
  """
  failing = functools.lru_cache(maxsize=None)(lambda x: 0.0 if ok(x) else 1.0)
  found = common.inverse_monotone_function(
    failing, 0.5, common.BinarySearchParameters(lo, hi, tolerance=tolerance)
  )
  if found is None:
    raise ValueError(f'the condition does not hold at the upper end {hi!r} of the bracket.')
  return float(found)
