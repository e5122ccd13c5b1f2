"""The balls-and-bins analysis: the provable ε, its lower bounds and the Monte-Carlo estimate.

The provable ε is the random-allocation PLD of one epoch composed over the epochs (Feldman
and Shenfeld, "Privacy amplification by random allocation"), built within a time budget, else
the deterministic bound (`provable_bound.provable_epsilon`), labelled; a truncation at B pays
the TV penalty (1 + e^ε)·τ at its own ε. Beside it, the max-test lower bound and, opt-in or as
the 'monte_carlo' accountant, the high-probability Monte-Carlo ε at δ₀ (Chua et al. 2025,
"Balls-and-bins sampling for DP-SGD"), never a proof.
"""

from __future__ import annotations

import math
from typing import Any

from dpjax.privacy.accounting import max_test
from dpjax.privacy.accounting import monte_carlo
from dpjax.privacy.accounting import provable_bound
from dpjax.privacy.accounting.accountant_view import Accountant
from dpjax.privacy.accounting.report import PrivacyReport


def random_allocation(acct: Accountant, epochs: int, estimates: bool) -> PrivacyReport:
  sigma, steps_per_epoch, delta, k = (
    acct.accounted_noise_multiplier,
    acct.steps_per_epoch,
    acct.delta,
    acct.group_size,
  )
  log_tau = acct.log_truncation_mass(epochs * steps_per_epoch)
  tau = math.exp(log_tau)
  # The Monte-Carlo accountant's ε needs only the deterministic bound (for δ₀); the costly
  # random-allocation PLD is then computed only when the estimates beside ε are asked for.
  skip_ra = acct.accountant == 'monte_carlo' and not estimates
  provable = provable_bound.provable_epsilon(
    sigma,
    steps_per_epoch,
    delta,
    num_epochs=epochs,
    group_size=k,
    log_penalty_mass=log_tau,
    random_allocation=False if skip_ra else acct.random_allocation,
    timeout=acct.random_allocation_timeout,
    lower=estimates,
  )
  details: dict[str, Any] = {
    'provable_epsilon': provable.epsilon,
    'provable_method': provable.method,
    'deterministic_epsilon': provable.deterministic_epsilon,
    'random_allocation_upper': provable.random_allocation_upper,
    'random_allocation_lower': provable.random_allocation_lower,
    'random_allocation_grid': provable.discretization,
    'truncation_mass': tau,
  }
  if acct.max_batch_size is None:
    details['truncation'] = 'none (no max_batch_size)'
  mc = _monte_carlo(acct, epochs, estimates, provable, tau, details)
  lower = None
  if estimates:
    delta_low = (
      delta + (1 + math.exp(provable.epsilon)) * tau if math.isfinite(provable.epsilon) else 1.0
    )
    lower = 0.0
    if delta_low < 1:
      lower = max_test.balls_and_bins_lower_bound_epsilon(
        sigma, steps_per_epoch, delta_low, num_epochs=epochs
      )
    details['max_test_lower_bound'] = lower
    if tau == 0 and provable.random_allocation_lower is not None and k == 1:
      lower = max(lower, provable.random_allocation_lower)
  extra: dict[str, Any] = {'epsilon_lower': lower}
  if mc is not None:
    extra.update(confidence=mc.confidence, num_samples=mc.num_samples)
  if acct.accountant == 'monte_carlo':
    details['method'] = 'monte_carlo (Chua et al. 2025, Algorithms 4-6)'
    # No δ left for the estimate (truncation penalty ≥ δ): ε = ∞, still a valid bound.
    return acct.report(
      epochs,
      details.get('monte_carlo_epsilon_high_probability', math.inf),
      details,
      bound='high_probability_upper' if mc is not None else 'upper',
      **extra,
    )
  details['method'] = provable.method
  return acct.report(epochs, provable.epsilon, details, **extra)


def _monte_carlo(
  acct: Accountant,
  epochs: int,
  estimates: bool,
  provable: provable_bound.ProvableBound,
  tau: float,
  details: dict,
) -> monte_carlo.MonteCarloResult | None:
  """The Monte-Carlo ε of balls-and-bins at δ₀ (`provable.delta0`), if asked for and possible;
  `details` gets it, or why it was not computed (and its cost when it is opt-in)."""
  sigma, steps_per_epoch, delta, k = (
    acct.accounted_noise_multiplier,
    acct.steps_per_epoch,
    acct.delta,
    acct.group_size,
  )
  want_mc = acct.accountant == 'monte_carlo' or (estimates and acct.monte_carlo_estimate and k == 1)
  mc = None
  if want_mc and provable.delta0 > 0:
    try:
      mc = acct.monte_carlo_epsilon(epochs, provable.delta0)
    except ValueError as e:  # e.g. too few samples for this δ.
      if acct.accountant == 'monte_carlo':
        raise
      details['monte_carlo_error'] = str(e)
  if mc is not None:
    # With truncation, δ₀ assumed ε ≤ ε_det; the deterministic bound is valid regardless.
    mc_eps = min(mc.epsilon, provable.deterministic_epsilon)
    details.update(
      {
        'monte_carlo_epsilon_high_probability': mc_eps,
        'monte_carlo_label': f'high-probability upper bound (holds with probability >= '
        f'{mc.confidence} over the sampling), not a proof',
        'monte_carlo_epsilon_point_estimate_not_a_guarantee': mc.epsilon_point,
        'monte_carlo_method': mc.method,
        'monte_carlo_seed': mc.seed,
      }
    )
  elif k > 1:
    details['monte_carlo'] = 'not computed: it covers group_size = 1 only'
  elif provable.delta0 <= 0:  # (1 + e^ε)·τ ≥ δ at every finite ε: ε = ∞ (a valid bound).
    details['monte_carlo'] = 'not computed: the truncation penalty leaves no δ'
    details['truncation_note'] = (
      f'the cap B = {acct.max_batch_size} truncates with probability {tau:.3g} over the run, '
      f'which alone exceeds δ = {delta:g}: ε is infinite; raise max_batch_size (0 = automatic)'
    )
  elif estimates and not want_mc:
    m = monte_carlo.default_num_samples(
      sigma, steps_per_epoch, provable.delta0, acct.beta, num_epochs=epochs
    )
    seconds = monte_carlo.estimated_seconds(m, steps_per_epoch, epochs, acct.monte_carlo_workers)
    details['monte_carlo'] = (
      f'not computed (opt-in: Accountant(monte_carlo_estimate=True) or python -m dpjax.account '
      f'--monte-carlo): it would draw {m} samples per direction, about {seconds:.0f} s on '
      f'{acct.monte_carlo_workers} core(s)'
    )
  return mc
