"""Sensitivities against explicit enumeration of every participation pattern (n <= 12).

For a pattern π the true Δ(π)² = max_u ‖Σ_{t∈π} C[:, t] u_tᵀ‖_F² (‖u_t‖ <= 1) lies between
max_{s ∈ {±1}^π} sᵀ M_ππ s (realised by u_t = s_t·u) and Σ |M_ππ| (Cauchy-Schwarz); both are
equal when M_ππ >= 0. A reported value must be >= the realisable lower end for every pattern
(privacy), and equal to the maximum when it says `exact`.
"""

import itertools

import numpy as np
import pytest

from dpjax.privacy.correlated import sensitivity
from dpjax.privacy.correlated import toeplitz

N = 10
RNG = np.random.default_rng(1)
STRATEGIES = {
  'dp_sgd': np.eye(N),
  'banded_3': toeplitz.dense([1.0, 0.6, 0.3], N),
  'prefix_sqrt': toeplitz.dense([1, 1 / 2, 3 / 8, 5 / 16, 35 / 128, 63 / 256, 0.2, 0.19, 0.18], N),
  'dense_positive': np.tril(RNG.uniform(0.1, 1.0, (N, N))),
  'negative_gram': toeplitz.dense([1.0, -0.6, 0.2], N),  # CᵀC has negative entries.
  'dense_signed': np.tril(RNG.normal(size=(N, N))) + 3 * np.eye(N),
}


def min_sep_patterns(n, k, sep):
  for size in range(1, k + 1):
    for p in itertools.combinations(range(n), size):
      if all(b - a >= sep for a, b in itertools.pairwise(p)):
        yield p


def shuffle_patterns(n, size):
  epochs = [range(s, min(s + size, n)) for s in range(0, n, size)]
  return itertools.product(*epochs)


def true_range(c, patterns):
  """(max over π of the realisable sign lower end, max over π of Σ|M_ππ|)."""
  m = c.T @ c
  low = high = 0.0
  for p in patterns:
    block = m[np.ix_(p, p)]
    signs = np.array(list(itertools.product([-1, 1], repeat=len(p))))
    low = max(low, float(np.max(np.einsum('ki,ij,kj->k', signs, block, signs))))
    high = max(high, float(np.abs(block).sum()))
  return low, high


def check(result, c, patterns):
  low, high = true_range(c, list(patterns))
  assert result.value**2 >= low * (1 - 1e-12)  # Never below what some example can realise.
  if result.exact:
    assert np.isclose(result.value**2, low, rtol=1e-12) and np.isclose(low, high, rtol=1e-12)
  return low


@pytest.mark.parametrize('name', sorted(STRATEGIES))
def test_single_participation_is_the_largest_column_norm(name):
  c = STRATEGIES[name]
  result = sensitivity.single_participation(c)
  assert result.exact
  check(result, c, [(t,) for t in range(N)])


@pytest.mark.parametrize('name', sorted(STRATEGIES))
@pytest.mark.parametrize('k,sep', [(2, 1), (3, 2), (3, 3), (4, 3), (2, 5)])
def test_min_separation_against_every_pattern(name, k, sep):
  """Catches a bound that misses cross terms (min_sep < bands) or takes the k largest columns
  without their separation; `exact` where a b-banded C has b <= min_sep (disjoint supports)."""
  c = STRATEGIES[name]
  result = sensitivity.min_separation(c, k, sep)
  check(result, c, min_sep_patterns(N, k, sep))
  if name == 'banded_3' and sep >= 3 or name == 'dp_sgd':
    assert result.exact


@pytest.mark.parametrize('k,sep', [(1, 1), (2, 1), (3, 2), (3, 4), (5, 2)])
def test_toeplitz_min_separation_is_exact_for_decreasing_coefficients(k, sep):
  """The pattern {0, sep, 2·sep, ...} is the worst for c_0 >= c_1 >= ... >= 0 (equal to the
  enumeration's maximum); a signed C falls back to the dense bound (still >= every pattern)."""
  for coefs in ([1, 1 / 2, 3 / 8, 5 / 16, 35 / 128, 63 / 256, 0.2, 0.19, 0.18], [1.0, 0.6, 0.3]):
    result = sensitivity.toeplitz_min_separation(coefs, N, k, sep)
    c = toeplitz.dense(coefs, N)
    assert result.exact
    check(result, c, min_sep_patterns(N, k, sep))
  signed = sensitivity.toeplitz_min_separation([1.0, -0.6, 0.2], N, k, sep)
  check(signed, toeplitz.dense([1.0, -0.6, 0.2], N), min_sep_patterns(N, k, sep))


@pytest.mark.parametrize('name', sorted(STRATEGIES))
@pytest.mark.parametrize('size', [2, 3, 4, 10])
def test_a_shuffle_includes_adjacent_participations(name, size):
  """One participation per epoch anywhere in it: the enumeration includes the last step of an
  epoch next to the first of the following one. Catches a bound that assumes a fixed order."""
  c = STRATEGIES[name]
  result = sensitivity.one_per_epoch(c, size)
  check(result, c, shuffle_patterns(N, size))
  if name in ('dp_sgd', 'banded_3'):  # M vanishes two epochs apart: the chain DP is exact.
    assert result.exact


def test_adjacent_participations_cost_more_than_a_fixed_order():
  """For a banded C a shuffle's worst case (two adjacent steps) exceeds the fixed order's
  (T apart): the every-T-steps value would understate a shuffle's sensitivity."""
  c = STRATEGIES['banded_3']
  shuffled = sensitivity.one_per_epoch(c, 5)
  fixed = sensitivity.every_period(c, 5)
  assert shuffled.exact and fixed.exact
  assert shuffled.value > fixed.value * (1 + 1e-3)
  # Adjacent at the epoch boundary: steps 4 and 5.
  assert np.isclose(shuffled.value, sensitivity.pattern_sensitivity(c, [4, 5]).value, rtol=1e-12)


@pytest.mark.parametrize('name', sorted(STRATEGIES))
@pytest.mark.parametrize('period', [1, 3, 4, 10])
def test_every_period_against_its_patterns(name, period):
  c = STRATEGIES[name]
  result = sensitivity.every_period(c, period)
  patterns = [tuple(range(t, N, period)) for t in range(period)]
  low = check(result, c, patterns)
  if name != 'negative_gram' and name != 'dense_signed':
    assert result.exact and np.isclose(result.value**2, low, rtol=1e-12)


def test_negative_gram_entries_are_reported_as_an_upper_bound():
  """Two participations one step apart with M_01 < 0: opposite contributions (u_1 = −u_0) reach
  Σ|M|, so 1ᵀM1 (which would be smaller) must not be reported."""
  c = STRATEGIES['negative_gram']
  m = c.T @ c
  assert m[0, 1] < 0
  result = sensitivity.every_period(c, 1)
  assert not result.exact
  pair = sensitivity.pattern_sensitivity(c, [0, 1])
  assert np.isclose(pair.value**2, m[0, 0] + m[1, 1] + 2 * abs(m[0, 1]), rtol=1e-14)
  u = np.array([[1.0], [-1.0]])
  assert np.isclose(np.linalg.norm(c[:, [0, 1]] @ u) ** 2, pair.value**2, rtol=1e-12)


def test_random_contributions_never_exceed_the_sensitivity():
  """The definition itself: ‖Σ_{t∈π} C[:, t] u_tᵀ‖_F <= Δ for random unit u_t on random
  min-sep patterns (d = 4)."""
  rng = np.random.default_rng(2)
  for name, c in STRATEGIES.items():
    delta = sensitivity.min_separation(c, 3, 2).value
    for _ in range(200):
      p = np.sort(rng.choice(np.arange(0, N, 2), size=3, replace=False)) + rng.integers(0, 2)
      p = p[p < N]
      u = rng.normal(size=(len(p), 4))
      u /= np.linalg.norm(u, axis=1, keepdims=True)
      assert np.linalg.norm(c[:, p] @ u) <= delta * (1 + 1e-12), name


@pytest.mark.parametrize(
  'call,match',
  [
    (lambda: sensitivity.single_participation(np.triu(np.ones((3, 3)))), 'lower-triangular'),
    (lambda: sensitivity.single_participation(np.zeros((3, 3))), 'positive diagonal'),
    (lambda: sensitivity.min_separation(np.eye(3), 0, 1), 'participations must be'),
    (lambda: sensitivity.min_separation(np.eye(3), 1, 0), 'min_sep must be'),
    (lambda: sensitivity.one_per_epoch(np.eye(3), 0), 'steps_per_epoch must be'),
    (lambda: sensitivity.every_period(np.eye(3), 1.5), 'period must be'),
    (lambda: sensitivity.pattern_sensitivity(np.eye(3), [3]), 'pattern must'),
  ],
)
def test_arguments_are_checked(call, match):
  with pytest.raises(ValueError, match=match):
    call()
