"""Deterministic *lower* bounds on δ(ε) by the max test (post-processing x ↦ max_t x_t).

A lower bound says how private a sampler is *not*: no accountant may report an ε below it.

* Balls-and-bins (Chua et al. 2025, "Balls-and-Bins Sampling for DP-SGD", seed 000, Eq. 6):
  the tight dominating pair P = (1/T) Σ_t N(e_t, σ²I), Q = N(0, σ²I) pushed through the max,
  F_{Q'}(z) = Φ(z/σ)^T and F_{P'}(z) = Φ((z−1)/σ) Φ(z/σ)^{T−1}.
* Shuffle (Chua et al. 2024a, "How Private are DP-SGD Implementations?"): the pair
  P = (1/T) Σ_t N(2e_t, σ²I), Q = (1/T) Σ_t N(e_t, σ²I) is dominated by shuffled ABLQ, and
  F_{P'}(z) = Φ((z−2)/σ) Φ(z/σ)^{T−1}, F_{Q'}(z) = Φ((z−1)/σ) Φ(z/σ)^{T−1}.

Both directions (P'‖Q' and Q'‖P', i.e. remove and add) are computed and the larger δ is
reported. See docs/accounting.md §2 ("Lower bound") and §3.

Why every number returned here is a valid lower bound on the mechanism's δ(ε):
  1. The mechanism dominates (P, Q), so δ_mech(ε) ≥ H_ε(P‖Q) and ≥ H_ε(Q‖P).
  2. z = max_t x_t is post-processing, so H_ε(P'‖Q') ≤ H_ε(P‖Q) (data processing).
  3. Replacing z by the index of the grid interval that holds it is post-processing again, so
     the divergence of the *binned* pmfs (computed exactly, tails included as two end bins) is
     ≤ H_ε(P'‖Q'). One epoch (E = 1): this binned divergence is what we return.
  4. E epochs use independent randomness, so the mechanism's pair is the E-fold product and
     per-epoch max + binning is post-processing of it; the product of binned pairs is their
     PLD composition. We compose with dp_accounting using *optimistic* rounding
     (`pessimistic_estimate=False`: privacy losses are rounded *down*, bins below the mass
     truncation bound are dropped), which can only lower δ, the opposite of the rounding an
     upper bound needs. `self_compose` adds its tail truncation mass τ to the infinity mass
     and FFT wrap-around can move at most τ more, so we subtract 2τ from the δ it returns
     (and ask for ε at δ + 2τ). Only float64 round-off of the FFT (~1e-16) remains.
For E = 1 `max_test_delta_by_quadrature` integrates ∫(p' − e^ε q')₊ dz from the analytic
densities as an independent cross-check of step 3 (it is the limit of the binned value).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from scipy import integrate
from scipy import optimize
from scipy import special

from dpjax.privacy import checks

if TYPE_CHECKING:
  from dp_accounting.pld import privacy_loss_distribution as pld_lib

# Mass left outside the fine grid (lumped into the two end bins, so never lost).
_GRID_TAIL_MASS = 1e-40
# Interior bins of the z grid; the binned divergence converges to the continuous one as the
# bins shrink (relative gap < 1e-5 at this size in tests/privacy/accounting/test_max_test.py).
_NUM_BINS = 40_000
# PLD settings for E > 1 (optimistic rounding; see module docstring, step 4).
_VALUE_DISCRETIZATION = 1e-4
_LOG_MASS_TRUNCATION = math.log(1e-30)
_TAIL_MASS_TRUNCATION = 1e-15


@dataclasses.dataclass(frozen=True)
class MaxOfGaussians:
  """Law of max of independent N(mean_j, σ²) variables, `counts[j]` of each mean.

  F(z) = Π_j Φ((z − mean_j)/σ)^{counts_j}; all evaluations are in log-space.
  """

  means: tuple[float, ...]
  counts: tuple[int, ...]
  sigma: float

  def _standardized(self, z):
    z = np.asarray(z, dtype=np.float64)
    means = np.asarray(self.means, dtype=np.float64)
    return (z[..., None] - means) / self.sigma, np.asarray(self.counts, dtype=np.float64)

  def log_cdf(self, z) -> np.ndarray:
    u, counts = self._standardized(z)
    return np.sum(counts * special.log_ndtr(u), axis=-1)

  def log_sf(self, z) -> np.ndarray:
    """log(1 − F(z)), accurate when 1 − F is tiny (first-order union sum there)."""
    u, counts = self._standardized(z)
    log_cdf = np.sum(counts * special.log_ndtr(u), axis=-1)
    with np.errstate(divide='ignore'):
      direct = np.log(-np.expm1(log_cdf))
      union = special.logsumexp(np.log(counts) + special.log_ndtr(-u), axis=-1)
    # 1 − Π(1 − s_j)^{c_j} = Σ c_j s_j (1 + O(Σ c_j s_j)): exact to 1e-9 relative there.
    return np.where(log_cdf > -1e-9, union, direct)

  def log_pdf(self, z) -> np.ndarray:
    """log F'(z) = log F(z) + log Σ_j c_j φ(u_j)/(σ Φ(u_j)), u_j = (z − mean_j)/σ."""
    u, counts = self._standardized(z)
    log_ndtr = special.log_ndtr(u)
    log_phi = -0.5 * u**2 - 0.5 * math.log(2 * math.pi)
    return (
      np.sum(counts * log_ndtr, axis=-1)
      - math.log(self.sigma)
      + special.logsumexp(np.log(counts) + log_phi - log_ndtr, axis=-1)
    )


def _max_of_gaussians(means_counts, sigma) -> MaxOfGaussians:
  kept = [(m, c) for m, c in means_counts if c > 0]
  return MaxOfGaussians(
    tuple(float(m) for m, _ in kept), tuple(int(c) for _, c in kept), float(sigma)
  )


def balls_and_bins_max_pair(sigma: float, num_steps: int) -> tuple[MaxOfGaussians, MaxOfGaussians]:
  """(P', Q') of Eq. 6 (seed 000): the laws of max_t x_t under P and Q."""
  return (
    _max_of_gaussians([(1.0, 1), (0.0, num_steps - 1)], sigma),
    _max_of_gaussians([(0.0, num_steps)], sigma),
  )


def shuffle_max_pair(sigma: float, num_steps: int) -> tuple[MaxOfGaussians, MaxOfGaussians]:
  """(P', Q') for shuffle (Chua et al. 2024a): one batch has mean 2 vs 1, the rest 0."""
  return (
    _max_of_gaussians([(2.0, 1), (0.0, num_steps - 1)], sigma),
    _max_of_gaussians([(1.0, 1), (0.0, num_steps - 1)], sigma),
  )


# ---------------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------------


def _check_args(sigma, num_steps, num_epochs):
  if not (
    isinstance(sigma, (int, float, np.floating, np.integer)) and math.isfinite(sigma) and sigma > 0
  ):
    raise ValueError(f'sigma (noise multiplier) must be a finite number > 0, got {sigma!r}.')
  for name, value in (('num_steps', num_steps), ('num_epochs', num_epochs)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f'{name} must be an integer >= 1, got {value!r}.')


def _check_epsilon(epsilon):
  if not (
    isinstance(epsilon, (int, float, np.floating, np.integer))
    and math.isfinite(epsilon)
    and epsilon >= 0
  ):
    raise ValueError(f'epsilon must be a finite number >= 0, got {epsilon!r}.')


def _log_diff_exp(log_hi, log_lo):
  """log(e^a − e^b) for a ≥ b, −inf where equal."""
  with np.errstate(divide='ignore', invalid='ignore'):
    out = log_hi + np.log(-np.expm1(log_lo - log_hi))
  return np.where(log_hi > log_lo, out, -np.inf)


def _binned_log_pmf(law: MaxOfGaussians, edges: np.ndarray) -> np.ndarray:
  """Exact log-masses of (−∞, e_0), [e_0, e_1), …, [e_K, ∞) under `law`."""
  log_cdf = law.log_cdf(edges)
  log_sf = law.log_sf(edges)
  # Interior bins: F(b) − F(a) where F(b) < 1/2, else S(a) − S(b) (no cancellation).
  from_cdf = _log_diff_exp(log_cdf[1:], log_cdf[:-1])
  from_sf = _log_diff_exp(log_sf[:-1], log_sf[1:])
  interior = np.where(log_cdf[1:] < math.log(0.5), from_cdf, from_sf)
  return np.concatenate([log_cdf[:1], interior, log_sf[-1:]])


def _grid_edges(p_law: MaxOfGaussians, q_law: MaxOfGaussians, num_bins: int) -> np.ndarray:
  """Uniform edges covering all but _GRID_TAIL_MASS of both laws on each side."""
  sigma = p_law.sigma
  lo_start = min(p_law.means + q_law.means) - 60 * sigma
  hi_start = max(p_law.means + q_law.means) + 60 * sigma
  log_tail = math.log(_GRID_TAIL_MASS)
  lows, highs = [], []
  for law in (p_law, q_law):
    median = optimize.brentq(lambda z: float(law.log_cdf(z)) - math.log(0.5), lo_start, hi_start)
    lows.append(optimize.brentq(lambda z: float(law.log_cdf(z)) - log_tail, lo_start, median))
    highs.append(optimize.brentq(lambda z: float(law.log_sf(z)) - log_tail, median, hi_start))
  return np.linspace(min(lows), max(highs), num_bins + 1)


def binned_max_pair(
  p_law: MaxOfGaussians, q_law: MaxOfGaussians, num_bins: int = _NUM_BINS
) -> tuple[np.ndarray, np.ndarray]:
  """log pmfs (log p_i, log q_i) of the max binned on a fine grid (a post-processing)."""
  edges = _grid_edges(p_law, q_law, num_bins)
  return _binned_log_pmf(p_law, edges), _binned_log_pmf(q_law, edges)


def _hockey_stick(log_upper, log_lower) -> Callable[[Any], np.ndarray]:
  """ε -> Σ_i (u_i − e^ε l_i)₊ = Σ_i u_i (1 − e^{ε − log(u_i/l_i)})₊, for each ε; the losses
  and masses are computed once for the many ε of a root search."""
  keep = log_upper > -np.inf
  log_upper, log_lower = log_upper[keep], log_lower[keep]
  loss = log_upper - log_lower  # +inf where the lower mass underflowed: counted in full
  mass = np.exp(log_upper)

  def delta(epsilons) -> np.ndarray:
    eps = np.atleast_1d(np.asarray(epsilons, dtype=np.float64))
    with np.errstate(invalid='ignore'):
      factor = np.maximum(-np.expm1(eps[:, None] - loss[None, :]), 0.0)
    return factor @ mass

  return delta


def _binned_delta(log_p, log_q) -> Callable[[Any], np.ndarray]:
  """ε -> δ of the binned pair, the worse direction."""
  remove, add = _hockey_stick(log_p, log_q), _hockey_stick(log_q, log_p)
  return lambda epsilons: np.maximum(remove(epsilons), add(epsilons))


def _rounded_down_pmf(log_upper, log_lower, interval):
  """dp_accounting's rounded pmf of the loss, rounded *down* (optimistic) and truncated."""
  infinite = (log_lower == -np.inf) & (log_upper > -np.inf)
  infinity_mass = float(np.sum(np.exp(log_upper[infinite])))
  keep = (log_upper > _LOG_MASS_TRUNCATION) & ~infinite  # dropped mass only lowers δ
  loss = log_upper[keep] - log_lower[keep]
  index = np.floor(loss / interval).astype(np.int64)
  keys, inverse = np.unique(index, return_inverse=True)
  mass = np.bincount(inverse, weights=np.exp(log_upper[keep]))
  return dict(zip(keys.tolist(), mass.tolist())), infinity_mass


def _composed_pld(log_p, log_q, num_epochs) -> pld_lib.PrivacyLossDistribution:
  # Imported here: the max-test laws alone (what Monte Carlo's worker processes import) need
  # no PLD, and dp_accounting's import (scipy.signal) costs ~1.4 s of CPU per process.
  # pylint: disable-next=import-outside-toplevel
  from dp_accounting.pld import privacy_loss_distribution as pld_lib

  # pylint: disable-next=import-outside-toplevel
  from dpjax.privacy.accounting import pld_self_compose

  remove, inf_remove = _rounded_down_pmf(log_p, log_q, _VALUE_DISCRETIZATION)
  add, inf_add = _rounded_down_pmf(log_q, log_p, _VALUE_DISCRETIZATION)
  pld = pld_lib.PrivacyLossDistribution.create_from_rounded_probability(
    remove,
    inf_remove,
    _VALUE_DISCRETIZATION,
    pessimistic_estimate=False,
    rounded_probability_mass_function_add=add,
    infinity_mass_add=inf_add,
    symmetric=False,
  )
  return pld_self_compose.self_compose(pld, num_epochs, tail_mass=_TAIL_MASS_TRUNCATION)


@functools.lru_cache(maxsize=32)
def _cached_binned_pair(pair, sigma: float, num_steps: int):
  """pair: the max-of-Gaussians pair's constructor (balls_and_bins_max_pair, shuffle_max_pair)."""
  log_p, log_q = binned_max_pair(*pair(sigma, num_steps))
  log_p.flags.writeable = log_q.flags.writeable = False
  return log_p, log_q


@functools.lru_cache(maxsize=16)
def _cached_composed_pld(pair, sigma: float, num_steps: int, num_epochs: int):
  return _composed_pld(*_cached_binned_pair(pair, sigma, num_steps), num_epochs)


def _lower_bound_delta(pair, sigma, num_steps, epsilon, num_epochs) -> float:
  _check_args(sigma, num_steps, num_epochs)
  _check_epsilon(epsilon)
  sigma, num_steps, num_epochs = float(sigma), int(num_steps), int(num_epochs)
  if num_epochs == 1:
    log_p, log_q = _cached_binned_pair(pair, sigma, num_steps)
    return float(_binned_delta(log_p, log_q)(epsilon)[0])
  pld = _cached_composed_pld(pair, sigma, num_steps, num_epochs)
  return max(0.0, float(pld.get_delta_for_epsilon(epsilon)) - 2 * _TAIL_MASS_TRUNCATION)


def _lower_bound_epsilon(pair, sigma, num_steps, delta, num_epochs) -> float:
  _check_args(sigma, num_steps, num_epochs)
  checks.check_delta(delta)
  sigma, num_steps, num_epochs = float(sigma), int(num_steps), int(num_epochs)
  if num_epochs > 1:
    pld = _cached_composed_pld(pair, sigma, num_steps, num_epochs)
    return float(pld.get_epsilon_for_delta(delta + 2 * _TAIL_MASS_TRUNCATION))
  log_p, log_q = _cached_binned_pair(pair, sigma, num_steps)
  binned_delta = _binned_delta(log_p, log_q)
  delta_at = lambda eps: float(binned_delta(eps)[0])
  if delta_at(0.0) <= delta:
    return 0.0
  # Root of δ_binned(ε) = δ, then stepped down until δ_binned(lo) > δ: the true δ(lo) ≥
  # δ_binned(lo) > δ, so ε_true > lo.
  finite = np.concatenate([log_p - log_q, log_q - log_p])
  hi = float(np.max(finite[np.isfinite(finite)])) + 1.0
  root = optimize.brentq(lambda eps: delta_at(eps) - delta, 0.0, hi, xtol=1e-13, rtol=1e-13)
  step = 1e-12 * max(1.0, root)
  lo = max(0.0, root - step)
  while lo > 0 and delta_at(lo) <= delta:
    step *= 4
    lo = max(0.0, root - step)
  return lo


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def balls_and_bins_lower_bound_delta(
  sigma: float, num_steps: int, epsilon: float, *, num_epochs: int = 1
) -> float:
  """Lower bound on δ(ε) of balls-and-bins DP-SGD (max test, Eq. 6 of seed 000).

  Args:
    sigma: noise multiplier σ (noise std on the clipped-gradient sum / C).
    num_steps: T, batches (bins) per epoch.
    epsilon: ε ≥ 0.
    num_epochs: E, epochs with independent assignments (PLD composition of the max pair).

  Returns:
    δ_low with δ_mech(ε) ≥ δ_low, deterministic (no sampling), max over add/remove.
  """
  return _lower_bound_delta(balls_and_bins_max_pair, sigma, num_steps, epsilon, num_epochs)


def balls_and_bins_lower_bound_epsilon(
  sigma: float, num_steps: int, delta: float, *, num_epochs: int = 1
) -> float:
  """Lower bound on ε(δ) of balls-and-bins DP-SGD: no valid ε at this δ is smaller."""
  return _lower_bound_epsilon(balls_and_bins_max_pair, sigma, num_steps, delta, num_epochs)


def shuffle_lower_bound_delta(
  sigma: float, num_steps: int, epsilon: float, *, num_epochs: int = 1
) -> float:
  """Lower bound on δ(ε) of shuffled DP-SGD (max test on the Chua et al. 2024a pair).

  E epochs with fresh permutations: E-fold composition of the 1-d pair (still a lower bound).
  Reference: σ = 1, T = 100, E = 1, ε = 1 gives δ ≥ 0.0167 (docs/accounting.md §3).
  """
  return _lower_bound_delta(shuffle_max_pair, sigma, num_steps, epsilon, num_epochs)


def shuffle_lower_bound_epsilon(
  sigma: float, num_steps: int, delta: float, *, num_epochs: int = 1
) -> float:
  """Lower bound on ε(δ) of shuffled DP-SGD: no valid ε at this δ is smaller."""
  return _lower_bound_epsilon(shuffle_max_pair, sigma, num_steps, delta, num_epochs)


def max_test_delta_by_quadrature(
  p_law: MaxOfGaussians, q_law: MaxOfGaussians, epsilon: float
) -> float:
  """One-epoch cross-check: max over directions of ∫ (p'(z) − e^ε q'(z))₊ dz by `quad`.

  The integrand's support is split at the roots of log(p'/q') = ε (bracketed on a fine grid,
  refined by brentq), so quad never integrates across a kink.
  """
  edges = _grid_edges(p_law, q_law, 20_000)
  deltas = []
  for upper, lower in ((p_law, q_law), (q_law, p_law)):
    diff = lambda z, u=upper, l=lower: float(np.exp(u.log_pdf(z)) - np.exp(epsilon + l.log_pdf(z)))
    log_ratio = lambda z, u=upper, l=lower: float(u.log_pdf(z) - l.log_pdf(z)) - epsilon
    sign = upper.log_pdf(edges) - lower.log_pdf(edges) > epsilon
    cuts = [
      optimize.brentq(log_ratio, edges[i], edges[i + 1], xtol=1e-15)
      for i in np.flatnonzero(sign[1:] != sign[:-1])
    ]
    points = np.concatenate([edges[:1], cuts, edges[-1:]])
    total = 0.0
    for a, b in zip(points[:-1], points[1:]):
      mid = 0.5 * (a + b)
      if upper.log_pdf(mid) - lower.log_pdf(mid) > epsilon:
        value, _ = integrate.quad(
          lambda z: max(diff(z), 0.0), a, b, limit=500, epsabs=1e-14, epsrel=1e-10
        )
        total += value
    deltas.append(total)
  return max(deltas)
