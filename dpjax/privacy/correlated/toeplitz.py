"""Lower-triangular Toeplitz strategies C of the matrix mechanism, from their coefficients.

  C[i, j] = c_{i−j} for 0 <= i − j < b, else 0      (c_0 > 0; b = len(coefs), the bands)

The mechanism releases X + C⁻¹Z (Denisov, McMahan, Rush, Smith, Thakurta, "Improved
differential privacy for SGD via optimal private linear operators on adaptive streams"): the
noise C⁻¹Z is generated as a stream by

  w_t = (z_t − Σ_{j=1}^{b−1} c_j w_{t−j}) / c_0,

whose state is the last b − 1 w's (`inverse_apply` is its NumPy reference). C⁻¹ is lower-
triangular Toeplitz too (not banded): its coefficients are `inverse_coefs`. Everything is
float64 NumPy; a matrix of n steps is n × n.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
import scipy.signal

from dpjax.privacy import checks


def check_coefs(coefs, name: str = 'coefs') -> np.ndarray:
  """`coefs` as a float64 1-d array of finite numbers with c_0 > 0; else ValueError."""
  c = np.asarray(coefs, dtype=np.float64)
  if c.ndim != 1 or c.size == 0 or not np.all(np.isfinite(c)) or not c[0] > 0:
    raise ValueError(
      f'{name} must be a non-empty 1-d array of finite numbers with {name}[0] > 0 (C invertible), '
      f'got {coefs!r}.'
    )
  return c


def padded(coefs, n: int) -> np.ndarray:
  """c_0..c_{n−1}: the coefficients cut or zero-padded to n (the first column of the n × n C)."""
  c = check_coefs(coefs)
  n = checks.check_int('n', n, 1)
  return np.pad(c[:n], (0, max(0, n - c.size)))


def dense(coefs, n: int) -> np.ndarray:
  """The n × n lower-triangular Toeplitz C with first column c_0..c_{b−1}, 0, ... (float64)."""
  column = padded(coefs, n)
  return scipy.linalg.toeplitz(column, np.zeros(n))


def inverse_apply(coefs, z) -> np.ndarray:
  """C⁻¹z for z of shape (n,) or (n, d), by the streaming recursion (the privatizer's reference).

  w_t = (z_t − Σ_{j=1}^{b−1} c_j w_{t−j}) / c_0: row t reads only z_t and the b − 1 previous
  outputs, the state a streaming privatizer keeps ((b − 1) × d numbers).
  """
  c = check_coefs(coefs)
  z = np.asarray(z, dtype=np.float64)
  if z.ndim not in (1, 2) or z.shape[0] == 0:
    raise ValueError(f'z must have shape (n,) or (n, d) with n >= 1, got shape {z.shape}.')
  w = np.empty_like(z)
  for t in range(z.shape[0]):
    history = w[max(0, t - c.size + 1) : t][::-1]  # w_{t−1}, w_{t−2}, ... (at most b − 1).
    w[t] = (z[t] - np.tensordot(c[1 : 1 + len(history)], history, axes=1)) / c[0]
  return w


def solve(coefs, z, axis: int = 0) -> np.ndarray:
  """C⁻¹z along `axis` with scipy.signal.lfilter (C's recursion as an IIR filter: c * w = z)."""
  return scipy.signal.lfilter([1.0], check_coefs(coefs), np.asarray(z, np.float64), axis=axis)


def inverse_coefs(coefs, n: int) -> np.ndarray:
  """r_0..r_{n−1}, the first column of C⁻¹ (C⁻¹ is lower-triangular Toeplitz: Σ_j c_j r_{t−j} =
  [t = 0])."""
  e0 = np.zeros(checks.check_int('n', n, 1))
  e0[0] = 1.0
  return solve(coefs, e0)


def column_norms(coefs, n: int) -> np.ndarray:
  """‖C[:, j]‖ for j < n: column j holds c_0..c_{min(b, n−j)−1}, so the norms do not increase."""
  squares = padded(coefs, n) ** 2
  return np.sqrt(np.cumsum(squares)[::-1])
