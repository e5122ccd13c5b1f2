"""The privacy accountant of a training run: ε after any step, with its kind of bound.

`Accountant(sampler, σ, δ, num_steps=T, max_batch_size=B)` takes typed
arguments; `dpjax.PrivacyPlan` makes it from the same sampler, σ and cap B
as the batcher and the noise, and the trainer's `plan.make_accountant(config,
N)` from the training config through the same plan. Which number is attached
to a run, per sampler (docs/accounting.md):

* poisson: PLD (default) or RDP of the Poisson-subsampled Gaussian; a cap B
  by the exact `TruncatedSubsampledGaussianDpEvent` or the TV penalty.
  Beside it: RDP (for PLD).
* fixed_size: PLD of the MoG [0, 2] (Ganesh, seed 004) or FS-RDP (Birrell et
  al., seed 001). Beside it: the other one; Wang et al. replace-one RDP.
* fixed_size_with_replacement: PLD of the MoG [0, 2, …, 2b], Binomial(b, 1/N).
* deterministic: exact Gaussian, once per epoch.
* shuffle: the deterministic ε (the only rigorous upper bound known). Beside
  it: the max-test lower bound; an "as if Poisson" ε, *not a guarantee*.
* balls_and_bins: provable (random-allocation PLD at every T within a time
  budget, else the labelled deterministic fallback). Beside it: the max-test
  and random-allocation lower bounds, and (opt-in, `monte_carlo_estimate`)
  the Monte-Carlo high-probability bound (confidence 1 − β, not a proof).

`accountant='monte_carlo'` (balls-and-bins only) attaches the Monte-Carlo
bound instead, with bound = 'high_probability_upper'. Group privacy (k > 1)
uses the MoG events of Ganesh for Poisson and fixed size, sensitivity k for
the epoch-based samplers; the generic k·ε conversion is only a comparison.

Steps and epochs: Poisson and fixed-size samplers compose per step, so
`epsilon_at(t)` is the ε of t steps. For balls-and-bins, shuffle and
deterministic the unit is the epoch: a checkpoint inside epoch e releases a
prefix of that epoch (post-processing of the whole epoch), so the ε attached
is that of the e epochs started so far.

Cost: per-step PLDs are built once per accountant and grid, and self-composed
per query at the grid that follows ε (`pld_grid`: refined until ε moves by
< 0.1 %, the smallest bound kept, the grid in `details['pld_grid']`); reports are memoised per step (per epoch for epoch-based samplers);
random-allocation PLD results are cached on disk. The Monte-Carlo samples
are drawn by `monte_carlo_workers` processes (`privacy.monte_carlo_workers`;
the estimate does not depend on it).
`estimates=False` skips the numbers reported beside the attached one
(Monte-Carlo, lower bounds, comparisons) for cheap per-checkpoint calls.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpjax.privacy import checks
from dpjax.privacy import samplers as samplers_lib
from dpjax.privacy.accounting import analyses
from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import composition
from dpjax.privacy.accounting import matrix_mechanism
from dpjax.privacy.accounting import cap
from dpjax.privacy.accounting import monte_carlo
from dpjax.privacy.accounting import sampler_events
from dpjax.privacy.accounting.options import AccountingOptions
from dpjax.privacy.accounting.report import PrivacyReport
from dpjax.privacy.accounting.step_compositions import StepCompositions
from dpjax.privacy.accounting.step_pld import mixture_components
from dpjax.privacy.names import ACCOUNTANTS


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def resolve_accountant(sampler_name: str, accountant: str, group_size: int = 1) -> str:
  """'auto' → the sampler's default accountant; ValueError for unsupported pairs.

  The sampler class says which accountants fit it (`Sampler.accountants`, the
  first is the default; `group_accountants` for group_size > 1) and why others
  do not (`unsupported_accountant_reason`).
  """
  sampler = samplers_lib.sampler_class(sampler_name)  # ValueError names the valid samplers.
  if accountant not in ACCOUNTANTS:
    raise ValueError(
      f'privacy.accountant = {accountant!r} is unknown; valid: {", ".join(ACCOUNTANTS)}.'
    )
  if group_size > 1 and not sampler.group_accountants:
    raise ValueError(
      f'privacy.group_size = {group_size} > 1 is not analysed for sampler {sampler_name!r} '
      '(group_size = 1 only).'
    )
  supported = sampler.accountants
  if accountant == 'auto':
    return supported[0]
  if accountant not in supported:
    raise ValueError(
      f'privacy.accountant = {accountant!r} is not supported for sampler '
      f'{sampler_name!r} ({sampler.unsupported_accountant_reason}); valid: '
      f'{", ".join(("auto",) + supported)}.'
    )
  if group_size > 1 and accountant not in sampler.group_accountants:
    if accountant == 'monte_carlo':
      raise ValueError(
        f'privacy.group_size = {group_size} > 1: the Monte-Carlo accountant '
        'covers single examples only (group_size = 1). Use accountant pld.'
      )
    raise ValueError(
      f'privacy.group_size = {group_size} > 1 needs the mixture-of-Gaussians PLD '
      f'for sampler {sampler_name!r}; accountant {accountant} supports '
      'group_size = 1 only. Use accountant pld.'
    )
  return accountant


def _check_group_size(group_size, num_examples: int) -> int:
  """k in [1, N]."""
  k = sampler_events.check_positive_int('privacy.group_size', group_size)
  if k > num_examples:
    raise ValueError(f'privacy.group_size = {group_size} must be in [1, N = {num_examples}].')
  return k


# ---------------------------------------------------------------------------------------------
# The accountant
# ---------------------------------------------------------------------------------------------


class Accountant:
  """ε(step) for one run: a sampler, σ, δ, the cap B and the group size k.

  Build it with `plan.make_accountant(config, N)` from the training config; the
  constructor is for callers that already hold a sampler (the CLI, tests).
  """

  def __init__(
    self,
    sampler: samplers_lib.Sampler,
    noise_multiplier: float,
    delta: float,
    options: AccountingOptions | None = None,
    **fields: Any,
  ):
    """Validates everything before any computation.

    Args:
      sampler: the run's sampler (`dpjax.privacy.samplers`).
      noise_multiplier: σ > 0.
      delta: δ in (0, 1).
      options: how to account (`AccountingOptions`: the accountant, B, k, T, grids, the
        Monte-Carlo estimate, prior runs, 1 + η); None = the defaults.
      **fields: `AccountingOptions` fields that replace those of `options`.
    """
    if not isinstance(sampler, samplers_lib.Sampler):
      raise TypeError(f'sampler must be a dpjax.privacy.samplers.Sampler, got {type(sampler)}.')
    options = options or AccountingOptions()
    self.options = options = options.replace(**fields) if fields else options
    self.sampler = sampler
    self.noise_multiplier = checks.check_noise_multiplier(noise_multiplier)
    self.sensitivity = options.sensitivity
    self.accounted_noise_multiplier = self.noise_multiplier / self.sensitivity
    self.delta = checks.check_delta(
      delta,
      num_examples=sampler.num_examples,
      allow_large_delta=options.allow_large_delta,
      warn=False,
      flag='allow_large_delta=True (--allow-large-delta)',
    )
    self.allow_large_delta = bool(options.allow_large_delta)
    self.group_size = _check_group_size(options.group_size, sampler.num_examples)
    self.accountant = resolve_accountant(sampler.name, options.accountant, self.group_size)
    self.max_batch_size = cap.check_max_batch_size(sampler, options.max_batch_size)
    self.noise, self.num_bands = analyses.check_noise_for_sampler(
      sampler, options.noise, options.num_bands, options.strategy
    )
    self.strategy = options.strategy
    # The sampler's own analysis, or the matrix mechanism's for correlated noise it does not
    # amplify (`matrix_mechanism.check_noise`).
    self.analysis = matrix_mechanism.check_noise(sampler, self.noise, self.num_bands, self.strategy)
    self.num_steps = options.num_steps
    self.monte_carlo_samples, self.beta = options.monte_carlo_samples, float(options.beta)
    self.monte_carlo_seed = options.monte_carlo_seed
    self.monte_carlo_workers = options.monte_carlo_workers or monte_carlo.available_cores()
    self.monte_carlo_estimate = bool(options.monte_carlo_estimate)
    self.random_allocation = options.random_allocation
    self.random_allocation_timeout = options.random_allocation_timeout
    self.value_discretization_interval = options.value_discretization_interval
    self.pld_coarsening = float(options.pld_coarsening)
    self.exact_truncation = bool(options.exact_truncation) and sampler.num_rows is None
    self.max_grid_points = options.max_grid_points
    self.prior_runs = options.prior_runs
    if self.analysis == matrix_mechanism.NAME:
      matrix_mechanism.check_accountant(self)
    self._reports: dict[tuple[int, bool], PrivacyReport] = {}
    self._monte_carlo: dict[tuple[int, float], monte_carlo.MonteCarloResult] = {}

  # --- derived quantities ---------------------------------------------------------------------

  @functools.cached_property
  def compositions(self) -> StepCompositions:
    """This accountant's composed step PLDs, at the grid that follows ε."""
    return StepCompositions(
      self.noise_multiplier,
      self.delta,
      self.max_grid_points,
      self.value_discretization_interval,
      self.pld_coarsening,
      describe=self._grid_too_large,
    )

  @property
  def steps_per_epoch(self) -> int:
    return self.sampler.steps_per_epoch

  @property
  def sampling_probability(self) -> float:
    return self.sampler.sampling_probability

  @property
  def is_epoch_based(self) -> bool:
    """The unit is the epoch (the sampler's analysis of an epoch-based sampler); the matrix
    mechanism accounts the steps run (the patterns possible in them)."""
    return self.sampler.is_epoch_based and self.analysis == self.sampler.analysis

  def epochs_started(self, step: int) -> int:
    """ceil(step / T): the epochs a checkpoint after `step` steps has touched."""
    return -(-step // self.steps_per_epoch)

  def log_truncation_mass(self, num_steps: int) -> float:
    """log τ = log(T·Pr[n_t > B]) for binomial batch sizes; −inf without truncation."""
    if self.max_batch_size is None or not self.sampler.binomial_batch_size:
      return -math.inf
    return balls_and_bins.log_truncation_mass(
      self.sampler.num_examples,
      self.sampling_probability,
      self.max_batch_size,
      num_steps,
      group_size=self.group_size,
    )

  def composed_pld(
    self, event: dp_event.DpEvent, count: int, interval: float | None = None
  ) -> pld_lib.PrivacyLossDistribution:
    """`count` steps of `event` at the grid that gives the smallest ε(δ) (`pld_grid.refine`,
    chosen once per (event, count)), or at `value_discretization_interval` when one is set,
    or at `interval` when given (composing with other runs on a common grid)."""
    if interval is not None:
      return self.compositions.at_grid(event, interval, count)
    return self.compositions.composed(event, count, self.sampler.name)

  def pld_grid(self, event: dp_event.DpEvent, count: int) -> dict:
    """The grid `composed_pld(event, count)` used (for a report's details)."""
    return self.compositions.grid_details(event, count, self.sampler.name)

  def _grid_too_large(self, event: dp_event.DpEvent, points: int, interval: float) -> str:
    sensitivities = mixture_components(event)[1]
    hints = ['raise σ (privacy.noise_multiplier)']
    if self.group_size > 1:
      hints.insert(0, f'lower privacy.group_size = {self.group_size}')
    if self.sampler.grid_too_large_hint:
      hints.append(self.sampler.grid_too_large_hint)
    hints.append(f'coarsen value_discretization_interval (now {interval:g})')
    return (
      f'the privacy-loss distribution of one {self.sampler.name} step (σ = '
      f'{self.noise_multiplier:.4g}, {len(sensitivities)} mixture components, sensitivity '
      f'up to {max(sensitivities):g}) needs ~{points:.3g} grid points × components, more '
      f'than the {self.max_grid_points:.3g} allowed (minutes and GBs of memory). To fix: '
      f'{"; ".join(hints)}; or raise max_grid_points.'
    )

  # --- public API -----------------------------------------------------------------------------

  def epsilon_at(self, step: int, *, estimates: bool = True) -> PrivacyReport:
    """The PrivacyReport after `step` completed steps (memoised).

    Args:
      step: steps completed, >= 0 (0: nothing released, ε = 0).
      estimates: also compute the numbers reported beside ε (Monte-Carlo,
        lower bounds, comparisons). False is cheaper and gives the same ε,
        except for accountant='monte_carlo', whose ε *is* the estimate.
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f'step must be an integer >= 0, got {step!r}.')
    step = int(step)
    unit = self.epochs_started(step) if self.is_epoch_based else step
    key = (unit, bool(estimates))
    if key not in self._reports:
      self._reports[key] = self._compute(unit, bool(estimates))
    report = self._reports[key]
    return dataclasses.replace(report, steps=step, details=dict(report.details))

  def epsilon(self, step: int) -> float:
    """Just the attached ε after `step` steps."""
    return self.epsilon_at(step, estimates=False).epsilon

  def final_report(self, *, estimates: bool = True) -> PrivacyReport:
    if self.num_steps is None:
      raise ValueError('final_report needs num_steps (the planned run length).')
    return self.epsilon_at(self.num_steps, estimates=estimates)

  # --- per sampler ----------------------------------------------------------------------------

  def report(self, unit: int, epsilon: float, details: dict, **kwargs) -> PrivacyReport:
    details = dict(details)
    for key, value in (
      ('group_size', self.group_size),
      ('num_examples', self.sampler.num_examples),
      ('batch_size', self.sampler.batch_size),
      ('sampling_probability', self.sampling_probability),
    ):
      details.setdefault(key, value)
    details['max_batch_size'] = self.max_batch_size
    if self.sensitivity != 1:  # 1 + η, and the σ/(1 + η) every number here is of.
      details.update(
        sensitivity=self.sensitivity, accounted_noise_multiplier=self.accounted_noise_multiplier
      )
    if self.is_epoch_based:
      details['epochs_accounted'] = unit
    kwargs.setdefault('bound', 'upper')
    return PrivacyReport(
      epsilon=float(epsilon),
      delta=self.delta,
      accountant=self.accountant,
      sampler=self.sampler.name,
      noise_multiplier=self.noise_multiplier,
      steps=unit,
      steps_per_epoch=self.steps_per_epoch,
      details=details,
      **kwargs,
    )

  def _compute(self, unit: int, estimates: bool) -> PrivacyReport:
    if self.prior_runs:
      return composition.composed_report(self, unit, estimates)
    if unit == 0:
      return self.report(0, 0.0, {'method': 'nothing released yet'})
    return analyses.ANALYSES[self.analysis](self, unit, estimates)

  def monte_carlo_epsilon(self, epochs: int, delta0: float) -> monte_carlo.MonteCarloResult:
    key = (epochs, delta0)
    if key not in self._monte_carlo:
      self._monte_carlo[key] = monte_carlo.balls_and_bins_epsilon(
        self.accounted_noise_multiplier,
        self.steps_per_epoch,
        delta0,
        num_epochs=epochs,
        num_samples=self.monte_carlo_samples,
        beta=self.beta,
        seed=self.monte_carlo_seed,
        workers=self.options.monte_carlo_workers,
      )
    return self._monte_carlo[key]
