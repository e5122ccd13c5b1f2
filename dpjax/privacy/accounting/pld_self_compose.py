"""T-fold self-composition of a PLD: dp_accounting's algorithm, its truncation bounds in numpy.

`PrivacyLossDistribution.self_compose(T)` (dp_accounting, privacy buckets of Meiser & Mohammadi
2018 with the FFT composition of Koskela et al. 2020) convolves each dense PMF with itself T
times by one FFT power, after bounding the support it keeps with a Chernoff bound: for 40
orders λ (±1..20 over the PMF's length n), the upper end is ⌈(T·log M(λ) + log(2/τ)) / λ⌉ and
the lower end ⌊…⌋ for λ < 0, where M(λ) = Σ_i p_i e^{λ·i} and τ is the tail mass truncated
(added to the infinity mass, so the result stays a pessimistic upper bound).

dp_accounting evaluates each log M(λ) with `scipy.special.logsumexp(i·λ, b=p)`, whose
array-API checks cost ~0.3 ms a call since scipy 1.15: 12 ms of the ~13 ms a small composition
takes, 40 calls a composition, every time calibration or a grid refinement composes (profile of
the test suite: 56 s of its CPU, Nov 27). `self_compose` here does the same arithmetic with
numpy directly (the same masking of p_i = 0, the same separation of the largest term, the same
pairwise sums), then the same FFT power and the same infinity mass: the result is dp_accounting's
bit for bit (tests/privacy/accounting/test_pld_self_compose.py). Sparse PMFs are composed by
dp_accounting itself.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import fft

TAIL_MASS_TRUNCATION = 1e-15  # dp_accounting's default τ.


def log_moment_generating_function(probs: np.ndarray, orders: np.ndarray) -> list[float]:
  """log Σ_i p_i e^{λ·i} for each order λ, as `scipy.special.logsumexp(i·λ, b=p)` computes it:
  terms with p_i = 0 dropped, the largest term separated out, log1p of the rest's ratio to it.

  λ·i is monotone in i, so the largest term is at the last (λ > 0) or first (λ < 0) index with
  p_i > 0, and it is the only one; the rest is summed over the full-length array (zeros where
  scipy has e^{-∞}, at the same positions, so numpy's pairwise sum adds the same numbers in the
  same order)."""
  present = np.flatnonzero(probs)
  if len(present) == 0:
    return [-math.inf] * len(orders)  # As scipy: the log of an empty sum.
  index = np.arange(len(probs), dtype=float)
  out = []
  for order in orders:
    top = present[-1] if order > 0 else present[0]
    largest = index[top] * order
    terms = index * order
    terms -= largest
    np.exp(terms, out=terms)
    terms *= probs
    terms[top] = 0.0
    rest = np.sum(terms)
    weight = probs[top]
    ratio = rest if rest == 0 else rest / weight
    out.append(float(np.log1p(ratio) + np.log(weight) + largest))
  return out


def self_convolve_bounds(probs: np.ndarray, count: int, tail_mass: float) -> tuple[int, int]:
  """The index range [lower, upper] outside which `count`-fold self-convolution of `probs`
  has at most `tail_mass` (dp_accounting's `common.compute_self_convolve_bounds`)."""
  upper = (len(probs) - 1) * count
  lower = 0
  if tail_mass == 0:
    return lower, upper
  orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / len(probs)
  for order, log_mgf in zip(orders, log_moment_generating_function(probs, orders)):
    bound = (count * log_mgf + math.log(2 / tail_mass)) / order
    if not math.isfinite(bound):
      continue
    if order > 0:
      upper = min(upper, math.ceil(bound))
    if order < 0:
      lower = max(lower, math.floor(bound))
  return lower, upper


def _goes_dense(pmf, count: int) -> bool:
  """Whether dp_accounting's sparse self-composition converts to dense first (its test,
  size**count > _MAX_PMF_SPARSE_SIZE, without the power of a long run's count)."""
  # pylint: disable-next=protected-access
  limit = pld_pmf._MAX_PMF_SPARSE_SIZE
  return pmf.size > 1 and count > 1 and pmf.size ** min(count, limit.bit_length() + 1) > limit


def _self_compose_pmf(pmf, count: int, tail_mass: float):
  if isinstance(pmf, pld_pmf.SparsePLDPmf) and _goes_dense(pmf, count):
    pmf = pmf.to_dense_pmf()
  if not isinstance(pmf, pld_pmf.DensePLDPmf):
    return pmf.self_compose(count, tail_mass)  # Sparse: dp_accounting's pairwise compositions.
  # pylint: disable=protected-access
  probs = pmf._probs
  lower, upper = self_convolve_bounds(probs, count, tail_mass)
  size = upper - lower + 1
  fast = fft.next_fast_len(max(size, len(probs)))
  powered = np.real(fft.ifft(fft.fft(probs, fast) ** count))
  composed = np.array(np.roll(powered, -lower)[:size])
  infinity_mass = tail_mass - math.expm1(count * math.log1p(-pmf._infinity_mass))
  return pld_pmf.DensePLDPmf(
    pmf._discretization,
    pmf._lower_loss * count + lower,
    composed,
    infinity_mass,
    pmf._pessimistic_estimate,
  )
  # pylint: enable=protected-access


def self_compose(
  pld: pld_lib.PrivacyLossDistribution, count: int, tail_mass: float = TAIL_MASS_TRUNCATION
) -> pld_lib.PrivacyLossDistribution:
  """`pld.self_compose(count, tail_mass)`, the same PLD bit for bit, without scipy's per-call
  overhead in the truncation bounds."""
  if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count <= 0:
    raise ValueError(f'count must be a positive int, got {count!r}.')
  # pylint: disable=protected-access
  remove = _self_compose_pmf(pld._pmf_remove, int(count), tail_mass)
  if pld._symmetric:
    return pld_lib.PrivacyLossDistribution(remove)
  return pld_lib.PrivacyLossDistribution(
    remove, _self_compose_pmf(pld._pmf_add, int(count), tail_mass)
  )
  # pylint: enable=protected-access
