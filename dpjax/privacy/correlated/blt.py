"""BLT: buffered linear Toeplitz strategies C, their streaming noise and their optimisation.

Dvijotham, McMahan, Pillutla, Steinke, Thakurta, "Efficient and near-optimal noise generation
for streaming differential privacy" (2024). Here the BLT parameters describe the strategy C
itself (as jax_privacy's `BufferedToeplitz` does; its docstring and `toeplitz_coefs` say so):
buffer decays θ_i ∈ (0, 1) and output weights ω_i >= 0, i < d, give the lower-triangular
Toeplitz C with

  c_0 = 1,   c_t = Σ_i ω_i θ_i^(t−1)  (t >= 1),   c(x) = 1 + Σ_i ω_i x / (1 − θ_i x).

The noise C⁻¹z needs no separate parameters for C⁻¹ (which is a BLT too, the paper's Lemma 5.2):
C w = z reads w_t = z_t − Σ_i ω_i s_{i,t} with the buffers s_{i,t} = Σ_{u<t} θ_i^(t−1−u) w_u,
updated by s_i ← θ_i·s_i + w_t, so the state is d vectors of the parameters' size
(`inverse_apply`). ω >= 0 and θ in (0, 1) make c_t >= 0 and non-increasing for t >= 1, so
CᵀC >= 0 and, when c_1 <= 1, the min-separation sensitivity is exact
(`sensitivity.toeplitz_min_separation`).

The optimiser minimises log(Δ²·‖A C⁻¹‖_F²) over θ = 1 − e^u and ω >= 0 with L-BFGS-B and the
analytic gradient (as `bandmf`, with all n coefficients of C), for single participation or
k participations with the worst pattern {0, min_sep, ...} of monotone coefficients.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import scipy.optimize
import scipy.signal

from dpjax.privacy import checks
from dpjax.privacy.correlated import bandmf
from dpjax.privacy.correlated import expected_error
from dpjax.privacy.correlated import sensitivity
from dpjax.privacy.correlated import toeplitz

UNSTABLE = 1e4  # The log-objective returned where C⁻¹'s coefficients overflow.


class BLT(NamedTuple):
  """C with c_0 = 1, c_t = Σ_i weights_i·decays_i^(t−1): d = len(decays) buffers."""

  decays: np.ndarray
  weights: np.ndarray


def check_blt(decays, weights) -> BLT:
  """θ in (0, 1) and ω >= 0, finite, of one length d >= 1; else ValueError."""
  theta = np.asarray(decays, dtype=np.float64)
  omega = np.asarray(weights, dtype=np.float64)
  if (
    theta.ndim != 1
    or theta.shape != omega.shape
    or theta.size == 0
    or not np.all((theta > 0) & (theta < 1))
    or not np.all(np.isfinite(omega) & (omega >= 0))
  ):
    raise ValueError(
      'decays must be numbers in (0, 1) and weights finite numbers >= 0, one of each per buffer, '
      f'got decays={decays!r}, weights={weights!r}.'
    )
  return BLT(theta, omega)


def coefs(blt: BLT, n: int) -> np.ndarray:
  """c_0..c_{n−1} of C (the dense Toeplitz matrix is `toeplitz.dense(coefs(blt, n), n)`)."""
  theta, omega = check_blt(*blt)
  n = checks.check_int('n', n, 1)
  powers = theta[None, :] ** np.arange(n - 1)[:, None]
  return np.concatenate([[1.0], powers @ omega])


def inverse_apply(blt: BLT, z) -> np.ndarray:
  """C⁻¹z for z of shape (n,) or (n, dim) with d buffer vectors as the only state (streaming)."""
  theta, omega = check_blt(*blt)
  z = np.asarray(z, dtype=np.float64)
  if z.ndim not in (1, 2) or z.shape[0] == 0:
    raise ValueError(f'z must have shape (n,) or (n, dim) with n >= 1, got shape {z.shape}.')
  buffers = np.zeros((theta.size,) + z.shape[1:])
  w = np.empty_like(z)
  for t in range(z.shape[0]):
    w[t] = z[t] - np.tensordot(omega, buffers, axes=1)
    buffers = theta.reshape((-1,) + (1,) * (z.ndim - 1)) * buffers + w[t]
  return w


def pattern_sum_and_grad(c: np.ndarray, starts: np.ndarray) -> tuple[float, np.ndarray]:
  """‖C·1_π‖² = 1_πᵀCᵀC1_π for the Toeplitz C of c (length n) and its gradient in c.

  y = C·1_π = (c ∗ 1_π)[:n], so ∂‖y‖²/∂c_j = 2·Σ_{s∈π, s+j<n} y_{s+j}."""
  n = c.size
  indicator = np.zeros(n)
  indicator[starts] = 1.0
  y = scipy.signal.convolve(c, indicator)[:n]
  grad = np.zeros(n)
  for s in starts:
    grad[: n - s] += 2.0 * y[s:]
  return float(y @ y), grad


def rational(blt: BLT) -> tuple[np.ndarray, np.ndarray]:
  """(P, Q) with c(x) = P(x)/Q(x): Q = Π_i (1 − θ_i x), P = Q + x·Σ_i ω_i Π_{j≠i} (1 − θ_j x)
  (coefficients in increasing powers), so C⁻¹z = lfilter(Q, P, z) in O(n·d)."""
  theta, omega = check_blt(*blt)
  q = np.poly(theta)
  p = q.copy()
  for i in range(theta.size):
    p[1:] += omega[i] * np.poly(np.delete(theta, i))
  return p, q


def loss_and_grad(
  c: np.ndarray, q: np.ndarray, starts: np.ndarray, inverse=None
) -> tuple[float, np.ndarray]:
  """f(c) = ‖C·1_π‖²·rᵀQr over all n coefficients c and its gradient (see `bandmf`); `inverse`
  applies C⁻¹ to a vector (default: `toeplitz.solve` on c, O(n²))."""
  n = c.size
  inverse = inverse or (lambda x: toeplitz.solve(c, x))
  e0 = np.zeros(n)
  e0[0] = 1.0
  r = inverse(e0)
  qr = q @ r
  error = float(r @ qr)
  v = inverse(2.0 * qr[::-1])[::-1]
  d_error = -scipy.signal.correlate(v, r, mode='full')[n - 1 :]  # −Σ_t v_t r_{t−j}.
  sens2, d_sens2 = pattern_sum_and_grad(c, starts)
  return sens2 * error, d_sens2 * error + sens2 * d_error


def _params_to_blt(x: np.ndarray) -> BLT:
  d = x.size // 2
  return BLT(-np.expm1(x[:d]), x[d:])


def initial_blt(n: int, buffers: int) -> BLT:
  """Decays 1 − n^(−(i+1)/(d+1)) (time scales spread from 1 to n), weights fitted by
  non-negative least squares to the coefficients 1/2, 3/8, ... of A^(1/2)."""
  theta = 1.0 - float(n) ** (-np.arange(1, buffers + 1) / (buffers + 1))
  target = bandmf.prefix_sqrt_coefs(n)[1:]
  powers = theta[None, :] ** np.arange(n - 1)[:, None]
  omega = scipy.optimize.nnls(powers, target)[0] if n > 1 else np.full(buffers, 0.5)
  return BLT(theta, np.maximum(omega, 1e-3))


def _objective(n: int, q: np.ndarray, starts: np.ndarray):
  """x = (log(1 − θ), ω) ↦ (log f, ∇ log f), f = ‖C·1_π‖²·rᵀQr (UNSTABLE where C⁻¹ overflows)."""

  def fun(x):
    blt = _params_to_blt(x)
    with np.errstate(over='ignore', invalid='ignore', divide='ignore'):
      p, q_poly = rational(blt)
      value, grad_c = loss_and_grad(
        coefs(blt, n), q, starts, lambda z: scipy.signal.lfilter(q_poly, p, z)
      )
      powers = blt.decays[None, :] ** np.arange(n - 1)[:, None]
      lags = np.arange(n - 1)[:, None]
      d_theta = grad_c[1:] @ (blt.weights * lags * blt.decays ** np.maximum(lags - 1, 0))
      d_omega = grad_c[1:] @ powers
      grad = np.concatenate([d_theta * (blt.decays - 1.0), d_omega])
    if not (np.isfinite(value) and value > 0 and np.all(np.isfinite(grad))):
      return UNSTABLE, np.zeros_like(x)
    return np.log(value), grad / value

  return fun


def _minimize(fun, start: BLT, max_iterations: int) -> tuple[BLT, float]:
  """L-BFGS-B from `start` within θ in [0.001, 1 − 1e-9], ω in [0, 1000]: (BLT, log f)."""
  d = start.decays.size
  x0 = np.concatenate([np.log1p(-start.decays), start.weights])
  bounds = [(np.log(1e-9), np.log(0.999))] * d + [(0.0, 1e3)] * d
  result = scipy.optimize.minimize(
    fun, x0, jac=True, method='L-BFGS-B', bounds=bounds, options={'maxiter': max_iterations}
  )
  return _params_to_blt(result.x), float(result.fun)


def _grown(blt: BLT) -> list[BLT]:
  """blt with one more buffer of weight 0 (the same C, so a start no worse than the smaller
  optimum): decaying faster than all (half the smallest decay), or splitting the widest gap of
  log(1 − θ) between the decays."""
  logs = np.sort(np.log1p(-blt.decays))
  news = [blt.decays.min() / 2]
  if logs.size > 1:
    gap = int(np.argmax(np.diff(logs)))
    news.append(-np.expm1(logs[gap : gap + 2].mean()))
  return [BLT(np.append(blt.decays, t), np.append(blt.weights, 0.0)) for t in news]


def optimize(
  n: int,
  buffers: int,
  workload=None,
  participations: int = 1,
  min_sep: int | None = None,
  max_iterations: int = 500,
) -> BLT:
  """The d-buffer BLT minimising Δ²·‖A C⁻¹‖_F² for n steps (workload default prefix sums),
  Δ for k participations at least `min_sep` apart (k = 1: single participation).

  The result has c_0 = 1; its sensitivity (`sensitivity_of`) scales the noise: the strategy
  at sensitivity 1 is C/Δ.
  """
  n = checks.check_int('n', n, 2)
  d = checks.check_int('buffers', buffers, 1)
  k, sep = sensitivity.check_pattern(n, participations, min_sep)
  checks.check_int('max_iterations', max_iterations, 1)
  q = (
    expected_error.lag_gram(None, n)
    if workload is None
    else expected_error.lag_gram(expected_error.check_workload(workload, n))
  )
  starts = np.arange(0, n, sep)[:k]
  fun = _objective(n, q, starts)
  # Buffers added one at a time from the smaller optimum (never worse than it), and a fresh
  # start at d buffers: the objective has local minima (a buffer of weight ~0).
  best, _ = _minimize(fun, initial_blt(n, 1), max_iterations)
  for size in range(2, d + 1):
    candidates = [_minimize(fun, start, max_iterations) for start in _grown(best)]
    if size == d:
      candidates.append(_minimize(fun, initial_blt(n, d), max_iterations))
    best, _ = min(candidates, key=lambda pair: pair[1])
  return best


def sensitivity_of(
  blt: BLT, n: int, participations: int = 1, min_sep: int | None = None
) -> sensitivity.Sensitivity:
  """Δ of the n × n C for k participations at least min_sep apart (exact when c is monotone)."""
  k, sep = sensitivity.check_pattern(n, participations, min_sep)
  return sensitivity.toeplitz_min_separation(coefs(blt, n), n, k, sep)
