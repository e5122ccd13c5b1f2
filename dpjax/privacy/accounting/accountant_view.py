"""The accountant as the per-sampler analyses and `composition` see it: a Protocol.

`accountant.Accountant` holds σ, δ, the group size k, the cap B and the per-step PLD cache,
and calls the analyses (`analyses.ANALYSES`); they read it through this interface, so that no
analysis imports the accountant back (no import cycle).
"""

from __future__ import annotations

from typing import Any, Protocol

from dpjax.privacy.accounting.report import PrivacyReport


class Accountant(Protocol):
  """What an analysis (and `composition`) reads of `accountant.Accountant`, which imports
  them: they name its interface here rather than import it back."""

  sampler: Any
  noise_multiplier: float
  prior_runs: tuple
  is_epoch_based: bool
  accountant: str  # 'pld', 'rdp' or 'monte_carlo'.
  accounted_noise_multiplier: float  # σ / (1 + η).
  delta: float
  group_size: int
  max_batch_size: int
  beta: float
  exact_truncation: bool
  monte_carlo_estimate: bool
  monte_carlo_workers: int | None
  random_allocation: Any  # 'auto', True or False: use the random-allocation PLD.
  random_allocation_timeout: float
  steps_per_epoch: int
  sampling_probability: float
  noise: str  # 'gaussian', 'bandmf' or 'blt' (`AccountingOptions.noise`).
  num_bands: int
  strategy: Any  # The correlated.strategy.Strategy that runs, or None.
  analysis: str  # The key of `analyses.ANALYSES` that accounts this run.
  num_steps: int | None

  def composed_pld(self, event: Any, count: int, *args, **kwargs) -> Any: ...
  def pld_grid(self, event: Any, count: int) -> dict: ...
  def log_truncation_mass(self, num_steps: int) -> float: ...
  def epochs_started(self, step: int) -> int: ...
  def report(self, unit: int, epsilon: float, details: dict, **kwargs) -> PrivacyReport: ...
  def monte_carlo_epsilon(self, epochs: int, delta0: float) -> Any: ...
