"""The privacy loss of runs in sequence: a run that starts from another run's release.

A run B that starts from the parameters a run A released (`init_from`, fine-tuning) releases
a function of both training sets. When they may share an individual, B's release is the
adaptive composition of A's mechanism and B's, and its ε is that of the composition: the
privacy-loss distributions (PLDs) of A and B composed (Koskela, Jälkö & Honkela 2020,
"Computing Tight Differential Privacy Guarantees Using FFT"; dp_accounting's
`PrivacyLossDistribution.compose`). A chain (C from B from A) composes all of them.

Each run's loss is `privacy_loss(accountant, steps)`: a pessimistic PLD of its mechanism,
built by the accountant from the event its own ε composes (`analyses.PLD_EVENTS`), and the
truncation mass τ = T·Pr[n_t > B] its cap costs. Every accountant has one: a run reported with
RDP or Monte Carlo is composed through the PLD of the same mechanism (an upper bound too), and
balls-and-bins and shuffle through their deterministic-order Gaussian (the always-valid upper
bound, Chua et al. 2025, §3), so the composed ε is a provable upper bound whatever each run
reported. Truncation, by the TV coupling of docs/accounting.md §1: each truncated run differs
from its untruncated twin with probability ≤ τ_i, so the sequence is within TV Σ τ_i of the
untruncated one, and ε is the smallest with δ_PLD(ε) + (1 + e^ε)·Σ τ_i ≤ δ. PLDs are composed at
the coarsest discretisation among them (pessimistic rounding holds on any grid).

`Accountant(..., prior_runs=(PriorRun(...), ...))` reports the composition at every step; its
δ is the composed guarantee's δ.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpjax.privacy.accounting import analyses
from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting.accountant_view import Accountant  # Not accountant.py: a cycle.
from dpjax.privacy.accounting.report import PrivacyReport

# The privacy fingerprint's field listing the prior runs (`PriorRun.fingerprint`), if any.
FINGERPRINT_FIELD = 'privacy.prior_runs'


@dataclasses.dataclass(frozen=True)
class PrivacyLoss:
  """One run's privacy loss: a pessimistic PLD and the truncation mass τ paid in δ."""

  pld: pld_lib.PrivacyLossDistribution
  truncation_mass: float
  interval: float


@dataclasses.dataclass(frozen=True)
class PriorRun:
  """A released run whose parameters this run starts from.

  Attributes:
    accountant: that run's accountant (its sampler, σ, B, accountant), for the neighbouring
      relation of the run that composes it (its group size).
    num_steps: the steps of the release this run starts from.
    name: how reports name it (e.g. its workdir).
  """

  accountant: Accountant
  num_steps: int
  name: str

  @property
  def fingerprint(self) -> dict[str, Any]:
    """What of it enters ε (JSON-ready): sampler, N, b, B, k, σ, δ, accountant, steps."""
    acct = self.accountant
    return {
      'sampler.name': acct.sampler.name,
      'sampler.num_examples': acct.sampler.num_examples,
      'sampler.batch_size': acct.sampler.batch_size,
      'sampler.max_batch_size': acct.max_batch_size,
      'privacy.group_size': acct.group_size,
      'privacy.noise_multiplier': acct.noise_multiplier,
      'privacy.delta': acct.delta,
      'privacy.accountant': acct.accountant,
      'steps': self.num_steps,
    }


def check_prior_runs(prior_runs) -> tuple[PriorRun, ...]:
  """A tuple of PriorRun with num_steps >= 1; TypeError / ValueError otherwise."""
  runs = tuple(prior_runs)
  for run in runs:
    if not isinstance(run, PriorRun):
      raise TypeError(f'prior_runs must hold composition.PriorRun, got {type(run).__name__}.')
    if isinstance(run.num_steps, bool) or not isinstance(run.num_steps, int) or run.num_steps < 1:
      raise ValueError(
        f'prior run {run.name!r}: num_steps must be an integer >= 1, got {run.num_steps!r}.'
      )
    analysis = getattr(run.accountant, 'analysis', run.accountant.sampler.analysis)
    if analysis not in analyses.PLD_EVENTS:  # Correlated noise unamplified: one Gaussian.
      raise ValueError(f'prior run {run.name!r}: its {analysis} analysis is not composed.')
  return runs


def privacy_loss(acct: Accountant, step: int, interval: float | None = None) -> PrivacyLoss:
  """The privacy loss of `acct`'s run after `step` >= 1 steps (the epochs started, for
  epoch-based samplers), at discretisation `interval` (default: the accountant's)."""
  event = analyses.PLD_EVENTS[acct.sampler.analysis](acct)
  unit = acct.epochs_started(step) if acct.is_epoch_based else acct.sampler.participations(step)
  if interval is None:  # The grid this run's own ε uses (`pld_grid`).
    pld, interval = acct.composed_pld(event, unit), acct.pld_grid(event, unit)['pld_grid']
  else:
    pld = acct.composed_pld(event, unit, interval=interval)
  steps_run = unit * acct.steps_per_epoch if acct.is_epoch_based else step
  return PrivacyLoss(pld, math.exp(acct.log_truncation_mass(steps_run)), interval)


def composed_epsilon(losses: list[tuple[Accountant, int]], delta: float) -> float:
  """ε at δ of the runs (accountant, steps) in sequence: their PLDs composed on a common grid,
  the truncation masses paid in δ."""
  return composed_epsilon_and_grid(losses, delta)[0]


def composed_epsilon_and_grid(
  losses: list[tuple[Accountant, int]], delta: float
) -> tuple[float, float]:
  """`composed_epsilon` and the common grid: the coarsest of the runs' own grids (every run's
  pessimistic PLD on any grid is an upper bound, so the composition is one too)."""
  parts = [privacy_loss(acct, steps) for acct, steps in losses]
  interval = max(p.interval for p in parts)
  parts = [
    p if p.interval == interval else privacy_loss(acct, steps, interval)
    for p, (acct, steps) in zip(parts, losses)
  ]
  pld = parts[0].pld
  for part in parts[1:]:
    pld = pld.compose(part.pld)
  tau = sum(p.truncation_mass for p in parts)
  if tau == 0:
    return float(pld.get_epsilon_for_delta(delta)), interval
  return (
    balls_and_bins.smallest_epsilon(pld.get_delta_for_epsilon, delta, penalty_mass=tau),
    interval,
  )


def prior_epsilon(prior_runs: tuple[PriorRun, ...], delta: float) -> float:
  """ε at δ of the prior runs alone: the least a run starting from them can report."""
  return composed_epsilon([(r.accountant, r.num_steps) for r in prior_runs], delta)


def composed_report(acct: Accountant, unit: int, estimates: bool) -> PrivacyReport:
  """The report of `acct`'s run after `unit` steps (epochs) composed with its prior runs.

  With `estimates`, the details also hold this run's ε alone (its own accountant's) and
  each prior run's ε at this δ.
  """
  runs = acct.prior_runs
  losses = [(r.accountant, r.num_steps) for r in runs]
  if unit:
    losses.append((acct, unit * acct.steps_per_epoch if acct.is_epoch_based else unit))
  eps, grid = composed_epsilon_and_grid(losses, acct.delta)
  details: dict[str, Any] = {
    'method': 'pld composition with the runs this one starts from (init_from)',
    'pld_grid': grid,
    'composed_with': [r.name for r in runs],
    'prior_runs': [r.fingerprint for r in runs],
  }
  if estimates:
    alone = analyses.ANALYSES[acct.sampler.analysis](acct, unit, False) if unit else None
    details['epsilon_this_run_alone'] = alone.epsilon if alone else 0.0
    details['this_run_alone_method'] = alone.details.get('method') if alone else None
    details['prior_run_epsilons'] = [
      composed_epsilon([pair], acct.delta) for pair in losses[: len(runs)]
    ]
  # The composition is a PLD whatever each run's own accountant.
  return dataclasses.replace(acct.report(unit, eps, details), accountant='pld')
