"""Per-step white-box Gaussian audit: the effective σ from the released noisy sums.

With access to every step's released noisy sum s_t (before the division by b),
and knowing the sum c_t of the ordinary rows' clipped gradients, project on the
orthonormal canary directions u_j (`canaries`):

  z_{t,j} = ⟨s_t − c_t, u_j⟩ / C = a · n_{t,j} + ξ_{t,j},

where n_{t,j} is the number of times member canary j was in step t's batch
(0 for non-members), a = 1 for correct code (a canary adds exactly C·u_j) and
ξ_{t,j} ~ N(0, σ²) independent (isotropic noise on orthonormal directions).
Two estimates with exact sampling distributions:

* noise: σ̂² = mean of z² over the (t, j) with n_{t,j} = 0; n σ̂²/σ² ~ χ²_n;
* signal: â = Σ n·z / Σ n² ~ N(a, σ²/Σ n²).

The effective noise multiplier is σ_eff = σ̂ / â (noise per unit of one
example's contribution). Its interval at confidence 1 − α combines a χ²
interval for σ̂ and a normal interval for â, each at level α/4 per side
(Bonferroni). A run whose configured σ lies outside the interval is flagged.
Each step is also tested alone (χ²_{m_t} of its noise rows, two-sided, at
level α/(2T)), which catches noise skipped on some steps; so correct code is
flagged with probability ≤ α (≤ 1e-3 at the default confidence).

This is a consistency check of the implementation, not a privacy bound: it
uses the coins and the actual batches, which no privacy adversary sees.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import stats

from dpjax.privacy import checks

DEFAULT_CONFIDENCE = 0.999


@dataclasses.dataclass(frozen=True)
class EffectiveSigma:
  noise_multiplier: float  # σ configured (what the accountant used)
  sigma_hat: float  # noise std per coordinate / C
  signal: float  # â: one canary's measured contribution / C (1 for correct code)
  effective: float  # σ̂ / â
  interval: tuple[float, float]  # for σ_eff at `confidence`
  flagged_steps: tuple[int, ...]  # steps whose own noise fails the χ² test
  confidence: float
  flagged: bool

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d['interval'] = list(self.interval)
    d['flagged_steps'] = list(self.flagged_steps)
    return d


def effective_sigma(
  released: np.ndarray,
  ordinary: np.ndarray,
  counts: np.ndarray,
  membership: np.ndarray,
  *,
  clip_norm: float,
  noise_multiplier: float,
  confidence: float = DEFAULT_CONFIDENCE,
) -> EffectiveSigma:
  """The white-box test of one run.

  Args:
    released: [T, m] ⟨s_t, u_j⟩, the released noisy sums projected on the canaries.
    ordinary: [T, m] ⟨c_t, u_j⟩, the ordinary rows' clipped sum, computed by the auditor.
    counts: [T, m] times canary j's row was in step t's batch (whatever its coin).
    membership: bool [m], the coins.
    clip_norm: C; noise_multiplier: σ > 0, both as configured.
    confidence: 1 − α.
  """
  checks.check_noise_multiplier(noise_multiplier)
  alpha = 1.0 - confidence
  if not 0 < alpha < 1:
    raise ValueError(f'confidence must be in (0, 1), got {confidence}.')
  z = (np.asarray(released, np.float64) - np.asarray(ordinary, np.float64)) / clip_norm
  n = np.asarray(counts, np.float64) * np.asarray(membership, bool)[None, :]
  noise_rows = n == 0
  dof = int(noise_rows.sum())
  if dof == 0 or not np.any(n > 0):
    raise ValueError('the white-box test needs steps with and without member canaries.')
  sigma_hat = math.sqrt(float(np.sum(z[noise_rows] ** 2)) / dof)
  sum_n2 = float(np.sum(n**2))
  signal = float(np.sum(n * z)) / sum_n2
  # σ̂ interval (χ²) and â interval (normal), each at α/4 per side.
  lo_chi, hi_chi = stats.chi2.ppf([alpha / 4, 1 - alpha / 4], dof)
  sigma_lo, sigma_hi = sigma_hat * math.sqrt(dof / hi_chi), sigma_hat * math.sqrt(dof / lo_chi)
  half = stats.norm.ppf(1 - alpha / 4) * sigma_hi / math.sqrt(sum_n2)
  signal_lo, signal_hi = signal - half, signal + half
  low = sigma_lo / signal_hi if signal_hi > 0 else math.inf
  high = sigma_hi / signal_lo if signal_lo > 0 else math.inf
  # Per step: Σ_j z² / σ² over its noise rows ~ χ²_{m_t}, two-sided at α/(2T).
  num_steps = z.shape[0]
  flagged_steps = []
  for t in range(num_steps):
    rows = noise_rows[t]
    k = int(rows.sum())
    if k == 0:
      continue
    q = float(np.sum(z[t, rows] ** 2)) / noise_multiplier**2
    p = 2 * min(stats.chi2.cdf(q, k), stats.chi2.sf(q, k))
    if p < alpha / (2 * num_steps):
      flagged_steps.append(t)
  flagged = not (low <= noise_multiplier <= high) or bool(flagged_steps)
  return EffectiveSigma(
    float(noise_multiplier),
    sigma_hat,
    signal,
    sigma_hat / signal if signal > 0 else math.inf,
    (low, high),
    tuple(flagged_steps),
    confidence,
    flagged,
  )
