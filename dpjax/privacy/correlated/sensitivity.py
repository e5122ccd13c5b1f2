"""Sensitivity Δ of X ↦ CX for the participation patterns dpjax's samplers produce.

One example contributes u_t (‖u_t‖ <= 1 per unit clip norm) at the steps π where it
participates; with M = CᵀC (Choquette-Choo, McMahan, Rush, Thakurta, "Multi-epoch matrix
factorization mechanisms for private machine learning"):

  Δ(π)² = max_u ‖Σ_{t∈π} C[:, t] u_tᵀ‖_F² = max_u Σ_{s,t∈π} M_st ⟨u_s, u_t⟩ <= Σ_{s,t∈π} |M_st|,

with equality when M_ππ >= 0 entrywise (all u_t equal). Every function here reports
Σ |M_st| (an upper bound whatever the signs) maximised over the sampler's patterns, and says
in `Sensitivity.exact` whether that is the maximum itself (M >= 0 where it is used, and the
maximisation over patterns exact) or only an upper bound. Adding a participation never lowers
Σ |M_st|, so the patterns' subsets (a Poisson draw that skips a step) are covered too.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

from dpjax.privacy import checks
from dpjax.privacy.correlated import toeplitz


class Sensitivity(NamedTuple):
  """Δ per unit clip norm: `value` >= Δ(π) for every pattern π of the sampler; `exact`: equal to
  the largest Δ(π) (otherwise an honest upper bound)."""

  value: float
  exact: bool


def check_strategy(strategy, name: str = 'strategy') -> np.ndarray:
  """A square lower-triangular float64 matrix of finite numbers with a positive diagonal."""
  c = np.asarray(strategy, dtype=np.float64)
  if (
    c.ndim != 2
    or c.shape[0] != c.shape[1]
    or c.shape[0] == 0
    or not np.all(np.isfinite(c))
    or np.any(np.triu(c, 1) != 0)
    or not np.all(np.diag(c) > 0)
  ):
    raise ValueError(
      f'{name} must be a square lower-triangular matrix of finite numbers with a positive '
      f'diagonal, got shape {c.shape}.'
    )
  return c


def check_pattern(n: int, participations: int, min_sep: int | None) -> tuple[int, int]:
  """(k, min_sep) for k participations at least min_sep apart; min_sep may be None (read as n)
  only for k = 1: more participations need their separation stated."""
  k = checks.check_int('participations', participations, 1)
  if min_sep is None and k > 1:
    raise ValueError(f'min_sep must be given for participations = {k} > 1 (an integer >= 1).')
  return k, (
    checks.check_int('n', n, 1) if min_sep is None else checks.check_int('min_sep', min_sep, 1)
  )


def gram(strategy) -> np.ndarray:
  """M = CᵀC (float64)."""
  c = check_strategy(strategy)
  return c.T @ c


def pattern_sensitivity(strategy, pattern) -> Sensitivity:
  """Δ(π) for one pattern π (distinct step indices): √(Σ_{s,t∈π} |M_st|), exact when M_ππ >= 0."""
  m = gram(strategy)
  idx = np.asarray(sorted({int(t) for t in pattern}), dtype=int)
  if idx.size == 0 or idx[0] < 0 or idx[-1] >= m.shape[0]:
    raise ValueError(f'pattern must hold steps in [0, {m.shape[0]}), got {pattern!r}.')
  block = m[np.ix_(idx, idx)]
  return Sensitivity(math.sqrt(np.abs(block).sum()), bool(np.all(block >= 0)))


def single_participation(strategy) -> Sensitivity:
  """Each example in at most one step: Δ = max_t ‖C[:, t]‖ (exact)."""
  c = check_strategy(strategy)
  return Sensitivity(float(np.max(np.linalg.norm(c, axis=0))), True)


def _best_separated_sum(weights: np.ndarray, count: int, min_sep: int) -> float:
  """max Σ_{t∈π} weights_t over π of at most `count` steps, each two >= min_sep apart (DP)."""
  n = weights.size
  best = np.zeros((n + 1, count + 1))  # best[t, m]: at most m picks among steps < t.
  for t in range(n):
    take = best[max(t + 1 - min_sep, 0), :-1] + weights[t]
    best[t + 1] = best[t]
    best[t + 1, 1:] = np.maximum(best[t, 1:], take)
  return float(best[n, count])


def _row_pattern_maxima(a: np.ndarray, count: int, min_sep: int) -> np.ndarray:
  """max_π Σ_{t∈π} a[s, t] for every row s at once (a >= 0; π: at most `count` steps >= min_sep
  apart): best[s, i] = max(a[s, i] + best'[s, i + min_sep], best[s, i + 1]), one pass per pick."""
  n = a.shape[0]
  best = np.zeros((n, n + min_sep))
  for _ in range(count):
    best[:, :n] = a + best[:, min_sep : min_sep + n]
    best = np.maximum.accumulate(best[:, ::-1], axis=1)[:, ::-1]
  return best[:, 0]


def min_separation(strategy, participations: int, min_sep: int) -> Sensitivity:
  """At most k participations, each two at least `min_sep` steps apart (cyclic and b-min-sep
  samplers; Choquette-Choo, Ganesh, McMahan, Rush, Thakurta, Xu, "(Amplified) banded matrix
  factorization: a unified approach to private training").

  When C's columns at distance >= min_sep have disjoint supports (a b-banded C with b <= min_sep)
  Δ² = max Σ_{t∈π} ‖C[:, t]‖², found exactly by dynamic programming. Otherwise an upper bound:
  Σ_{s∈π} h_s maximised over π, where h_s bounds row s's Σ_{t∈π} |M_st| by the smaller of
  |M_ss| plus its k − 1 largest |M_st| at distance >= min_sep, and the row's best pattern (the
  same paper's Algorithm 4); exact only when a pattern {s, s + min_sep, ...} attains it.
  """
  m = gram(strategy)
  n = m.shape[0]
  k = checks.check_int('participations', participations, 1)
  sep = checks.check_int('min_sep', min_sep, 1)
  a = np.abs(m)
  far = np.abs(np.subtract.outer(np.arange(n), np.arange(n))) >= sep
  if not np.any(a[far]):
    return Sensitivity(math.sqrt(_best_separated_sum(np.diag(a).copy(), k, sep)), True)
  partners = np.sort(np.where(far, a, 0.0), axis=1)[:, ::-1][:, : k - 1].sum(axis=1)
  rows = np.minimum(np.diag(a) + partners, _row_pattern_maxima(a, k, sep))
  upper = _best_separated_sum(rows, k, sep)
  lower = max(m[np.ix_(p, p)].sum() for s in range(min(sep, n)) for p in [np.arange(s, n, sep)[:k]])
  return Sensitivity(math.sqrt(upper), bool(np.isclose(lower, upper, rtol=1e-12, atol=0)))


def every_period(strategy, period: int) -> Sensitivity:
  """A fixed order, epochs of `period` steps: π = {t, t + T, t + 2T, ...} for t < T (exact
  when M >= 0 on those patterns, an upper bound otherwise)."""
  m = gram(strategy)
  n = m.shape[0]
  period = checks.check_int('period', period, 1)
  blocks = [m[np.ix_(p, p)] for p in (np.arange(t, n, period) for t in range(min(period, n)))]
  exact = all(np.all(b >= 0) for b in blocks)
  return Sensitivity(math.sqrt(max(np.abs(b).sum() for b in blocks)), exact)


def one_per_epoch(strategy, steps_per_epoch: int) -> Sensitivity:
  """A shuffle: one participation per epoch of T steps, anywhere in it, so two participations
  can be adjacent (last step of an epoch, first of the next).

  When M vanishes between epochs two or more apart (a b-banded C with b <= T + 1) the patterns'
  Σ |M_st| is a chain over epochs, maximised exactly by dynamic programming (Viterbi). Otherwise
  an upper bound: Σ_e max_{i in epoch e} (|M_ii| + Σ_{e' ≠ e} max_{j in epoch e'} |M_ij|).
  """
  m = gram(strategy)
  n = m.shape[0]
  size = checks.check_int('steps_per_epoch', steps_per_epoch, 1)
  epochs = [np.arange(s, min(s + size, n)) for s in range(0, n, size)]
  a = np.abs(m)
  epoch_of = np.arange(n) // size
  if not np.any(a[np.abs(np.subtract.outer(epoch_of, epoch_of)) >= 2]):
    value = np.diag(a)[epochs[0]]
    for prev, cur in itertools.pairwise(epochs):
      value = np.diag(a)[cur] + np.max(value[:, None] + 2 * a[np.ix_(prev, cur)], axis=0)
    near = np.abs(np.subtract.outer(epoch_of, epoch_of)) <= 1
    return Sensitivity(math.sqrt(float(np.max(value))), bool(np.all(m[near] >= 0)))
  best_in = np.stack([a[:, e].max(axis=1) for e in epochs], axis=1)  # [i, e'] max_j∈e' |M_ij|
  best_in[np.arange(n), epoch_of] = 0.0
  h = np.diag(a) + best_in.sum(axis=1)
  upper = sum(float(h[e].max()) for e in epochs)
  chosen = np.array([e[np.argmax(h[e])] for e in epochs])
  lower = m[np.ix_(chosen, chosen)].sum()
  return Sensitivity(math.sqrt(upper), bool(np.isclose(lower, upper, rtol=1e-12, atol=0)))


def toeplitz_min_separation(
  coefs, n: int, participations: int = 1, min_sep: int = 1
) -> Sensitivity:
  """min_separation for the Toeplitz C of `coefs` in O(k²·n), exact, when c_0 >= c_1 >= ... >= 0.

  Then M_st = Σ_{u < n − max(s,t)} c_u c_{u+|s−t|} >= 0 does not increase with |s − t| nor with
  max(s, t); any allowed pattern t_0 < t_1 < ... has t_i >= i·min_sep and |t_i − t_j| >=
  |i − j|·min_sep, so the pattern {0, min_sep, 2·min_sep, ...} (k steps, or as many as fit)
  attains the maximum. Other coefficients are handed to `min_separation` on the dense C.
  """
  c = toeplitz.padded(coefs, n)
  k = checks.check_int('participations', participations, 1)
  sep = checks.check_int('min_sep', min_sep, 1)
  if np.any(c < 0) or np.any(np.diff(c) > 0):
    return min_separation(toeplitz.dense(coefs, n), k, sep)
  steps = np.arange(0, n, sep)[:k]
  total = 0.0
  for s in steps:
    for t in steps:
      lag, top = abs(int(s) - int(t)), max(int(s), int(t))
      total += float(c[: n - top] @ c[lag : n - top + lag])
  return Sensitivity(math.sqrt(total), True)
