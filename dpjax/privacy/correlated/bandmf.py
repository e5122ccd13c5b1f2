"""BandMF: a b-banded lower-triangular Toeplitz strategy with coefficients optimised for n steps.

Choquette-Choo, Ganesh, McMahan, Rush, Thakurta, Xu, "(Amplified) banded matrix factorization:
a unified approach to private training" (NeurIPS 2023); McKenna, "Scaling up the amplified
banded matrix factorization mechanism for differentially private ML" (2024; the Toeplitz form).
The coefficients c_0..c_{b−1} minimise the expected error at sensitivity 1,

  f(c) = Δ(c)²·‖A C⁻¹‖_F²   (scale-free: f(αc) = f(c), so c_0 = 1 while optimising),

with scipy's L-BFGS-B and the analytic gradient below; the result is divided by Δ(c).

Sensitivity: each participation's column, C[:, t], holds c_0..c_{min(b, n−t)−1}; for k
participations at least `min_sep` >= b apart the columns' supports are disjoint and the worst
pattern is {0, min_sep, 2·min_sep, ...} (column norms do not increase with t), so
Δ² = Σ_i ‖C[:, i·min_sep]‖², exactly (`sensitivity.min_separation`). A smaller min_sep adds
cross terms this objective does not see, and is refused.

Gradient: ‖A C⁻¹‖_F² = rᵀQr with r = C⁻¹e_0 (`expected_error.lag_gram`); C r = e_0 gives
dr = −C⁻¹(dC)r, so ∂/∂c_j = −vᵀ S^j r with v = C⁻ᵀ(2Qr), O(n·b) after the n × n product.
"""

from __future__ import annotations

import numpy as np
import scipy.optimize

from dpjax.privacy import checks
from dpjax.privacy.correlated import expected_error
from dpjax.privacy.correlated import sensitivity
from dpjax.privacy.correlated import toeplitz

UNSTABLE = 1e4  # The log-objective returned where C⁻¹'s coefficients overflow.


def prefix_sqrt_coefs(count: int) -> np.ndarray:
  """The first `count` coefficients of (1 − x)^(−1/2): 1, 1/2, 3/8, 5/16, ... (= C(2k, k)/4^k),
  the Toeplitz square root of the prefix sums (A = C·C)."""
  k = np.arange(1, checks.check_int('count', count, 1))
  return np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))])  # a_k = a_{k−1}·(2k−1)/2k.


def sensitivity_weights(n: int, bands: int, participations: int, min_sep: int) -> np.ndarray:
  """w_j = #{i : j < n − i·min_sep, i < k}: Δ² = Σ_j w_j c_j² for k participations min_sep >= b
  apart (the columns 0, min_sep, ... of the worst pattern each hold c_0..c_{n−i·min_sep−1})."""
  starts = np.arange(0, n, min_sep)[:participations]
  return np.array([np.sum(j < n - starts) for j in range(bands)], dtype=np.float64)


def loss_and_grad(coefs, q: np.ndarray, weights: np.ndarray) -> tuple[float, np.ndarray]:
  """f(c) = (Σ_j w_j c_j²)·rᵀQr and its gradient in c (length b), for Q = lag_gram(A)."""
  c = toeplitz.check_coefs(coefs)
  n = q.shape[0]
  r = toeplitz.inverse_coefs(c, n)
  qr = q @ r
  error = float(r @ qr)
  v = toeplitz.solve(c, 2.0 * qr[::-1])[::-1]  # C⁻ᵀg = J C⁻¹ J g (J reverses: C is Toeplitz).
  d_error = np.array([-(v[j:] @ r[: n - j]) for j in range(c.size)])
  sens2 = float(weights @ c**2)
  return sens2 * error, 2.0 * weights * c * error + sens2 * d_error


def optimize(
  n: int,
  bands: int,
  workload=None,
  participations: int = 1,
  min_sep: int | None = None,
  max_iterations: int = 500,
) -> np.ndarray:
  """Coefficients c_0..c_{b−1} (c_0 > 0) of the b-banded Toeplitz strategy minimising
  Δ²·‖A C⁻¹‖_F² for n steps, scaled to Δ = 1 for k participations at least `min_sep` >= b apart
  (k = 1: single participation, any min_sep).

  workload: the n × n A (`workloads`), default prefix sums. b = 1 is DP-SGD (C = I).
  """
  n = checks.check_int('n', n, 1)
  bands = checks.check_int('bands', bands, 1, n)
  k, sep = sensitivity.check_pattern(n, participations, min_sep)
  if k > 1 and sep < bands:
    raise ValueError(
      f'min_sep must be >= bands = {bands} for {k} participations (disjoint columns), got {sep}; '
      'use sensitivity.min_separation for the sensitivity of such a strategy.'
    )
  checks.check_int('max_iterations', max_iterations, 1)
  q = (
    expected_error.lag_gram(None, n)
    if workload is None
    else expected_error.lag_gram(expected_error.check_workload(workload, n))
  )
  weights = sensitivity_weights(n, bands, k, sep)

  def fun(x):
    with np.errstate(over='ignore', invalid='ignore'):
      value, grad = loss_and_grad(np.concatenate([[1.0], x]), q, weights)
    if not (np.isfinite(value) and np.all(np.isfinite(grad))):
      # C⁻¹ blew up (a root of c(x) inside the unit disk): a finite value far above any log f
      # (< 710) makes the line search step back; inf or NaN would end the search there.
      return UNSTABLE, np.zeros_like(x)
    return np.log(value), grad[1:] / value  # log f: the same minimiser, steps of sane size.

  x = prefix_sqrt_coefs(bands)[1:]
  if bands > 1:
    x = scipy.optimize.minimize(
      fun, x, jac=True, method='L-BFGS-B', options={'maxiter': max_iterations}
    ).x
  coefs = np.concatenate([[1.0], x])
  return coefs / np.sqrt(weights @ coefs**2)
