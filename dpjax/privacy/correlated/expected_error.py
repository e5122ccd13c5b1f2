"""The expected squared error of the released iterates, to compare strategies before training.

With the strategy normalised to sensitivity 1 (C/Δ) and noise multiplier σ, the workload's
output carries the noise A(C/Δ)⁻¹Z, whose mean squared error per coordinate is

  E = σ²·Δ²·‖A C⁻¹‖_F² / n

(docs/accounting.md §9; Choquette-Choo, McMahan, Rush, Thakurta, "Multi-epoch matrix
factorization mechanisms for private machine learning"). DP-SGD is C = I, whose Δ² is the
number of participations. For a lower-triangular Toeplitz C⁻¹ = Σ_k r_k S^k (S the shift)

  ‖A C⁻¹‖_F² = rᵀ Q r,   Q[k, l] = tr((S^k)ᵀ AᵀA S^l) = Σ_b (AᵀA)[b + k, b + l],

so once Q is built (`lag_gram`, O(n²) after AᵀA) a Toeplitz strategy's error costs one
solve for r and one n × n product: what the optimisers of `bandmf` and `blt` evaluate.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg

from dpjax.privacy import checks
from dpjax.privacy.correlated import toeplitz
from dpjax.privacy.correlated import workloads


def check_workload(workload, n: int) -> np.ndarray:
  """The n × n workload as float64 (None: prefix sums); else ValueError."""
  if workload is None:
    return workloads.prefix_sums(n)
  a = np.asarray(workload, dtype=np.float64)
  if a.shape != (n, n) or not np.all(np.isfinite(a)):
    raise ValueError(f'workload must be a finite {n} x {n} matrix, got shape {a.shape}.')
  return a


def expected_error(
  strategy, sensitivity: float, workload=None, noise_multiplier: float = 1.0
) -> float:
  """σ²·Δ²·‖A C⁻¹‖_F²/n for a lower-triangular C (dense float64, C⁻¹ by a triangular solve)."""
  c = np.asarray(strategy, dtype=np.float64)
  n = c.shape[0]
  a = check_workload(workload, n)
  delta = checks.check_number('sensitivity', sensitivity, low=0.0)
  sigma = checks.check_noise_multiplier(noise_multiplier)
  # A C⁻¹ = (C⁻ᵀ Aᵀ)ᵀ.
  b = scipy.linalg.solve_triangular(c, a.T, lower=True, trans='T')
  return float(sigma**2 * delta**2 * np.sum(b**2) / n)


def dp_sgd_expected_error(
  n: int, participations: int = 1, workload=None, noise_multiplier: float = 1.0
) -> float:
  """DP-SGD's E: C = I, Δ² = k participations, so σ²·k·‖A‖_F²/n."""
  k = checks.check_int('participations', participations, 1)
  return expected_error(np.eye(checks.check_int('n', n, 1)), k**0.5, workload, noise_multiplier)


def lag_gram(workload=None, n: int | None = None) -> np.ndarray:
  """Q[k, l] = Σ_b W[b + k, b + l] with W = AᵀA (so ‖A C⁻¹‖_F² = rᵀQr for Toeplitz C⁻¹).

  Prefix sums (workload None, n given) use W[i, j] = n − max(i, j) without forming A."""
  if workload is None:
    n = checks.check_int('n', n, 1)
    idx = np.arange(n)
    w = (n - np.maximum.outer(idx, idx)).astype(np.float64)
  else:
    a = np.asarray(workload, dtype=np.float64)
    w = check_workload(a, a.shape[0]).T @ a
  size = w.shape[0]
  q = np.empty_like(w)
  for lag in range(size):
    # Q[k, k + lag] = Σ_{j >= k} W[j, j + lag]: a suffix sum along W's lag-th superdiagonal.
    suffix = np.cumsum(np.diagonal(w, lag)[::-1])[::-1]
    q[np.arange(size - lag), np.arange(lag, size)] = suffix
    q[np.arange(lag, size), np.arange(size - lag)] = suffix
  return q


def toeplitz_expected_error(
  coefs, n: int, sensitivity: float, workload=None, noise_multiplier: float = 1.0
) -> float:
  """expected_error of the n × n Toeplitz C of `coefs`, as σ²Δ²·rᵀQr/n (no dense inverse)."""
  delta = checks.check_number('sensitivity', sensitivity, low=0.0)
  sigma = checks.check_noise_multiplier(noise_multiplier)
  r = toeplitz.inverse_coefs(coefs, n)
  q = lag_gram(workload, n) if workload is None else lag_gram(check_workload(workload, n))
  return float(sigma**2 * delta**2 * (r @ q @ r) / n)
