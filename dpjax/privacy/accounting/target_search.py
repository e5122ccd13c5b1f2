"""Monotone searches against an ε target: the smallest σ, the largest count.

ε is non-increasing in σ and non-decreasing in the number of steps (docs/accounting.md §6),
so both searches bracket (doubling) and bisect, and return the end of the bracket at which the
target *holds*: the answer is valid even where the accountant's ε is only approximately
monotone (PLD discretisation, adaptive random-allocation refinement). Integer searches run
through `monotone` (dp_accounting's inverse_monotone_function): their answer is unique. The σ
search is its own geometric bisection because it stops as soon as ε(σ) lands within
epsilon_rtol below the target: each ε(σ) costs a PLD build, and no library search stops on
the function's value.
"""

from __future__ import annotations

import math
from typing import Callable

from dpjax.privacy.accounting import monotone

# ε(σ) within this relative distance below the target ends the σ search.
DEFAULT_EPSILON_RTOL = 5e-3
_MIN_SIGMA, _MAX_SIGMA = 1e-2, 1e4


def check_target_epsilon(target_epsilon) -> float:
  """ε target: a finite number > 0 (a ValueError naming target_epsilon otherwise)."""
  if (
    isinstance(target_epsilon, bool)
    or not isinstance(target_epsilon, (int, float))
    or not (math.isfinite(target_epsilon) and target_epsilon > 0)
  ):
    raise ValueError(f'target_epsilon must be a finite number > 0, got {target_epsilon!r}.')
  return float(target_epsilon)


def smallest_noise_multiplier(
  epsilon_of_sigma: Callable[[float], float],
  target_epsilon: float,
  *,
  initial: float = 1.0,
  lower: float | None = None,
  bracket: tuple[float, float] | None = None,
  epsilon_rtol: float = DEFAULT_EPSILON_RTOL,
  sigma_rtol: float = 1e-6,
) -> float:
  """The smallest σ (to tolerance) with ε(σ) <= target, by bracketing and bisection.

  Stops when target·(1 − epsilon_rtol) <= ε(σ) <= target or when the bracket is
  narrower than sigma_rtol. Returns σ with ε(σ) <= target (always checked).
  `bracket` = (lo, hi), a guess with ε(lo) > target >= ε(hi) (checked; the
  search falls back to doubling/halving from hi if it is wrong).

  Raises:
    ValueError: if even σ = 1e4 misses the target.
  """
  target = check_target_epsilon(target_epsilon)
  cache: dict[float, float] = {}

  def eps(sigma):
    if sigma not in cache:
      cache[sigma] = epsilon_of_sigma(sigma)
    return cache[sigma]

  def close_enough(sigma):
    return target * (1 - epsilon_rtol) <= eps(sigma) <= target

  if bracket is not None:
    initial, lower = bracket[1], bracket[0]
  hi = float(initial)
  if eps(hi) <= target:
    if close_enough(hi):
      return hi
    ratio = 0.5 if lower is None else min(float(lower) / hi, 0.999)
    lo = hi * ratio
    while eps(lo) <= target:
      if close_enough(lo) or lo <= _MIN_SIGMA:
        return lo
      ratio = max(0.5, ratio * ratio)  # Widen the downward steps geometrically.
      hi, lo = lo, lo * ratio
  else:
    lo = hi
    while eps(hi) > target:
      lo, hi = hi, hi * 2
      if hi > _MAX_SIGMA:
        raise ValueError(
          f'target ε = {target} is not reached even with σ = {_MAX_SIGMA:g} (or '
          'its privacy loss cannot be composed in memory): shorten the run, raise '
          'the target or the batch size.'
        )
  # Invariant: ε(lo) > target >= ε(hi).
  while not close_enough(hi) and hi - lo > sigma_rtol * hi:
    mid = math.sqrt(lo * hi)
    if eps(mid) <= target:
      hi = mid
    else:
      lo = mid
  return hi


def largest_count(
  epsilon_of_count: Callable[[int], float], target_epsilon: float, *, max_count: int = 10**9
) -> int:
  """The largest integer n >= 0 (<= max_count) with ε(n) <= target (0 if ε(1) > target)."""
  target = check_target_epsilon(target_epsilon)
  found = monotone.largest_integer(
    epsilon_of_count, target, lower=1, upper=max_count, first_guess=2
  )
  return 0 if found is None else found
