"""The one-run ε lower bound of Steinke, Nasr & Jagielski (2023).

"Privacy Auditing with One (1) Training Run", NeurIPS 2023. m canaries are
each included in the training data by an independent fair coin S_j. After
training the auditor scores every canary and guesses "in" for the k₊ highest
scores, "out" for the k₋ lowest, and abstains on the rest (r = k₊ + k₋
guesses). If training is (ε, δ)-DP with respect to each canary, the number W
of correct guesses satisfies, for every v (their Theorem 3.1 / Prop. 5.3):

  Pr[W ≥ v] ≤ f(v) + 2mδ · max_{i=1..v} (f(v−i) − f(v)) / i,
  f(v) = Pr[Binomial(r, p) ≥ v],  p = e^ε / (1 + e^ε).

(With δ = 0, W is stochastically dominated by Binomial(r, p).) The audit
rejects ε at level β when this p-value is ≤ β; since the p-value grows with
ε, the lower bound is the largest rejected ε, found with scipy's brentq. The
statement holds with probability ≥ 1 − β = `confidence` over the coins and
the training randomness: the reported ε_lower is a *lower* bound on the ε of
any (ε, δ) guarantee the run can have, not an estimate of it.

Choosing k after seeing the scores would void the confidence. Here the guess
counts come from a fixed list fixed in advance and the level is split over
them (Bonferroni: each is tested at β / len(list)), so reporting the best of
them is valid.

What one run cannot show: with all r guesses correct the bound is at most
log(p*/(1−p*)) with p* = (β/L)^{1/r} (L the list length, ignoring δ), e.g.
5.15 at m = 1000, r = 800, β = 0.05, L = 5 (5.09 with δ = 1e-5). The δ term
grows with m·δ: at δ = 1e-5 the largest bound peaks near 6.4 (m ≈ 10⁴) and
then falls, so ε = 8 cannot be refuted at δ = 1e-5 however many canaries
(`max_epsilon_lower`). A correct DP-SGD run yields far less than its ε. So a one-run audit can refute
gross bugs (ε_lower > claimed ε), never confirm that a claim is tight.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from scipy import optimize, special

from dpjax.privacy import checks

# Guesses per side as fractions of m (k₊ = k₋ = round(f·m/2)); the level is split over them.
DEFAULT_GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.3, 0.8)
# Upper end of the ε search; a p-value still ≤ β here reports this value (a huge leak).
MAX_EPSILON = 100.0


def _check(m: int, r: int, v: int, delta: float) -> None:
  if not (isinstance(m, (int, np.integer)) and m >= 1):
    raise ValueError(f'num_canaries m must be an integer >= 1, got {m!r}.')
  if not 0 <= v <= r <= m:
    raise ValueError(f'need 0 <= correct guesses v <= guesses r <= m = {m}, got v = {v}, r = {r}.')
  checks.check_delta(delta, allow_zero=True)


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
  """Upper bound on Pr[W ≥ v] under an (ε, δ)-DP null hypothesis (Theorem 3.1)."""
  _check(m, r, v, delta)
  if epsilon < 0:
    raise ValueError(f'epsilon must be >= 0, got {epsilon}.')
  p = 1.0 / (1.0 + math.exp(-epsilon))
  # scipy.special, not scipy.stats.binom: the same values without the distribution object's
  # argument checks, ~10x faster (an audit's ε search evaluates this ~100 times).
  f_v = float(special.bdtrc(v - 1, r, p))  # Pr[Bin(r, p) >= v] (1 for v = 0)
  if delta == 0 or v == 0:
    return min(1.0, f_v)
  # f(v - i) - f(v) = Pr[v - i <= Bin < v] = Σ_{w = v-i}^{v-1} pmf(w), i = 1..v.
  pmf = _binomial_pmf(np.arange(v - 1, -1, -1), r, p)
  i = np.arange(1, v + 1)
  slack = float(np.max(np.cumsum(pmf) / i))
  return min(1.0, f_v + 2 * m * delta * slack)


def _binomial_pmf(k: np.ndarray, n: int, p: float) -> np.ndarray:
  """Pr[Bin(n, p) = k] by log-gamma (relative error ~1e-12 for n <= 10**4; p = 1 gives 0
  below k = n, 1 at it)."""
  log_choose = special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)
  return np.exp(log_choose + special.xlogy(k, p) + special.xlog1py(n - k, -p))


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float) -> float:
  """The largest ε whose (ε, δ)-DP null is rejected at level β = 1 − confidence (0 if none)."""
  beta = 1.0 - confidence
  if not 0 < beta < 1:
    raise ValueError(f'audit.confidence must be in (0, 1), got {confidence}.')
  excess = lambda eps: p_value(m, r, v, eps, delta) - beta
  if excess(0.0) > 0:
    return 0.0
  if excess(MAX_EPSILON) <= 0:
    return MAX_EPSILON
  return float(optimize.brentq(excess, 0.0, MAX_EPSILON, xtol=1e-6))


@dataclasses.dataclass(frozen=True)
class OneRunAudit:
  """The best guess count's bound; every count was tested at level β / len(guess_counts)."""

  epsilon_lower: float
  confidence: float
  delta: float
  num_canaries: int
  num_guesses: int  # r of the best count
  num_correct: int  # v of the best count
  guess_counts: tuple[tuple[int, int, int], ...]  # (r, v, ε_lower) for every count tried

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d['guess_counts'] = [list(row) for row in self.guess_counts]
    return d


def guess_counts(m: int, fractions: Sequence[float] = DEFAULT_GUESS_FRACTIONS) -> list[int]:
  """Guesses per side k = round(f·m/2) (at least 1), one per fraction, distinct."""
  return sorted({max(1, round(f * m / 2)) for f in fractions})


def count_correct(scores: np.ndarray, membership: np.ndarray, k: int) -> int:
  """Correct guesses when the top k scores are guessed 'in' and the bottom k 'out'."""
  order = np.argsort(scores, kind='stable')
  return int(np.sum(membership[order[len(scores) - k :]]) + np.sum(~membership[order[:k]]))


def audit(
  scores: np.ndarray,
  membership: np.ndarray,
  *,
  delta: float,
  confidence: float,
  fractions: Sequence[float] = DEFAULT_GUESS_FRACTIONS,
) -> OneRunAudit:
  """ε lower bound from canary scores (higher = more likely included) and their coins.

  Args:
    scores: float [m], any function of what the run released (never of the coins).
    membership: bool [m], the coins S_j (True = the canary was in the training data).
    delta: δ of the null hypothesis (the run's δ).
    confidence: 1 − β.
    fractions: guess counts as fractions of m, fixed in advance (Bonferroni over them).
  """
  scores = np.asarray(scores, np.float64)
  membership = np.asarray(membership, bool)
  m = len(scores)
  if membership.shape != (m,):
    raise ValueError(f'membership must have shape ({m},) like scores, got {membership.shape}.')
  ks = [k for k in guess_counts(m, fractions) if 2 * k <= m]
  if not ks:
    raise ValueError(f'no valid guess count for m = {m} canaries (need 2k <= m).')
  level = 1.0 - (1.0 - confidence) / len(ks)
  rows = []
  for k in ks:
    v = count_correct(scores, membership, k)
    rows.append((2 * k, v, epsilon_lower_bound(m, 2 * k, v, delta, level)))
  r, v, best = max(rows, key=lambda row: row[2])
  return OneRunAudit(
    epsilon_lower=best,
    confidence=confidence,
    delta=delta,
    num_canaries=m,
    num_guesses=r,
    num_correct=v,
    guess_counts=tuple(rows),
  )


def max_epsilon_lower(
  m: int, *, delta: float, confidence: float, fractions: Sequence[float] = DEFAULT_GUESS_FRACTIONS
) -> float:
  """The largest bound `audit` can return with m canaries: every guess correct."""
  ks = [k for k in guess_counts(m, fractions) if 2 * k <= m]
  level = 1.0 - (1.0 - confidence) / len(ks)
  return max(epsilon_lower_bound(m, 2 * k, 2 * k, delta, level) for k in ks)
