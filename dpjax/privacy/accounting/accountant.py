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
from typing import Sequence

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpjax.privacy import checks
from dpjax.privacy import samplers as samplers_lib
from dpjax.privacy.accounting import analyses
from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import composition
from dpjax.privacy.accounting import cap
from dpjax.privacy.accounting import monte_carlo
from dpjax.privacy.accounting import sampler_events
from dpjax.privacy.accounting.report import PrivacyReport
from dpjax.privacy.accounting.step_compositions import StepCompositions
from dpjax.privacy.accounting.step_pld import MAX_GRID_POINTS
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


def _optional_positive_int(name: str, value) -> int | None:
  return None if value is None else sampler_events.check_positive_int(name, value)


def _check_beta(beta) -> float:
  if not (isinstance(beta, (int, float)) and 0 < beta < 1):
    raise ValueError(f'beta must be in (0, 1), got {beta!r}.')
  return float(beta)


def _check_pld_options(
  random_allocation_timeout, value_discretization_interval, pld_coarsening
) -> None:
  """Timeout None or > 0; discretisation None or a float in (0, 0.1]; coarsening in [1, 100]."""
  if random_allocation_timeout is not None and not (
    isinstance(random_allocation_timeout, (int, float)) and random_allocation_timeout > 0
  ):
    raise ValueError(
      f'random_allocation_timeout must be None (no limit) or seconds > 0, got '
      f'{random_allocation_timeout!r}.'
    )
  if value_discretization_interval is not None and not (
    isinstance(value_discretization_interval, float) and 0 < value_discretization_interval <= 0.1
  ):
    raise ValueError(
      'value_discretization_interval must be None or a float in (0, 0.1], '
      f'got {value_discretization_interval!r}.'
    )
  if not (isinstance(pld_coarsening, (int, float)) and 1 <= pld_coarsening <= 100):
    raise ValueError(f'pld_coarsening must be in [1, 100], got {pld_coarsening!r}.')


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
    *,
    accountant: str = 'auto',
    max_batch_size: int | None = cap.CAP_NOT_GIVEN,
    group_size: int = 1,
    num_steps: int | None = None,
    monte_carlo_samples: int | None = None,
    beta: float = 1e-3,
    monte_carlo_seed: int = 0,
    monte_carlo_workers: int | None = None,
    monte_carlo_estimate: bool = False,
    random_allocation: bool | None = None,
    value_discretization_interval: float | None = None,
    pld_coarsening: float = 1.0,
    exact_truncation: bool = True,
    random_allocation_timeout: float | None = balls_and_bins.RANDOM_ALLOCATION_TIMEOUT,
    max_grid_points: int = MAX_GRID_POINTS,
    allow_large_delta: bool = False,
    prior_runs: Sequence[composition.PriorRun] = (),
    sensitivity: float = 1.0,
  ):
    """Validates everything before any computation.

    Args:
      sampler: the run's sampler (`dpjax.privacy.samplers`).
      noise_multiplier: σ > 0.
      delta: δ in (0, 1).
      accountant: 'auto', 'pld', 'rdp' or 'monte_carlo' (the sampler class's `accountants`).
      max_batch_size: B, the batcher's cap (required where it truncates: `cap`); None = no cap.
      group_size: k >= 1 (add/remove up to k examples).
      num_steps: the planned run length (used by `final_report`), optional.
      monte_carlo_samples: samples per direction of the Monte-Carlo estimate; None =
        chosen from δ and β so that an estimate exists (`monte_carlo.default_num_samples`).
      beta: the Monte-Carlo failure probability (confidence 1 − β).
      monte_carlo_seed: its seed (fixed, so reports are reproducible).
      monte_carlo_workers: processes drawing its samples (this one included; the estimate does
        not depend on it); None = the available cores, as many as the samples pay to start.
      monte_carlo_estimate: also compute the Monte-Carlo estimate beside the provable balls-
        and-bins ε with `estimates` (opt-in: its samples grow as 1/δ; always for 'monte_carlo').
      random_allocation: force (True, no time limit) / skip (False) random-allocation PLD
        for balls-and-bins; None = attempt it within `random_allocation_timeout` seconds
        per new one-epoch PLD (cached on disk), else the labelled deterministic fallback.
      value_discretization_interval: a fixed PLD grid; None = the grid follows ε (`pld_grid`,
        refined until ε moves by < 0.1 %; the grid is in the report's details).
      pld_coarsening: > 1 stops the grid's refinement at its first jump, unconfirmed
        (calibration searches with 10: a looser valid bound), or multiplies a fixed grid.
      exact_truncation: for Poisson with a cap B, also compute dp_accounting's exact truncated
        event (costly) when the TV penalty is not negligible; False (forced when N bounds
        `sampler.num_rows`): the TV penalty (looser).
      max_grid_points: refuse (GridTooLargeError, before allocating) a per-step
        PLD of more grid points × mixture components (`estimate_pld_grid_points`).
      allow_large_delta: accept δ >= 1/N (refused by default: it allows releasing a record).
      sensitivity: 1 + η, the noised sum's sensitivity / C (`dpjax.privacy.rounding`): the
        analyses use σ/(1 + η) (`accounted_noise_multiplier`); reports keep σ.
      prior_runs: the runs whose release this one starts from: ε of the composition.
    """
    if not isinstance(sampler, samplers_lib.Sampler):
      raise TypeError(f'sampler must be a dpjax.privacy.samplers.Sampler, got {type(sampler)}.')
    self.sampler = sampler
    self.noise_multiplier = checks.check_noise_multiplier(noise_multiplier)
    self.sensitivity = sampler_events.check_sensitivity(sensitivity)
    self.accounted_noise_multiplier = self.noise_multiplier / self.sensitivity
    self.delta = checks.check_delta(
      delta,
      num_examples=sampler.num_examples,
      allow_large_delta=allow_large_delta,
      warn=False,
      flag='allow_large_delta=True (--allow-large-delta)',
    )
    self.allow_large_delta = bool(allow_large_delta)
    self.group_size = _check_group_size(group_size, sampler.num_examples)
    self.accountant = resolve_accountant(sampler.name, accountant, self.group_size)
    self.max_batch_size = cap.check_max_batch_size(sampler, max_batch_size)
    self.num_steps = _optional_positive_int('num_steps', num_steps)
    self.monte_carlo_samples = _optional_positive_int('monte_carlo_samples', monte_carlo_samples)
    self.beta = _check_beta(beta)
    self.monte_carlo_seed = monte_carlo_seed
    self._chosen_workers = _optional_positive_int('monte_carlo_workers', monte_carlo_workers)
    self.monte_carlo_workers = self._chosen_workers or monte_carlo.available_cores()
    self.monte_carlo_estimate = bool(monte_carlo_estimate)
    _check_pld_options(random_allocation_timeout, value_discretization_interval, pld_coarsening)
    self.random_allocation = random_allocation
    self.value_discretization_interval = value_discretization_interval
    self.pld_coarsening = float(pld_coarsening)
    self.exact_truncation = bool(exact_truncation) and sampler.num_rows is None
    self.random_allocation_timeout = random_allocation_timeout
    self.max_grid_points = sampler_events.check_positive_int('max_grid_points', max_grid_points)
    self.prior_runs = composition.check_prior_runs(prior_runs)
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
    return self.sampler.is_epoch_based

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
    return analyses.ANALYSES[self.sampler.analysis](self, unit, estimates)

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
        workers=self._chosen_workers,
      )
    return self._monte_carlo[key]
