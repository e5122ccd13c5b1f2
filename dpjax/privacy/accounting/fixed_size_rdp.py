"""Fixed-size RDP (FS-RDP): DP-SGD with fixed-size batches drawn without replacement.

Birrell, Ebrahimi, Dupuis, Petrovic 2024, "Differentially Private Stochastic
Gradient Descent with Fixed-Size Minibatches: Tighter RDP Guarantees with or
without Replacement" (NeurIPS; seed 001), Theorem 3.1, add/remove adjacency.
For integer orders α ≥ 2 the Taylor remainder of their bound vanishes and the
per-step Rényi divergence bound is the closed form (docs/accounting.md §7)

  ε_step(α) = 1/(α−1) · log Σ_{k=0}^{α} C(α,k) (1−q)^{α−k} q^k exp(2k(k−1)/σ²),

with q = b/N < 1. T steps compose additively, ε_T(α) = T·ε_step(α), and the
conversion to (ε, δ) is the improved one (Canonne, Kamath, Steinke 2020,
Prop. 12; dp_accounting's `rdp_privacy_accountant.compute_epsilon`):

  ε = min_α [ε_T(α) + log((α−1)/α) − (log δ + log α)/(α−1)],  α = 2 … 256.

Only integer orders are used: fractional orders need the paper's Theorem 3.3
remainder term, whose leading term alone is not a bound.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import special

from dpjax.privacy import checks

DEFAULT_ORDERS = tuple(range(2, 257))


def _check(sampling_probability: float, noise_multiplier: float, orders) -> np.ndarray:
  q = sampling_probability
  if not (isinstance(q, (int, float, np.floating)) and 0 < q < 1):
    raise ValueError(f'sampling probability q = b/N must be in (0, 1) for FS-RDP, got {q!r}.')
  checks.check_noise_multiplier(noise_multiplier)
  orders = np.asarray(orders)
  if (
    orders.ndim != 1 or orders.size == 0 or np.any(orders < 2) or np.any(orders != np.round(orders))
  ):
    raise ValueError(f'FS-RDP orders must be integers >= 2, got {orders!r}.')
  return orders.astype(np.int64)


def fixed_size_rdp(
  sampling_probability: float, noise_multiplier: float, orders=DEFAULT_ORDERS
) -> np.ndarray:
  """Per-step FS-RDP ε_step(α) at integer orders (Birrell et al. 2024, Thm 3.1).

  Args:
    sampling_probability: q = b/N, in (0, 1).
    noise_multiplier: σ (noise std on the clipped-gradient sum, in units of C).
    orders: integer Rényi orders α ≥ 2.

  Returns:
    float64 array of ε_step(α), one per order (log-sum-exp, log-binomials).
  """
  orders = _check(sampling_probability, noise_multiplier, orders)
  q = float(sampling_probability)
  log_q, log_1mq = math.log(q), math.log1p(-q)
  out = np.empty(len(orders))
  for i, alpha in enumerate(orders):
    k = np.arange(alpha + 1, dtype=np.float64)
    log_binom = special.gammaln(alpha + 1) - special.gammaln(k + 1) - special.gammaln(alpha - k + 1)
    terms = log_binom + (alpha - k) * log_1mq + k * log_q + 2 * k * (k - 1) / noise_multiplier**2
    out[i] = special.logsumexp(terms) / (alpha - 1)
  return out


def fixed_size_rdp_epsilon(
  sampling_probability: float,
  noise_multiplier: float,
  num_steps: int,
  delta: float,
  orders=DEFAULT_ORDERS,
) -> tuple[float, int]:
  """(ε, optimal order) of T-step fixed-size DP-SGD by FS-RDP, add/remove adjacency.

  Reproduces Birrell et al.'s setting σ = 6, b = 120, N = 50000, 416 steps per
  epoch, δ = 1e-5: 50 epochs → 0.454, 100 → 0.659, 250 → 1.083.
  """
  if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 1:
    raise ValueError(f'num_steps must be an integer >= 1, got {num_steps!r}.')
  checks.check_delta(delta)
  orders = _check(sampling_probability, noise_multiplier, orders)
  rdp = num_steps * fixed_size_rdp(sampling_probability, noise_multiplier, orders)
  eps, order = rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)
  return float(eps), int(order)
