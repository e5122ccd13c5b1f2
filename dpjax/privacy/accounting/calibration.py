"""Calibration: the smallest σ for a target (ε, δ), the largest run for a given σ.

docs/accounting.md §6. The searches themselves (bracket and bisect, returning the end at
which the target holds) are `target_search`'s; the σ search's ε(σ) here is the accountant's,
and the calibrated σ of every recorded run stays as it was.

PLD accountants search with a cheaper grid first (`pld_grid`'s first jump,
unconfirmed; a coarser pessimistic PLD is still an upper bound, just looser),
then search again with the reporting rule in a narrow bracket; the final σ is always checked with the rule that reports it, so
it meets the target at the grid the report names.

Monte-Carlo (balls-and-bins, accountant='monte_carlo'): inside the search the
sampler seed is fixed (a seed derived from, but different from, the report's)
so ε(σ) is a deterministic monotone function; the final ε is then computed
with the report's own seed, and σ is raised in 0.5% steps until that fresh
estimate meets the target, so the returned σ is never selected on the
samples that certify it.
"""

from __future__ import annotations

import math
from typing import Callable

from dpjax.privacy import samplers as samplers_lib
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import max_test
from dpjax.privacy.accounting import sampler_events
from dpjax.privacy.accounting import step_pld
from dpjax.privacy.accounting import target_search
from dpjax.privacy.accounting import truncation_cap

# ε(σ) within this relative distance below the target ends the σ search (public: a calibrated
# σ's ε lies within it below the target).
DEFAULT_EPSILON_RTOL = target_search.DEFAULT_EPSILON_RTOL
_SEARCH_SEED_OFFSET = 0x5EED


def _coarse_search_is_safe(sampler: samplers_lib.Sampler, accountant: str, group_size: int) -> bool:
  """PLD accountants refine their grid until ε moves by < 0.1 % (`pld_grid`); with coarsening
  10 they stop at the first jump, unconfirmed: every search value is a valid bound within a
  few 0.1 % of the reported one, whatever the mixture."""
  del group_size
  return accountant_lib.resolve_accountant(sampler.name, accountant) == 'pld'


def calibrate_noise_multiplier(
  sampler: samplers_lib.Sampler,
  target_epsilon: float,
  delta: float,
  num_steps: int,
  *,
  sensitivity: float = 1.0,
  **kwargs,
) -> float:
  """`_calibrate_noise_multiplier` with a progress bar (stderr, a terminal, after 10 s).

  sensitivity: 1 + η (`Accountant(sensitivity=...)`). Every analysis sees σ/(1 + η) only, so
  the search runs at sensitivity 1 and returns (1 + η)·σ₀, checked by the accountant at 1 + η
  (and raised in 0.05% steps if σ/(1 + η), a float, lands on the other side of a PLD grid
  point than σ₀).
  """
  key = _memo_key(sampler, target_epsilon, delta, num_steps, sensitivity, kwargs)
  sigma = CALIBRATED.get(key) if key is not None else None
  if sigma is None:
    sigma = _calibrate_at_sensitivity(
      sampler, target_epsilon, delta, num_steps, sensitivity, **kwargs
    )
    if key is not None:
      CALIBRATED.put(key, sigma)
  return sigma


# Calibrated σ per (sampler, target, δ, steps, sensitivity, options), for every caller of the
# process (the planner's rows and `dpjax.train`'s plan of the same run, a CLI asked twice):
# the search is deterministic in these, so the memo returns the σ it would compute again
# (tests/privacy/accounting/test_accounting_memos.py). Random allocation is never kept: its
# PLD builds are bounded by seconds, not by its inputs.
CALIBRATED = step_pld.KeptPLDs(256)
_PLAIN = (type(None), bool, int, float, str)


def _memo_key(sampler, target_epsilon, delta, num_steps, sensitivity, kwargs) -> tuple | None:
  """The exact key of a calibration (the sampler compares every field), or None: not kept."""
  values = (target_epsilon, delta, num_steps, sensitivity, *kwargs.values())
  if (
    sampler.analysis == 'random_allocation'
    or kwargs.get('accountant') == 'monte_carlo'
    or not all(type(v) in _PLAIN for v in values)
  ):
    return None
  plain = lambda v: (type(v).__name__, v)  # 1 and 1.0 and True are three keys.
  key = (
    sampler,
    *map(plain, (target_epsilon, delta, num_steps, sensitivity)),
    tuple(sorted((k, plain(v)) for k, v in kwargs.items())),
  )
  try:
    hash(key)
  except TypeError:  # A sampler holding something unhashable: not kept.
    return None
  return key


def _calibrate_at_sensitivity(
  sampler: samplers_lib.Sampler,
  target_epsilon: float,
  delta: float,
  num_steps: int,
  sensitivity: float,
  **kwargs,
) -> float:
  """`calibrate_noise_multiplier`, computed (not read from the memo)."""
  with step_pld.progress_bar(
    None, f'calibrating σ for ε = {target_epsilon} ({sampler.name})'
  ) as bar:
    sigma = _calibrate_noise_multiplier(
      sampler, target_epsilon, delta, num_steps, bar=bar, **kwargs
    )
  if sensitivity == 1:
    return sigma
  options = {k: v for k, v in kwargs.items() if k not in ('num_steps', 'pld_coarsening')}
  sigma *= sensitivity
  for _ in range(100):
    if (
      accountant_lib.Accountant(sampler, sigma, delta, sensitivity=sensitivity, **options).epsilon(
        num_steps
      )
      <= target_epsilon
    ):
      return sigma
    sigma *= 1.0005
  raise RuntimeError(f'calibration at sensitivity {sensitivity} did not meet the target.')


def _calibrate_noise_multiplier(
  sampler: samplers_lib.Sampler,
  target_epsilon: float,
  delta: float,
  num_steps: int,
  *,
  bar,
  accountant: str = 'auto',
  monte_carlo_seed: int = 0,
  **kwargs,
) -> float:
  """The smallest σ whose attached ε after `num_steps` steps is <= target_epsilon.

  Args:
    sampler: the run's sampler.
    target_epsilon: ε target.
    delta: δ.
    num_steps: steps of the run.
    accountant: as in `Accountant`.
    monte_carlo_seed: the report's Monte-Carlo seed (see the module docstring).
    bar: a tqdm bar, advanced once per ε evaluated.
    **kwargs: other `Accountant` options (max_batch_size, group_size, ...).

  Returns:
    σ with `Accountant(sampler, σ, ...).epsilon(num_steps) <= target_epsilon`.
  """
  target = target_search.check_target_epsilon(target_epsilon)
  steps = sampler_events.check_positive_int('num_steps', num_steps)
  kwargs.pop('num_steps', None)
  kwargs.pop('pld_coarsening', None)
  exact_truncation = kwargs.pop('exact_truncation', True)
  # Validates every argument once, before any search.
  accountant_lib.Accountant(
    sampler, 1.0, delta, accountant=accountant, monte_carlo_seed=monte_carlo_seed, **kwargs
  )
  group_size = kwargs.get('group_size', 1)
  resolved = accountant_lib.resolve_accountant(sampler.name, accountant, group_size)
  truncation_cap.check_truncation_cap(
    sampler, target, delta, steps, kwargs.get('max_batch_size'), group_size
  )

  def epsilon_fn(coarsening, seed, exact):
    return _epsilon_of_sigma(
      sampler,
      delta,
      steps,
      bar,
      accountant=accountant,
      monte_carlo_seed=seed,
      pld_coarsening=coarsening,
      exact_truncation=exact,
      **kwargs,
    )

  # Search stage: cheap and still valid upper bounds (coarser PLD, truncation by the TV
  # penalty alone, a search seed for Monte Carlo).
  monte_carlo = resolved == 'monte_carlo'
  coarse = not monte_carlo and _coarse_search_is_safe(sampler, accountant, group_size)
  search = epsilon_fn(
    10.0 if coarse else 1.0, monte_carlo_seed + (_SEARCH_SEED_OFFSET if monte_carlo else 0), False
  )
  search, bracket = _search_bracket(
    search, sampler, resolved, target, delta, steps, group_size, kwargs.get('random_allocation')
  )
  initial = _initial_sigma(sampler, resolved, target, delta, steps, accountant, kwargs)
  sigma = target_search.smallest_noise_multiplier(search, target, initial=initial, bracket=bracket)
  # Final stage: the accountant exactly as it will report.
  report_fn = epsilon_fn(1.0, monte_carlo_seed, exact_truncation)
  if monte_carlo:
    for _ in range(100):
      if report_fn(sigma) <= target:
        return sigma
      sigma *= 1.005
    raise RuntimeError('Monte-Carlo calibration did not meet the target with a fresh seed.')
  return target_search.smallest_noise_multiplier(
    report_fn, target, initial=sigma, lower=sigma * 0.995
  )


def _epsilon_of_sigma(
  sampler, delta: float, steps: int, bar, **accountant_kwargs
) -> Callable[[float], float]:
  """σ -> the ε after `steps` steps of `Accountant(sampler, σ, delta, **accountant_kwargs)`."""

  def epsilon_of_sigma(sigma):
    acct = accountant_lib.Accountant(sampler, sigma, delta, **accountant_kwargs)
    try:
      eps = acct.epsilon(steps)
    except step_pld.GridTooLargeError:
      # Grids widen as σ falls: this σ is too small to account, so search above it. The
      # returned σ is always one whose ε was computed and meets the target.
      eps = math.inf
    bar.set_postfix_str(f'σ = {sigma:.4g}: ε = {eps:.4g}', refresh=False)
    bar.update()
    return eps

  return epsilon_of_sigma


def _search_bracket(
  search,
  sampler,
  resolved: str,
  target: float,
  delta: float,
  steps: int,
  group_size: int,
  random_allocation,
):
  """(search, provable (lo, hi) or None) for samplers with a random-allocation bracket.

  The exact deterministic σ is an upper end (ε_det ≥ ε), the σ where the max-test lower
  bound meets the target a lower end; random allocation and Monte Carlo are then evaluated
  only inside it (random allocation in a narrower bracket, on a memoised `search`).
  """
  if not (
    sampler.random_allocation_bracket
    and group_size == 1
    and (resolved == 'monte_carlo' or random_allocation is not False)
  ):
    return search, None
  steps_per_epoch, epochs = sampler.steps_per_epoch, -(-steps // sampler.steps_per_epoch)
  hi = target_search.smallest_noise_multiplier(
    lambda s: balls_and_bins.deterministic_epsilon(s, epochs, delta), target, epsilon_rtol=1e-6
  )
  lo = target_search.smallest_noise_multiplier(
    lambda s: max_test.balls_and_bins_lower_bound_epsilon(
      s, steps_per_epoch, delta, num_epochs=epochs
    ),
    target,
    initial=hi,
    epsilon_rtol=1e-2,
  )
  bracket = (lo * 0.99, hi)
  if resolved != 'monte_carlo':
    search = _memoised(search)
    bracket = _random_allocation_bracket(search, sampler, target, delta, epochs, bracket)
  return search, bracket


def _initial_sigma(
  sampler, resolved: str, target: float, delta: float, steps: int, accountant: str, kwargs: dict
) -> float:
  """Where the σ search starts: 1, except for PLDs of many-Gaussian mixtures (slow to build at
  small σ), whose ε is at least that of the example-level / without-replacement event
  (`sampler.calibration_base()`): its σ, found fast."""
  group_size = kwargs.get('group_size', 1)
  if resolved == 'pld' and (
    sampler.many_component_pld or (group_size > 1 and sampler.coarse_pld_search)
  ):
    base = sampler.calibration_base()
    base_kwargs = dict(kwargs, group_size=1)
    return calibrate_noise_multiplier(
      base, target, delta, steps, accountant=accountant, **base_kwargs
    )
  return 1.0


def _memoised(fn: Callable[[float], float]) -> Callable[[float], float]:
  cache: dict[float, float] = {}

  def wrapped(x):
    if x not in cache:
      cache[x] = fn(x)
    return cache[x]

  return wrapped


def _random_allocation_bracket(
  epsilon_of_sigma,
  sampler,
  target: float,
  delta: float,
  epochs: int,
  bracket: tuple[float, float],
  epsilon_rtol: float = DEFAULT_EPSILON_RTOL,
  max_evaluations: int = 12,
) -> tuple[float, float]:
  """(lo, hi) with ε(lo) > target ≥ ε(hi), hi close to the answer, for balls-and-bins.

  Each ε(σ) builds a one-epoch random-allocation PLD (costly), so the search starts from the
  σ of Poisson sampling with q = 1/T over the same steps (dp_accounting, cheap):
  balls-and-bins is within a few percent of Poisson at moderate σ but can be worse at small σ
  (Chua et al. 2025), so that σ is a first guess, not a bracket end. Then secant
  steps on log ε vs log σ (slope −1 at first, as for the Gaussian mechanism), aimed just
  below the target and kept strictly inside the best bracket known, which starts as the
  provable `bracket` (deterministic σ above, max-test σ below).
  """
  lo, hi = bracket  # ε(lo) > target ≥ ε(hi) (provable)
  poisson = samplers_lib.PoissonSampler(
    num_examples=sampler.num_examples, batch_size=sampler.batch_size
  )
  sigma = calibrate_noise_multiplier(
    poisson, target, delta, epochs * sampler.steps_per_epoch, max_batch_size=None
  )
  sigma = min(max(sigma, lo * 1.001), hi)
  aim, slope, last = target * (1 - epsilon_rtol / 2), -1.0, None
  for _ in range(max_evaluations):
    eps = epsilon_of_sigma(sigma)
    if eps <= target:
      hi = sigma
      if eps >= target * (1 - epsilon_rtol):
        break
    else:
      lo = sigma
    if last is not None and sigma != last[0] and math.isfinite(eps) and math.isfinite(last[1]):
      fitted = math.log(eps / last[1]) / math.log(sigma / last[0])
      slope = fitted if fitted < -0.05 else slope
    last = (sigma, eps)
    step = (
      math.exp((math.log(aim) - math.log(eps)) / slope) if math.isfinite(eps) and eps > 0 else 2.0
    )
    proposal = sigma * step
    if not lo < proposal < hi:
      proposal = math.sqrt(lo * hi)
    sigma = proposal
  return lo, hi


def max_num_steps(
  sampler: samplers_lib.Sampler,
  noise_multiplier: float,
  target_epsilon: float,
  delta: float,
  *,
  max_steps: int = 10**7,
  **kwargs,
) -> int:
  """The largest number of steps whose attached ε stays <= target_epsilon.

  Epoch-based samplers are accounted per epoch started, so the answer is a
  whole number of epochs. Returns 0 if even one step (epoch) exceeds it.
  """
  target = target_search.check_target_epsilon(target_epsilon)
  kwargs.pop('num_steps', None)
  acct = accountant_lib.Accountant(sampler, noise_multiplier, delta, **kwargs)
  if acct.is_epoch_based:
    per_epoch = acct.steps_per_epoch
    epochs = target_search.largest_count(
      lambda e: acct.epsilon(e * per_epoch), target, max_count=max(1, max_steps // per_epoch)
    )
    return epochs * per_epoch
  return target_search.largest_count(acct.epsilon, target, max_count=max_steps)
