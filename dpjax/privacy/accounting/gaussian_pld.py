"""The PLD of the (Poisson-subsampled) Gaussian mechanism: dp_accounting's construction, its
per-point inverse in numpy.

`privacy_loss_distribution.from_gaussian_mechanism` (dp_accounting; connect-the-dots of Doroshenko,
Ghazi, Kamath, Kumar, Manurangsi 2022, "Connect the Dots: Tighter Discrete Approximations of
Privacy Loss Distributions") evaluates the hockey-stick divergence δ(ε) at every grid point
ε_i = i·Δ between its tail bounds, and turns those δ's into a pessimistic PMF. With sampling
rate q, sensitivity s and noise σ, δ(ε) = μ_upper_cdf(x) − e^ε μ_lower_cdf(x) at the cutoff

  x(ε) = −s/2 − L(ε)·σ²/s            (REMOVE),   L(ε) = log(1 + (e^ε − 1)/q),
  x(ε) = s/2 + L(−ε)·σ²/s, sign-flipped L for ADD: x = s + (−s/2 − (−L_add)·σ²/s),

dp_accounting computes x(ε) point by point in Python (one `log_a_times_exp_b_plus_c` and its
`_log_sub` a point: ~25 µs, 6·10⁴ points at q = 0.01, σ = 1, Δ = 1e-4); on the test suite this
was ~30 s of CPU (profile, Nov 27). `gaussian_pld` computes the same x's with the same numpy
operations on arrays, then calls dp_accounting's own CDFs and PMF construction: the result is
dp_accounting's bit for bit (tests/privacy/accounting/test_gaussian_pld.py, on a grid of σ, q, s
and Δ, both directions). Only the add-or-remove relation and pessimistic connect-the-dots (what
dpjax accounts with) are built here.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as mechanism

ADD = mechanism.AdjacencyType.ADD
REMOVE = mechanism.AdjacencyType.REMOVE


def is_close(a: np.ndarray, b: float) -> np.ndarray:
  """`math.isclose(a, b)` elementwise (relative tolerance 1e-9, no absolute tolerance)."""
  return np.abs(a - b) <= 1e-9 * np.maximum(np.abs(a), abs(b))


def unsubsampled_loss(q: float, losses: np.ndarray) -> np.ndarray:
  """log(1 + (e^ℓ − 1)/q) = log(a·e^ℓ + c) with a = 1/q, c = 1 − 1/q < 0, as dp_accounting's
  `common.log_a_times_exp_b_plus_c` evaluates it (its `_log_sub` branch; ℓ = 0 gives log(a + c));
  defined where a·e^ℓ + c > 0, which the callers' masks ensure."""
  a = 1 / q
  c = 1 - 1 / q
  d = losses + np.log(a)
  log_minus_c = np.log(-c)
  with np.errstate(invalid='ignore', divide='ignore'):
    out = d + np.log1p(-np.exp(log_minus_c - d))
  return np.where(losses == 0, np.log(a + c), out)


def cutoffs(loss: mechanism.GaussianPrivacyLoss, epsilons: np.ndarray) -> np.ndarray:
  """The largest x whose privacy loss is ≥ ε, for each ε (dp_accounting's
  `inverse_privacy_loss`, ADD or REMOVE), for ε inside the direction's range."""
  q, s = loss.sampling_prob, loss.sensitivity
  variance = loss.standard_deviation**2
  if loss.adjacency_type == REMOVE:
    if q == 1.0:
      return -0.5 * s - epsilons * variance / s
    plain = unsubsampled_loss(q, epsilons)
    edge = is_close(epsilons, math.log(1 - q))
    return np.where(edge, math.inf, -0.5 * s - plain * variance / s)
  if q == 1.0:
    return s + (-0.5 * s - epsilons * variance / s)
  plain = -unsubsampled_loss(q, -epsilons)
  edge = is_close(epsilons, -math.log(1 - q))
  return np.where(edge, -math.inf, s + (-0.5 * s - plain * variance / s))


def deltas_for_epsilons(loss: mechanism.GaussianPrivacyLoss, epsilons: np.ndarray) -> np.ndarray:
  """δ(ε) of one direction at each ε: `loss.get_delta_for_epsilon(epsilons)` with the cutoffs
  computed as arrays."""
  q = loss.sampling_prob
  deltas = np.zeros_like(epsilons, dtype=float)
  if q == 1.0:
    inside = np.full_like(epsilons, True, dtype=bool)
  elif loss.adjacency_type == ADD:
    inside = epsilons < -math.log1p(-q)  # δ = 0 beyond: e^ε μ_lower ≥ μ_upper everywhere.
  else:
    inside = epsilons > math.log1p(-q)
    deltas[~inside] = -np.expm1(epsilons[~inside])
  x = cutoffs(loss, epsilons[inside])
  deltas[inside] = loss.mu_upper_cdf(x) - np.exp(epsilons[inside] + loss.mu_lower_log_cdf(x))
  return np.clip(deltas, 0, 1)


def direction_pmf(loss: mechanism.GaussianPrivacyLoss, interval: float) -> pld_pmf.PLDPmf:
  """One direction's pessimistic connect-the-dots PMF on the grid `interval`·ℤ."""
  bounds = loss.connect_dots_bounds()
  upper = math.ceil(bounds.epsilon_upper / interval)
  lower = math.floor(bounds.epsilon_lower / interval)
  epsilons = np.arange(lower, upper + 1) * interval
  return pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(
    interval, lower, upper, deltas_for_epsilons(loss, epsilons)
  )


def gaussian_pld(
  standard_deviation: float,
  value_discretization_interval: float,
  sensitivity: float = 1.0,
  sampling_prob: float = 1.0,
) -> pld_lib.PrivacyLossDistribution:
  """`pld_lib.from_gaussian_mechanism(standard_deviation, sensitivity=sensitivity,
  value_discretization_interval=…, sampling_prob=…)` (pessimistic, connect-the-dots, add or
  remove one), bit for bit: symmetric when q = 1, else (REMOVE, ADD)."""

  def pmf(adjacency: mechanism.AdjacencyType) -> pld_pmf.PLDPmf:
    loss = mechanism.GaussianPrivacyLoss(
      standard_deviation,
      sensitivity=sensitivity,
      sampling_prob=sampling_prob,
      adjacency_type=adjacency,
    )
    return direction_pmf(loss, value_discretization_interval)

  if sampling_prob == 1.0:
    return pld_lib.PrivacyLossDistribution(pmf(REMOVE))
  return pld_lib.PrivacyLossDistribution(pmf(REMOVE), pmf(ADD))
