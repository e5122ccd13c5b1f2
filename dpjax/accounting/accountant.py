"""The privacy accountant of a training run: ε after any step, with its kind of bound.

`make_accountant(config, N)` is `dpjax.plan.make_plan(config, N).accountant`:
the sampler, the batch cap and σ are resolved from the *training* config in
the one place training resolves them, so the accountant describes exactly
what training samples. Which
number is attached to a run, per sampler (docs/accounting.md):

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

Cost: per-step PLDs are built once per accountant and self-composed per
query (≈ 1 s for 1e5 Poisson steps); reports are memoised per step (per
epoch for epoch-based samplers); random-allocation PLD results are cached on
disk. The Monte-Carlo samples are drawn by `monte_carlo_workers` processes
(`privacy.monte_carlo_workers`; the estimate does not depend on it).
`estimates=False` skips the numbers reported beside the attached one
(Monte-Carlo, lower bounds, comparisons) for cheap per-checkpoint calls.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from typing import Any

import ml_collections
import numpy as np
import tqdm
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism
from dp_accounting.rdp import rdp_privacy_accountant

from dpjax import samplers as samplers_lib
from dpjax.accounting import balls_and_bins
from dpjax.accounting import fixed_size_rdp
from dpjax.accounting import max_test
from dpjax.accounting import monte_carlo
from dpjax.accounting import sampler_events

ACCOUNTANTS = ('auto', 'pld', 'rdp', 'monte_carlo')
BOUNDS = ('upper', 'high_probability_upper', 'lower')
# PLD discretisation (pessimistic rounding, so any value gives an upper bound): 1e-4 for
# Gaussian-type events; 1e-3 for mixtures of > 2 Gaussians (group privacy, sampling with
# replacement), whose dp_accounting construction costs ~10x more per decade of resolution.
VALUE_DISCRETIZATION = 1e-4
MOG_VALUE_DISCRETIZATION = 1e-3
# Refuse to build a per-step PLD whose grid (privacy-loss points × mixture components, what
# dp_accounting evaluates and holds as float64 arrays) exceeds this: ~1e6 takes 10-40 s and
# ~200 MB on one core (fixed_size_with_replacement at b = 256, N = 50,000, σ = 1 is 1.1e6).
MAX_GRID_POINTS = 2 * 10**6
# Poisson truncation whose TV penalty costs less than this fraction of δ is accounted by the
# TV argument alone; above it the exact truncated event is computed too.
_NEGLIGIBLE_PENALTY = 1e-3


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrivacyReport:
  """ε of a run after `steps` steps, and what kind of bound it is.

  Attributes:
    epsilon: the attached ε at `delta`.
    delta: δ (the total, any truncation penalty included).
    bound: 'upper' (provable), 'high_probability_upper' (holds with
      probability ≥ `confidence` over the Monte-Carlo sampling) or 'lower'.
    accountant: 'pld', 'rdp' or 'monte_carlo' (resolved from 'auto').
    sampler: the sampler's name.
    noise_multiplier: σ.
    steps: steps completed.
    steps_per_epoch: ceil(N/b).
    epsilon_lower: a provable lower bound on the true ε at `delta`, if known.
    confidence: 1 − β of a Monte-Carlo number (attached or in details), if any.
    num_samples: Monte-Carlo samples per direction, if any.
    details: method names and the numbers reported beside ε, with labels.
  """

  epsilon: float
  delta: float
  bound: str
  accountant: str
  sampler: str
  noise_multiplier: float
  steps: int
  steps_per_epoch: int
  epsilon_lower: float | None = None
  confidence: float | None = None
  num_samples: int | None = None
  details: dict[str, Any] = dataclasses.field(default_factory=dict)

  def to_dict(self) -> dict[str, Any]:
    return _plain(dataclasses.asdict(self))

  def to_json(self, **kwargs) -> str:
    """One JSON object (non-finite ε is written as Infinity, as Python's json does)."""
    return json.dumps(self.to_dict(), **kwargs)


def _plain(value):
  """numpy scalars and tuples to plain Python, for JSON."""
  if isinstance(value, dict):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  return value


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
    raise ValueError(f'privacy.accountant = {accountant!r} is unknown; valid: '
                     f'{", ".join(ACCOUNTANTS)}.')
  supported = sampler.accountants
  if accountant == 'auto':
    return supported[0]
  if accountant not in supported:
    raise ValueError(f'privacy.accountant = {accountant!r} is not supported for sampler '
                     f'{sampler_name!r} ({sampler.unsupported_accountant_reason}); valid: '
                     f'{", ".join(("auto",) + supported)}.')
  if group_size > 1 and accountant not in sampler.group_accountants:
    if accountant == 'monte_carlo':
      raise ValueError(f'privacy.group_size = {group_size} > 1: the Monte-Carlo accountant '
                       'covers single examples only (group_size = 1). Use accountant pld.')
    raise ValueError(f'privacy.group_size = {group_size} > 1 needs the mixture-of-Gaussians PLD '
                     f'for sampler {sampler_name!r}; accountant {accountant} supports '
                     'group_size = 1 only. Use accountant pld.')
  return accountant


def _check_delta(delta) -> float:
  if isinstance(delta, bool) or not isinstance(delta, (int, float, np.floating)) or not (
      0 < delta < 1):
    raise ValueError(f'privacy.delta must be in (0, 1), got {delta!r}.')
  return float(delta)


def _step_pld(event: dp_event.DpEvent, interval: float) -> pld_lib.PrivacyLossDistribution:
  """The PLD of one step, built as dp_accounting's PLDAccountant builds it."""
  if isinstance(event, dp_event.PoissonSampledDpEvent):
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=event.event.noise_multiplier, value_discretization_interval=interval,
        sampling_prob=event.sampling_probability)
  if isinstance(event, dp_event.MixtureOfGaussiansDpEvent):
    if len(event.sensitivities) == 2 and event.sensitivities[0] == 0:
      # MoG [0, s] with probabilities [1 − p, p] *is* the Poisson-subsampled Gaussian pair
      # with sensitivity s and rate p (both directions); dp_accounting builds that one ~30×
      # faster at small σ, with the same ε to ~1e-9 (tests/test_accounting_events.py).
      return pld_lib.from_gaussian_mechanism(
          standard_deviation=event.standard_deviation, sensitivity=event.sensitivities[1],
          value_discretization_interval=interval, sampling_prob=event.sampling_probs[1])
    return pld_lib.from_mixture_gaussian_mechanism(
        standard_deviation=event.standard_deviation, sensitivities=event.sensitivities,
        sampling_probs=event.sampling_probs, value_discretization_interval=interval)
  if isinstance(event, dp_event.TruncatedSubsampledGaussianDpEvent):
    return pld_lib.from_truncated_subsampled_gaussian_mechanism(
        dataset_size=event.dataset_size, sampling_probability=event.sampling_probability,
        truncated_batch_size=event.truncated_batch_size,
        noise_multiplier=event.noise_multiplier, value_discretization_interval=interval)
  raise TypeError(f'no per-step PLD for {event!r}')


def progress_bar(total: int | None, desc: str) -> tqdm.tqdm:
  """A tqdm bar on stderr that appears only after 10 s, and only on a terminal (quiet in tests
  and logs)."""
  return tqdm.tqdm(total=total, desc=f'dpjax.accounting: {desc}', delay=10, disable=None,
                   file=sys.stderr, leave=False, dynamic_ncols=True)


class GridTooLargeError(ValueError):
  """A per-step PLD would exceed `max_grid_points` (raised before anything is allocated)."""


def _mixture_components(event: dp_event.DpEvent) -> tuple[float, list, list] | None:
  """(σ, sensitivities, probabilities) of a Gaussian-type step event; None for others."""
  if isinstance(event, dp_event.PoissonSampledDpEvent):
    q = event.sampling_probability
    return event.event.noise_multiplier, [0.0, 1.0], [1 - q, q]
  if isinstance(event, dp_event.MixtureOfGaussiansDpEvent):
    return event.standard_deviation, list(event.sensitivities), list(event.sampling_probs)
  return None


def estimate_pld_grid_points(event: dp_event.DpEvent, interval: float) -> int | None:
  """The size of the per-step PLD `_step_pld` would build: grid points × mixture components.

  The points are dp_accounting's own connect-the-dots range (its privacy-loss
  tail bounds, both adjacency directions) divided by the discretisation. A
  mixture of > 2 Gaussians evaluates each point against every component (in
  a binary search, arrays of points × components); the Poisson-type pair [0, s]
  has a closed-form inverse and counts its points once. Milliseconds; None
  for events without an estimate (truncated Poisson).
  """
  parts = _mixture_components(event)
  if parts is None:
    return None
  sigma, sensitivities, probs = parts
  points = 0.0
  closed_form = len(sensitivities) == 2 and sensitivities[0] == 0  # As `_step_pld` builds it.
  for adjacency in (privacy_loss_mechanism.AdjacencyType.ADD,
                    privacy_loss_mechanism.AdjacencyType.REMOVE):
    if closed_form:
      loss = privacy_loss_mechanism.GaussianPrivacyLoss(
          sigma, sensitivity=sensitivities[1], sampling_prob=probs[1], adjacency_type=adjacency)
    else:
      loss = privacy_loss_mechanism.MixtureGaussianPrivacyLoss(
          sigma, sensitivities, probs, adjacency_type=adjacency)
    bounds = loss.connect_dots_bounds()
    points = max(points, (bounds.epsilon_upper - bounds.epsilon_lower) / interval + 1)
  return int(math.ceil(points * (1 if closed_form else len(sensitivities))))


def _group_conversion_epsilon(delta_one: callable, group_size: int, delta: float) -> float:
  """k·ε₁ with k·e^{(k−1)ε₁}·δ₁(ε₁) ≤ δ (Vadhan 2017, Lemma 2.2). Comparison only."""
  k = group_size

  def delta_group(eps):
    d1 = delta_one(eps)
    if d1 <= 0:
      return 0.0
    return math.exp(min(700.0, math.log(k) + (k - 1) * eps + math.log(d1)))

  return k * balls_and_bins.smallest_epsilon(delta_group, delta)


# ---------------------------------------------------------------------------------------------
# The accountant
# ---------------------------------------------------------------------------------------------


class Accountant:
  """ε(step) for one run: a sampler, σ, δ, the cap B and the group size k.

  Build it with `make_accountant(config, N)` from the training config; the
  constructor is for callers that already hold a sampler (the CLI, tests).
  """

  def __init__(self, sampler: samplers_lib.Sampler, noise_multiplier: float, delta: float, *,
               accountant: str = 'auto', max_batch_size: int | None = None,
               group_size: int = 1, num_steps: int | None = None,
               monte_carlo_samples: int | None = None, beta: float = 1e-3,
               monte_carlo_seed: int = 0, monte_carlo_workers: int | None = None,
               monte_carlo_estimate: bool = False,
               random_allocation: bool | None = None,
               value_discretization_interval: float | None = None,
               pld_coarsening: float = 1.0,
               exact_truncation: bool = True,
               random_allocation_timeout: float | None = balls_and_bins.RANDOM_ALLOCATION_TIMEOUT,
               max_grid_points: int = MAX_GRID_POINTS):
    """Validates everything before any computation.

    Args:
      sampler: the run's sampler (`samplers.make_sampler`).
      noise_multiplier: σ > 0.
      delta: δ in (0, 1).
      accountant: 'auto', 'pld', 'rdp' or 'monte_carlo' (the sampler class's `accountants`).
      max_batch_size: B, the cap on the logical batch; None = never truncated.
      group_size: k >= 1 (add/remove up to k examples).
      num_steps: the planned run length (used by `final_report`), optional.
      monte_carlo_samples: samples per direction of the Monte-Carlo estimate; None =
        chosen from δ and β so that an estimate exists (`monte_carlo.default_num_samples`).
      beta: the Monte-Carlo failure probability (confidence 1 − β).
      monte_carlo_seed: its seed (fixed, so reports are reproducible).
      monte_carlo_workers: processes drawing its samples (this one included); None = the
        cores available to this process. The estimate does not depend on it.
      monte_carlo_estimate: also compute the Monte-Carlo estimate beside the provable balls-and-bins
        ε when `estimates` are asked for (opt-in: at δ = 1e-5 it needs ~1e6 samples per
        direction, minutes at T = 1000); accountant='monte_carlo' always computes it.
      random_allocation: force (True, no time limit) / skip (False) random-allocation PLD
        for balls-and-bins; None = attempt it within `random_allocation_timeout` seconds
        per new one-epoch PLD (cached on disk), else the labelled deterministic fallback.
      value_discretization_interval: PLD discretisation (pessimistic rounding);
        None = VALUE_DISCRETIZATION, or MOG_VALUE_DISCRETIZATION for mixtures
        of more than two Gaussians.
      pld_coarsening: multiplies the discretisation (calibration searches with
        10: a looser but still valid upper bound, then checks at 1).
      exact_truncation: for Poisson with a cap B, also compute dp_accounting's
        exact truncated event when the TV penalty is not negligible (slow:
        ~10-20 s per query); False keeps the TV penalty alone (valid, looser).
      max_grid_points: refuse (GridTooLargeError, before allocating) a per-step
        PLD of more grid points × mixture components (`estimate_pld_grid_points`).
    """
    if not isinstance(sampler, samplers_lib.Sampler):
      raise TypeError(f'sampler must be a dpjax.samplers.Sampler, got {type(sampler)}.')
    self.sampler = sampler
    self.noise_multiplier = sampler_events.check_noise_multiplier(noise_multiplier)
    self.delta = _check_delta(delta)
    self.group_size = sampler_events.check_positive_int('privacy.group_size', group_size)
    if self.group_size > sampler.num_examples:
      raise ValueError(f'privacy.group_size = {group_size} must be in [1, N = '
                       f'{sampler.num_examples}].')
    self.accountant = resolve_accountant(sampler.name, accountant, self.group_size)
    if max_batch_size is not None:
      sampler_events.check_positive_int('sampler.max_batch_size', max_batch_size)
      if not sampler.binomial_batch_size and max_batch_size < sampler.batch_size:
        raise ValueError(
            f'sampler.max_batch_size = {max_batch_size} must be >= sampler.batch_size = '
            f'{sampler.batch_size} for the {sampler.name} sampler (its batches are never '
            f'larger than b, and truncating every batch is not accounted).')
    self.max_batch_size = max_batch_size
    self.num_steps = (None if num_steps is None else
                      sampler_events.check_positive_int('num_steps', num_steps))
    self.monte_carlo_samples = (None if monte_carlo_samples is None else sampler_events
                                .check_positive_int('monte_carlo_samples', monte_carlo_samples))
    if not (isinstance(beta, (int, float)) and 0 < beta < 1):
      raise ValueError(f'beta must be in (0, 1), got {beta!r}.')
    self.beta = float(beta)
    self.monte_carlo_seed = monte_carlo_seed
    self.monte_carlo_workers = (monte_carlo.available_cores() if monte_carlo_workers is None
                                else sampler_events.check_positive_int('monte_carlo_workers',
                                                                       monte_carlo_workers))
    self.monte_carlo_estimate = bool(monte_carlo_estimate)
    if random_allocation_timeout is not None and not (
        isinstance(random_allocation_timeout, (int, float)) and random_allocation_timeout > 0):
      raise ValueError(f'random_allocation_timeout must be None (no limit) or seconds > 0, got '
                       f'{random_allocation_timeout!r}.')
    self.random_allocation = random_allocation
    if value_discretization_interval is not None and not (
        isinstance(value_discretization_interval, float) and
        0 < value_discretization_interval <= 0.1):
      raise ValueError('value_discretization_interval must be None or a float in (0, 0.1], '
                       f'got {value_discretization_interval!r}.')
    if not (isinstance(pld_coarsening, (int, float)) and 1 <= pld_coarsening <= 100):
      raise ValueError(f'pld_coarsening must be in [1, 100], got {pld_coarsening!r}.')
    self.value_discretization_interval = value_discretization_interval
    self.pld_coarsening = float(pld_coarsening)
    self.exact_truncation = bool(exact_truncation)
    self.random_allocation_timeout = random_allocation_timeout
    self.max_grid_points = sampler_events.check_positive_int('max_grid_points', max_grid_points)
    self._step_plds: dict[Any, pld_lib.PrivacyLossDistribution] = {}
    self._reports: dict[tuple[int, bool], PrivacyReport] = {}
    self._monte_carlo: dict[tuple[int, float], monte_carlo.MonteCarloResult] = {}

  # --- derived quantities ---------------------------------------------------------------------

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

  def _log_truncation_mass(self, num_steps: int) -> float:
    """log τ = log(T·Pr[n_t > B]) for binomial batch sizes; −inf without truncation."""
    if self.max_batch_size is None or not self.sampler.binomial_batch_size:
      return -math.inf
    return balls_and_bins.log_truncation_mass(
        self.sampler.num_examples, self.sampling_probability, self.max_batch_size, num_steps,
        group_size=self.group_size)

  def _pld(self, event: dp_event.DpEvent, count: int) -> pld_lib.PrivacyLossDistribution:
    key = repr(event)
    if key in self._step_plds:
      return self._step_plds[key].self_compose(count)
    interval = self._interval(event)
    self._check_grid(event, interval)
    with progress_bar(2, f'PLD of one {self.sampler.name} step, then {count} steps') as bar:
      self._step_plds[key] = _step_pld(event, interval)
      bar.update()
      composed = self._step_plds[key].self_compose(count)
      bar.update()
    return composed

  def _check_grid(self, event: dp_event.DpEvent, interval: float) -> None:
    points = estimate_pld_grid_points(event, interval)
    if points is None or points <= self.max_grid_points:
      return
    sensitivities = _mixture_components(event)[1]
    hints = ['raise σ (privacy.noise_multiplier)']
    if self.group_size > 1:
      hints.insert(0, f'lower privacy.group_size = {self.group_size}')
    if self.sampler.name == 'fixed_size_with_replacement':
      hints.append('use sampler fixed_size (without replacement: a 2-component mixture)')
    hints.append(f'coarsen value_discretization_interval (now {interval:g})')
    raise GridTooLargeError(
        f'the privacy-loss distribution of one {self.sampler.name} step (σ = '
        f'{self.noise_multiplier:.4g}, {len(sensitivities)} mixture components, sensitivity up '
        f'to {max(sensitivities):g}) needs ~{points:.3g} grid points × components, '
        f'above max_grid_points = {self.max_grid_points:.3g} (minutes and GBs of memory). '
        f'To fix: {"; ".join(hints)}; or raise max_grid_points.')

  def _interval(self, event: dp_event.DpEvent) -> float:
    interval = self.value_discretization_interval
    if interval is None:
      many = isinstance(event, dp_event.MixtureOfGaussiansDpEvent) and len(event.sensitivities) > 2
      interval = MOG_VALUE_DISCRETIZATION if many else VALUE_DISCRETIZATION
    return min(0.1, interval * self.pld_coarsening)

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

  def _report(self, unit: int, epsilon: float, details: dict, **kwargs) -> PrivacyReport:
    details = dict(details)
    details.setdefault('group_size', self.group_size)
    details.setdefault('num_examples', self.sampler.num_examples)
    details.setdefault('batch_size', self.sampler.batch_size)
    details.setdefault('sampling_probability', self.sampling_probability)
    details['max_batch_size'] = self.max_batch_size
    if self.is_epoch_based:
      details['epochs_accounted'] = unit
    kwargs.setdefault('bound', 'upper')
    return PrivacyReport(
        epsilon=float(epsilon), delta=self.delta, accountant=self.accountant,
        sampler=self.sampler.name, noise_multiplier=self.noise_multiplier,
        steps=unit, steps_per_epoch=self.steps_per_epoch, details=details, **kwargs)

  def _compute(self, unit: int, estimates: bool) -> PrivacyReport:
    if unit == 0:
      return self._report(0, 0.0, {'method': 'nothing released yet'})
    name = self.sampler.name
    if name == 'poisson':
      return self._poisson(unit, estimates)
    if name == 'fixed_size':
      return self._fixed_size(unit, estimates)
    if name == 'fixed_size_with_replacement':
      return self._fixed_size_with_replacement(unit, estimates)
    if name == 'deterministic':
      return self._deterministic(unit)
    if name == 'shuffle':
      return self._shuffle(unit, estimates)
    return self._balls_and_bins(unit, estimates)

  def _poisson(self, steps: int, estimates: bool) -> PrivacyReport:
    q, sigma = self.sampling_probability, self.noise_multiplier
    k, delta = self.group_size, self.delta
    event = sampler_events.poisson_step_event(q, sigma, group_size=k)
    log_tau = self._log_truncation_mass(steps)
    tau = math.exp(log_tau)
    details: dict[str, Any] = {'truncation_mass': tau}
    if self.max_batch_size is None:
      details['truncation'] = 'none (no max_batch_size)'
    if self.accountant == 'rdp':
      rdp = rdp_privacy_accountant.RdpAccountant()
      rdp.compose(event, steps)
      if tau == 0:
        eps = rdp.get_epsilon(delta)
        details['method'] = 'rdp(poisson_subsampled_gaussian)'
      else:
        eps = balls_and_bins.smallest_epsilon(rdp.get_delta, delta, penalty_mass=tau)
        details['method'] = 'rdp(poisson_subsampled_gaussian) + tv_truncation_penalty'
      if estimates:
        details['pld_epsilon'] = self._poisson_pld(event, steps, tau)[0]
      return self._report(steps, eps, details)
    eps, method, extra = self._poisson_pld(event, steps, tau)
    details.update(extra, method=method)
    if estimates:
      if k == 1:
        rdp = rdp_privacy_accountant.RdpAccountant()
        rdp.compose(event, steps)
        details['rdp_epsilon'] = balls_and_bins.smallest_epsilon(rdp.get_delta, delta,
                                                                 penalty_mass=tau)
      else:
        one = self._pld(sampler_events.poisson_step_event(q, sigma), steps)
        details['group_conversion_epsilon_comparison_only'] = _group_conversion_epsilon(
            one.get_delta_for_epsilon, k, delta)
    return self._report(steps, eps, details)

  def _poisson_pld(self, event, steps: int, tau: float) -> tuple[float, str, dict]:
    delta = self.delta
    composed = self._pld(event, steps)
    if tau == 0:
      return float(composed.get_epsilon_for_delta(delta)), 'pld', {}
    eps_tv = balls_and_bins.smallest_epsilon(composed.get_delta_for_epsilon, delta,
                                             penalty_mass=tau)
    extra = {'tv_truncation_epsilon': eps_tv}
    penalty = (1 + math.exp(eps_tv)) * tau if math.isfinite(eps_tv) else math.inf
    if self.group_size > 1 or not self.exact_truncation or penalty <= _NEGLIGIBLE_PENALTY * delta:
      return eps_tv, 'pld + tv_truncation_penalty', extra
    # The exact truncated event, for the dataset holding the sensitive example: N (remove)
    # and N + 1 (add); the worse of the two covers both directions.
    exact = max(
        float(self._pld(sampler_events.truncated_poisson_step_event(
            n, self.sampling_probability, self.max_batch_size, self.noise_multiplier),
                        steps).get_epsilon_for_delta(delta))
        for n in (self.sampler.num_examples, self.sampler.num_examples + 1))
    extra['truncated_event_epsilon'] = exact
    if exact <= eps_tv:
      return exact, 'pld(truncated_subsampled_gaussian)', extra
    return eps_tv, 'pld + tv_truncation_penalty', extra

  def _fixed_size(self, steps: int, estimates: bool) -> PrivacyReport:
    n, b, sigma, k, delta = (self.sampler.num_examples, self.sampler.batch_size,
                             self.noise_multiplier, self.group_size, self.delta)
    details: dict[str, Any] = {}
    pld_eps = fs_rdp_eps = None
    if self.accountant == 'pld' or estimates:
      event = sampler_events.fixed_size_step_event(n, b, sigma, group_size=k)
      pld_eps = float(self._pld(event, steps).get_epsilon_for_delta(delta))
    if k == 1 and b < n and (self.accountant == 'rdp' or estimates):
      fs_rdp_eps, order = fixed_size_rdp.fixed_size_rdp_epsilon(b / n, sigma, steps, delta)
      details['fs_rdp_order'] = order
    elif self.accountant == 'rdp':
      raise ValueError(f'FS-RDP needs q = b/N < 1, got b = N = {n}; use accountant pld.')
    if self.accountant == 'pld':
      eps = pld_eps
      details['method'] = 'pld(mixture_of_gaussians[0,2])' if k == 1 else \
          'pld(mixture_of_gaussians, hypergeometric group)'
      if fs_rdp_eps is not None:
        details['fs_rdp_epsilon'] = fs_rdp_eps
    else:
      eps = fs_rdp_eps
      details['method'] = 'fs_rdp(birrell_et_al_2024, add/remove, integer orders)'
      if pld_eps is not None:
        details['pld_epsilon'] = pld_eps
    if estimates and k == 1:
      wor = rdp_privacy_accountant.RdpAccountant(
          neighboring_relation=rdp_privacy_accountant.NeighborRel.REPLACE_ONE)
      wor.compose(sampler_events.sampled_without_replacement_rdp_event(n, b, sigma), steps)
      details['wang_et_al_rdp_replace_one_epsilon'] = float(wor.get_epsilon(delta))
    if estimates and k > 1:
      one = self._pld(sampler_events.fixed_size_step_event(n, b, sigma), steps)
      details['group_conversion_epsilon_comparison_only'] = _group_conversion_epsilon(
          one.get_delta_for_epsilon, k, delta)
    return self._report(steps, eps, details)

  def _fixed_size_with_replacement(self, steps: int, estimates: bool) -> PrivacyReport:
    n, b, sigma, k, delta = (self.sampler.num_examples, self.sampler.batch_size,
                             self.noise_multiplier, self.group_size, self.delta)
    event = sampler_events.fixed_size_with_replacement_step_event(n, b, sigma, group_size=k)
    eps = float(self._pld(event, steps).get_epsilon_for_delta(delta))
    details: dict[str, Any] = {
        'method': 'pld(mixture_of_gaussians[0,2,...,2b], binomial(b, k/N))'}
    if estimates and k > 1:
      one = self._pld(sampler_events.fixed_size_with_replacement_step_event(n, b, sigma), steps)
      details['group_conversion_epsilon_comparison_only'] = _group_conversion_epsilon(
          one.get_delta_for_epsilon, k, delta)
    return self._report(steps, eps, details)

  def _epoch_gaussian(self, epochs: int) -> tuple[float, str]:
    """Deterministic-order ε of `epochs` epochs (exact with 'pld', RDP with 'rdp')."""
    if self.accountant == 'rdp':
      rdp = rdp_privacy_accountant.RdpAccountant()
      rdp.compose(sampler_events.epoch_gaussian_event(self.noise_multiplier,
                                                      group_size=self.group_size), epochs)
      return float(rdp.get_epsilon(self.delta)), 'rdp(gaussian per epoch)'
    return (balls_and_bins.deterministic_epsilon(self.noise_multiplier, epochs, self.delta,
                                                 group_size=self.group_size),
            'gaussian per epoch (exact)')

  def _deterministic(self, epochs: int) -> PrivacyReport:
    eps, method = self._epoch_gaussian(epochs)
    return self._report(epochs, eps, {'method': method})

  def _shuffle(self, epochs: int, estimates: bool) -> PrivacyReport:
    eps, method = self._epoch_gaussian(epochs)
    details: dict[str, Any] = {
        'method': f'deterministic upper bound: {method} (joint convexity; no tight shuffle '
                  f'accountant is known)'}
    lower = None
    if estimates:
      lower = max_test.shuffle_lower_bound_epsilon(
          self.noise_multiplier, self.steps_per_epoch, self.delta, num_epochs=epochs)
      details['lower_bound_method'] = 'max test on the Chua et al. 2024a shuffle pair'
      poisson = self._pld(sampler_events.poisson_step_event(
          self.sampler.batch_size / self.sampler.num_examples, self.noise_multiplier,
          group_size=self.group_size), epochs * self.steps_per_epoch)
      details['as_if_poisson_not_a_guarantee'] = float(poisson.get_epsilon_for_delta(self.delta))
    return self._report(epochs, eps, details, epsilon_lower=lower)

  def _balls_and_bins(self, epochs: int, estimates: bool) -> PrivacyReport:
    sigma, steps_per_epoch, delta, k = (self.noise_multiplier, self.steps_per_epoch, self.delta,
                                        self.group_size)
    log_tau = self._log_truncation_mass(epochs * steps_per_epoch)
    tau = math.exp(log_tau)
    # The Monte-Carlo accountant's ε needs only the deterministic bound (for δ₀); the costly
    # random-allocation PLD is then computed only when the estimates beside ε are asked for.
    skip_ra = self.accountant == 'monte_carlo' and not estimates
    provable = balls_and_bins.provable_epsilon(
        sigma, steps_per_epoch, delta, num_epochs=epochs, group_size=k, log_penalty_mass=log_tau,
        random_allocation=False if skip_ra else self.random_allocation,
        timeout=self.random_allocation_timeout, lower=estimates)
    details: dict[str, Any] = {
        'provable_epsilon': provable.epsilon,
        'provable_method': provable.method,
        'deterministic_epsilon': provable.deterministic_epsilon,
        'random_allocation_upper': provable.random_allocation_upper,
        'random_allocation_lower': provable.random_allocation_lower,
        'random_allocation_grid': provable.discretization,
        'truncation_mass': tau,
    }
    if self.max_batch_size is None:
      details['truncation'] = 'none (no max_batch_size)'
    want_mc = self.accountant == 'monte_carlo' or (
        estimates and self.monte_carlo_estimate and k == 1)
    mc = None
    if want_mc and provable.delta0 > 0:
      try:
        mc = self._monte_carlo_epsilon(epochs, provable.delta0)
      except ValueError as e:  # e.g. too few samples for this δ.
        if self.accountant == 'monte_carlo':
          raise
        details['monte_carlo_error'] = str(e)
    if mc is not None:
      # With truncation, δ₀ assumed ε ≤ ε_det; the deterministic bound is valid regardless.
      mc_eps = min(mc.epsilon, provable.deterministic_epsilon)
      details.update({
          'monte_carlo_epsilon_high_probability': mc_eps,
          'monte_carlo_label': f'high-probability upper bound (holds with probability >= '
                               f'{mc.confidence} over the sampling), not a proof',
          'monte_carlo_epsilon_point_estimate_not_a_guarantee': mc.epsilon_point,
          'monte_carlo_method': mc.method,
          'monte_carlo_seed': mc.seed,
      })
    elif k > 1:
      details['monte_carlo'] = 'not computed: it covers group_size = 1 only'
    elif estimates and not want_mc:
      m = monte_carlo.default_num_samples(sigma, steps_per_epoch, provable.delta0, self.beta,
                                          num_epochs=epochs)
      seconds = monte_carlo.estimated_seconds(m, steps_per_epoch, epochs,
                                              self.monte_carlo_workers)
      details['monte_carlo'] = (
          f'not computed (opt-in: Accountant(monte_carlo_estimate=True) or python -m dpjax.account '
          f'--monte-carlo): it would draw {m} samples per direction, about {seconds:.0f} s on '
          f'{self.monte_carlo_workers} core(s)')
    lower = None
    if estimates:
      delta_low = delta + (1 + math.exp(provable.epsilon)) * tau if math.isfinite(
          provable.epsilon) else 1.0
      lower = 0.0
      if delta_low < 1:
        lower = max_test.balls_and_bins_lower_bound_epsilon(sigma, steps_per_epoch, delta_low,
                                                            num_epochs=epochs)
      details['max_test_lower_bound'] = lower
      if tau == 0 and provable.random_allocation_lower is not None and k == 1:
        lower = max(lower, provable.random_allocation_lower)
    extra: dict[str, Any] = {'epsilon_lower': lower}
    if mc is not None:
      extra.update(confidence=mc.confidence, num_samples=mc.num_samples)
    if self.accountant == 'monte_carlo':
      details['method'] = 'monte_carlo (Chua et al. 2025, Algorithms 4-6)'
      return self._report(epochs, details['monte_carlo_epsilon_high_probability'],
                          details, bound='high_probability_upper', **extra)
    details['method'] = provable.method
    return self._report(epochs, provable.epsilon, details, **extra)

  def _monte_carlo_epsilon(self, epochs: int, delta0: float) -> monte_carlo.MonteCarloResult:
    key = (epochs, delta0)
    if key not in self._monte_carlo:
      self._monte_carlo[key] = monte_carlo.balls_and_bins_epsilon(
          self.noise_multiplier, self.steps_per_epoch, delta0, num_epochs=epochs,
          num_samples=self.monte_carlo_samples, beta=self.beta, seed=self.monte_carlo_seed,
          workers=self.monte_carlo_workers)
    return self._monte_carlo[key]


# ---------------------------------------------------------------------------------------------
# From the training config
# ---------------------------------------------------------------------------------------------


def make_accountant(config: ml_collections.ConfigDict, num_examples: int,
                    **kwargs) -> Accountant:
  """The accountant of the run that `config` trains on `num_examples` examples.

  `dpjax.plan.make_plan(config, N).accountant`: the one place where a config
  is resolved (sampler, cap B, σ given or calibrated to
  `privacy.target_epsilon`, the budget check), so training and every CLI
  account for the same run. σ = None calibrates; σ <= 0, C <= 0 or C = inf
  are refused (set `privacy.enabled = False` to train without privacy).
  `privacy.monte_carlo_workers` (None: the available cores) is the number of
  processes of the Monte-Carlo estimate; `privacy.random_allocation_timeout`
  (seconds) the budget of the balls-and-bins random-allocation bound.

  Args:
    config: the training config.
    num_examples: N.
    **kwargs: passed to `Accountant` (e.g. monte_carlo_samples, beta); they
      override the config (monte_carlo_workers).
  """
  if not config.privacy.enabled:
    raise ValueError('privacy.enabled is False: a non-private run has no ε to account.')
  from dpjax import plan as plan_lib  # pylint: disable=g-import-not-at-top
  return plan_lib.make_plan(config, num_examples, accountant_options=kwargs).accountant
