"""Workloads A: the linear map from the noisy gradients ĝ_1..ĝ_n to what training releases.

SGD's iterates are θ_t = θ_0 − η·Σ_{s<=t} ĝ_s, so the error that matters is A(C⁻¹Z) with A the
prefix sums (Denisov, McMahan, Rush, Smith, Thakurta, "Improved differential privacy for SGD via
optimal private linear operators on adaptive streams"). With heavy-ball momentum β and learning
rates η_t, m_t = β·m_{t−1} + ĝ_t and θ_t = θ_{t−1} − η_t·m_t, so

  θ_t − θ_0 = −Σ_{s<=t} A[t, s]·ĝ_s,   A[t, s] = Σ_{u=s}^{t} η_u·β^{u−s}.
"""

from __future__ import annotations

import numpy as np

from dpjax.privacy import checks


def prefix_sums(n: int) -> np.ndarray:
  """The n × n lower-triangular matrix of ones (float64)."""
  return np.tril(np.ones((checks.check_int('n', n, 1),) * 2))


def momentum(n: int, momentum: float = 0.0, learning_rates=None) -> np.ndarray:
  """A[t, s] = Σ_{u=s}^{t} η_u β^{u−s}: SGD with heavy-ball momentum β in [0, 1) and learning
  rates η_0..η_{n−1} (default all 1; β = 0 and η = 1 is `prefix_sums`)."""
  n = checks.check_int('n', n, 1)
  if not (checks.is_number(momentum) and 0.0 <= momentum < 1.0):
    raise ValueError(f'momentum must be a number in [0, 1), got {momentum!r}.')
  beta = float(momentum)
  rates = np.ones(n) if learning_rates is None else np.asarray(learning_rates, dtype=np.float64)
  if rates.shape != (n,) or not np.all(np.isfinite(rates)):
    raise ValueError(f'learning_rates must be {n} finite numbers, got shape {rates.shape}.')
  lags = np.subtract.outer(np.arange(n), np.arange(n))
  decay = np.where(lags >= 0, beta ** np.maximum(lags, 0), 0.0)
  return np.cumsum(rates[:, None] * decay, axis=0)
