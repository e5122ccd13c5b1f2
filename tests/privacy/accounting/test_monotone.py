"""dpjax.privacy.accounting.monotone: the library bisection, on the safe side, against brute force."""

import math

import numpy as np
import pytest

from dpjax.privacy.accounting import monotone


@pytest.mark.parametrize('threshold', [0.5, 1, 2, 3, 7, 64, 100, 999, 1000, 5000])
def test_largest_integer_is_the_brute_force_answer(threshold):
  calls = []

  def fn(n):
    calls.append(n)
    return n / 10  # Non-decreasing; fn(n) <= t / 10 iff n <= t.

  found = monotone.largest_integer(fn, threshold / 10, lower=1, upper=1000, first_guess=2)
  brute = [n for n in range(1, 1001) if n / 10 <= threshold / 10]
  assert found == (max(brute) if brute else None)
  assert len(set(calls)) <= 2 * math.log2(1000) + 3  # A bisection, not a scan.
  assert 1000 not in calls or found in (999, 1000)  # The upper end only when all below pass.


@pytest.mark.parametrize('answer', [6, 11, 12, 13, 100, 4097])
def test_smallest_integer_is_the_brute_force_answer(answer):
  fn = lambda b: 1.0 if b < answer else 0.0  # Non-increasing.
  assert monotone.smallest_integer(fn, 0.5, above=5, first_guess=10) == answer


def test_smallest_passing_returns_a_passing_point_within_tolerance():
  rng = np.random.default_rng(0)
  for root in rng.uniform(0.01, 50, size=20):
    ok = lambda x, root=root: x >= root
    found = monotone.smallest_passing(ok, 0.0, 64.0, 1e-9)
    assert ok(found) and found - root <= 1e-9  # Rounded up, never down.
  with pytest.raises(ValueError, match='does not hold at the upper end'):
    monotone.smallest_passing(lambda x: False, 0.0, 1.0, 1e-6)
