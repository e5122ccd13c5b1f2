"""Per-sampler analyses: (accountant, steps or epochs, estimates) -> PrivacyReport.

Each sampler class names its analysis (`Sampler.analysis`, a key of
`ANALYSES`); the accountant calls it with itself, which holds σ, δ, the group
size k, the cap B and the per-step PLD cache (docs/accounting.md):

* poisson_subsampling: PLD (default) or RDP of the Poisson-subsampled
  Gaussian; a cap B by the exact truncated event or the TV penalty.
* cyclic_poisson_subsampling: ⌈T/k⌉ Poisson-subsampled Gaussian steps at rate bk/N, for
  DP-SGD's noise and for BandMF with ≤ k bands (Choquette-Choo et al. 2023); a cap B by the
  TV penalty.
* fixed_size_subsampling: PLD of the MoG [0, 2] (Ganesh, seed 004) or FS-RDP
  (Birrell et al., seed 001); Wang et al. replace-one RDP beside it.
* subsampling_with_replacement: PLD of the MoG [0, 2, …, 2b], Binomial(b, 1/N).
* gaussian_per_epoch: exact Gaussian, once per epoch (deterministic order).
* shuffled_epochs: the deterministic ε (the only rigorous upper bound known),
  with the max-test lower bound and an "as if Poisson" ε (not a guarantee).
* matrix_mechanism: correlated noise a sampler does not amplify (BLT; BandMF with a fixed or
  shuffled order, or more bands than cyclic groups): one Gaussian of the strategy's
  sensitivity over the sampler's participation patterns (`matrix_mechanism`).
* random_allocation: balls-and-bins (`balls_and_bins_analysis`); provable
  random-allocation PLD within a time budget, else the labelled deterministic
  fallback; Monte Carlo opt-in.

Every number here (bounds, estimates, comparisons) is of the Gaussian mechanism with the
accounted noise multiplier σ/(1 + η), η the float rounding of the noised sum
(`acct.accounted_noise_multiplier`, `dpjax.privacy.rounding`).

A new sampler that fits one of these names it; a new analysis is one
function here and one entry in `ANALYSES` (docs/design.md, "Adding a sampler").
"""

from __future__ import annotations

import math
from typing import Any

from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import balls_and_bins_analysis
from dpjax.privacy.accounting import fixed_size_rdp
from dpjax.privacy.accounting import matrix_mechanism
from dpjax.privacy.accounting import max_test
from dpjax.privacy.accounting import rdp_steps
from dpjax.privacy.accounting import sampler_events
from dpjax.privacy.accounting.accountant_view import Accountant
from dpjax.privacy.accounting.report import PrivacyReport


# Poisson truncation whose TV penalty costs less than this fraction of δ is accounted by the
# TV argument alone; above it the exact truncated event is computed too.
_NEGLIGIBLE_PENALTY = 1e-3


def _group_conversion_epsilon(delta_one: callable, group_size: int, delta: float) -> float:
  """k·ε₁ with k·e^{(k−1)ε₁}·δ₁(ε₁) ≤ δ (Vadhan 2017, Lemma 2.2). Comparison only."""
  k = group_size

  def delta_group(eps):
    d1 = delta_one(eps)
    if d1 <= 0:
      return 0.0
    return math.exp(min(700.0, math.log(k) + (k - 1) * eps + math.log(d1)))

  return k * balls_and_bins.smallest_epsilon(delta_group, delta)


def _poisson_event(acct: Accountant):
  return sampler_events.poisson_step_event(
    acct.sampling_probability, acct.accounted_noise_multiplier, group_size=acct.group_size
  )


def _fixed_size_event(acct: Accountant):
  return sampler_events.fixed_size_step_event(
    acct.sampler.num_examples,
    acct.sampler.batch_size,
    acct.accounted_noise_multiplier,
    group_size=acct.group_size,
  )


def _with_replacement_event(acct: Accountant):
  return sampler_events.fixed_size_with_replacement_step_event(
    acct.sampler.num_examples,
    acct.sampler.batch_size,
    acct.accounted_noise_multiplier,
    group_size=acct.group_size,
  )


def _epoch_event(acct: Accountant):
  return sampler_events.epoch_gaussian_event(
    acct.accounted_noise_multiplier, group_size=acct.group_size
  )


def poisson_subsampling(acct: Accountant, steps: int, estimates: bool) -> PrivacyReport:
  q, sigma = acct.sampling_probability, acct.accounted_noise_multiplier
  k, delta = acct.group_size, acct.delta
  event = _poisson_event(acct)
  log_tau = acct.log_truncation_mass(steps)
  tau = math.exp(log_tau)
  details: dict[str, Any] = {'truncation_mass': tau}
  if acct.max_batch_size is None:
    details['truncation'] = 'none (no max_batch_size)'
  if acct.accountant == 'rdp':
    rdp = rdp_steps.composed_rdp(event, steps)
    if tau == 0:
      eps = rdp.get_epsilon(delta)
      details['method'] = 'rdp(poisson_subsampled_gaussian)'
    else:
      eps = balls_and_bins.smallest_epsilon(rdp.get_delta, delta, penalty_mass=tau)
      details['method'] = 'rdp(poisson_subsampled_gaussian) + tv_truncation_penalty'
    if estimates:
      details['pld_epsilon'] = _poisson_pld(acct, event, steps, tau)[0]
    return acct.report(steps, eps, details)
  eps, method, extra = _poisson_pld(acct, event, steps, tau)
  details.update(extra, method=method)
  if estimates:
    if k == 1:
      rdp = rdp_steps.composed_rdp(event, steps)
      details['rdp_epsilon'] = balls_and_bins.smallest_epsilon(
        rdp.get_delta, delta, penalty_mass=tau
      )
    else:
      one = acct.composed_pld(sampler_events.poisson_step_event(q, sigma), steps)
      details['group_conversion_epsilon_comparison_only'] = _group_conversion_epsilon(
        one.get_delta_for_epsilon, k, delta
      )
  return acct.report(steps, eps, details)


def _poisson_pld(acct: Accountant, event, steps: int, tau: float) -> tuple[float, str, dict]:
  delta = acct.delta
  composed = acct.composed_pld(event, steps)
  extra = acct.pld_grid(event, steps)
  if tau == 0:
    return float(composed.get_epsilon_for_delta(delta)), 'pld', extra
  eps_tv = balls_and_bins.smallest_epsilon(composed.get_delta_for_epsilon, delta, penalty_mass=tau)
  extra['tv_truncation_epsilon'] = eps_tv
  penalty = (1 + math.exp(eps_tv)) * tau if math.isfinite(eps_tv) else math.inf
  if acct.group_size > 1 or not acct.exact_truncation or penalty <= _NEGLIGIBLE_PENALTY * delta:
    return eps_tv, 'pld + tv_truncation_penalty', extra
  # The exact truncated event, for the dataset holding the sensitive example: N (remove)
  # and N + 1 (add); the worse of the two covers both directions.
  exact = max(
    float(
      acct.composed_pld(
        sampler_events.truncated_poisson_step_event(
          n, acct.sampling_probability, acct.max_batch_size, acct.accounted_noise_multiplier
        ),
        steps,
      ).get_epsilon_for_delta(delta)
    )
    for n in (acct.sampler.num_examples, acct.sampler.num_examples + 1)
  )
  extra['truncated_event_epsilon'] = exact
  if exact <= eps_tv:
    return exact, 'pld(truncated_subsampled_gaussian)', extra
  return eps_tv, 'pld + tv_truncation_penalty', extra


def fixed_size_subsampling(acct: Accountant, steps: int, estimates: bool) -> PrivacyReport:
  n, b, sigma, k, delta = (
    acct.sampler.num_examples,
    acct.sampler.batch_size,
    acct.accounted_noise_multiplier,
    acct.group_size,
    acct.delta,
  )
  details: dict[str, Any] = {}
  pld_eps = fs_rdp_eps = None
  if acct.accountant == 'pld' or estimates:
    event = _fixed_size_event(acct)
    pld_eps = float(acct.composed_pld(event, steps).get_epsilon_for_delta(delta))
    details.update(acct.pld_grid(event, steps))
  if k == 1 and b < n and (acct.accountant == 'rdp' or estimates):
    fs_rdp_eps, order = fixed_size_rdp.fixed_size_rdp_epsilon(b / n, sigma, steps, delta)
    details['fs_rdp_order'] = order
  elif acct.accountant == 'rdp':
    raise ValueError(f'FS-RDP needs q = b/N < 1, got b = N = {n}; use accountant pld.')
  if acct.accountant == 'pld':
    eps = pld_eps
    details['method'] = (
      'pld(mixture_of_gaussians[0,2])'
      if k == 1
      else 'pld(mixture_of_gaussians, hypergeometric group)'
    )
    if fs_rdp_eps is not None:
      details['fs_rdp_epsilon'] = fs_rdp_eps
  else:
    eps = fs_rdp_eps
    details['method'] = 'fs_rdp(birrell_et_al_2024, add/remove, integer orders)'
    if pld_eps is not None:
      details['pld_epsilon'] = pld_eps
  if estimates and k == 1:
    wor = rdp_steps.composed_rdp(
      sampler_events.sampled_without_replacement_rdp_event(n, b, sigma),
      steps,
      rdp_steps.NeighborRel.REPLACE_ONE,
    )
    details['wang_et_al_rdp_replace_one_epsilon'] = float(wor.get_epsilon(delta))
  if estimates and k > 1:
    one = acct.composed_pld(sampler_events.fixed_size_step_event(n, b, sigma), steps)
    details['group_conversion_epsilon_comparison_only'] = _group_conversion_epsilon(
      one.get_delta_for_epsilon, k, delta
    )
  return acct.report(steps, eps, details)


def subsampling_with_replacement(acct: Accountant, steps: int, estimates: bool) -> PrivacyReport:
  n, b, sigma, k, delta = (
    acct.sampler.num_examples,
    acct.sampler.batch_size,
    acct.accounted_noise_multiplier,
    acct.group_size,
    acct.delta,
  )
  event = _with_replacement_event(acct)
  eps = float(acct.composed_pld(event, steps).get_epsilon_for_delta(delta))
  details: dict[str, Any] = {
    'method': 'pld(mixture_of_gaussians[0,2,...,2b], binomial(b, k/N))',
    **acct.pld_grid(event, steps),
  }
  if estimates and k > 1:
    one = acct.composed_pld(
      sampler_events.fixed_size_with_replacement_step_event(n, b, sigma), steps
    )
    details['group_conversion_epsilon_comparison_only'] = _group_conversion_epsilon(
      one.get_delta_for_epsilon, k, delta
    )
  return acct.report(steps, eps, details)


def _epoch_gaussian_epsilon(acct: Accountant, epochs: int) -> tuple[float, str]:
  """Deterministic-order ε of `epochs` epochs (exact with 'pld', RDP with 'rdp')."""
  if acct.accountant == 'rdp':
    rdp = rdp_steps.composed_rdp(
      sampler_events.epoch_gaussian_event(
        acct.accounted_noise_multiplier, group_size=acct.group_size
      ),
      epochs,
    )
    return float(rdp.get_epsilon(acct.delta)), 'rdp(gaussian per epoch)'
  return (
    balls_and_bins.deterministic_epsilon(
      acct.accounted_noise_multiplier, epochs, acct.delta, group_size=acct.group_size
    ),
    'gaussian per epoch (exact)',
  )


def gaussian_per_epoch(acct: Accountant, epochs: int, estimates: bool) -> PrivacyReport:
  del estimates  # Exact: nothing to report beside ε.
  eps, method = _epoch_gaussian_epsilon(acct, epochs)
  return acct.report(epochs, eps, {'method': method})


def shuffled_epochs(acct: Accountant, epochs: int, estimates: bool) -> PrivacyReport:
  eps, method = _epoch_gaussian_epsilon(acct, epochs)
  details: dict[str, Any] = {
    'method': f'deterministic upper bound: {method} (joint convexity; no tight shuffle '
    f'accountant is known)'
  }
  lower = None
  if estimates:
    lower = max_test.shuffle_lower_bound_epsilon(
      acct.accounted_noise_multiplier, acct.steps_per_epoch, acct.delta, num_epochs=epochs
    )
    details['lower_bound_method'] = 'max test on the Chua et al. 2024a shuffle pair'
    poisson = acct.composed_pld(
      sampler_events.poisson_step_event(
        acct.sampler.batch_size / acct.sampler.num_examples,
        acct.accounted_noise_multiplier,
        group_size=acct.group_size,
      ),
      epochs * acct.steps_per_epoch,
    )
    details['as_if_poisson_not_a_guarantee'] = float(poisson.get_epsilon_for_delta(acct.delta))
  return acct.report(epochs, eps, details, epsilon_lower=lower)


def check_noise_for_sampler(sampler, noise: str, num_bands: int, strategy=None) -> tuple[str, int]:
  """(noise, bands) if an analysis covers the mechanism with this sampler, else one-line
  ValueError (`matrix_mechanism.check_noise`).

  One band is DP-SGD's Gaussian mechanism whatever the name (C = I). BandMF with b > 1 bands
  is amplified by cyclic Poisson with k >= b groups, whose participations are k >= b steps
  apart, so the columns of C an example touches have disjoint supports and unit norms
  (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization", Thm. 4). Otherwise
  (BLT, more bands than groups, a deterministic or shuffled order) the strategy is needed and
  the run is one Gaussian mechanism of its sensitivity (`matrix_mechanism`)."""
  matrix_mechanism.check_noise(sampler, noise, num_bands, strategy)
  return noise, num_bands


def _cyclic_event(acct: Accountant):
  return sampler_events.poisson_step_event(
    acct.sampler.participation_probability, acct.accounted_noise_multiplier
  )


def cyclic_poisson_subsampling(acct: Accountant, steps: int, estimates: bool) -> PrivacyReport:
  """T steps of cyclic Poisson: ⌈T/k⌉ Poisson-subsampled Gaussian participations at rate
  p = bk/N (the steps outside an example's group do not touch it), by PLD or RDP; a cap B by
  the TV penalty τ = T·Pr[Binomial(N + 1, b/N) > B] (each step's batch is Binomial(N, b/N)
  marginally over the secret groups)."""
  del estimates
  count = acct.sampler.participations(steps)
  event = _cyclic_event(acct)
  tau = math.exp(acct.log_truncation_mass(steps))
  details: dict[str, Any] = {
    'truncation_mass': tau,
    'participations': count,
    'participation_probability': acct.sampler.participation_probability,
    'noise': acct.noise,
    'num_bands': acct.num_bands,
  }
  if acct.max_batch_size is None:
    details['truncation'] = 'none (no max_batch_size)'
  if acct.accountant == 'rdp':
    rdp = rdp_steps.composed_rdp(event, count)
    delta_of, epsilon_of = rdp.get_delta, rdp.get_epsilon
    method = 'rdp(cyclic_poisson: ceil(T/k) poisson_subsampled_gaussian)'
  else:
    pld = acct.composed_pld(event, count)
    delta_of, epsilon_of = pld.get_delta_for_epsilon, pld.get_epsilon_for_delta
    details.update(acct.pld_grid(event, count))
    method = 'pld(cyclic_poisson: ceil(T/k) poisson_subsampled_gaussian)'
  if tau == 0:
    eps = float(epsilon_of(acct.delta))
  else:
    eps = balls_and_bins.smallest_epsilon(delta_of, acct.delta, penalty_mass=tau)
    method += ' + tv_truncation_penalty'
  details['method'] = method
  return acct.report(steps, eps, details)


# The per-step (per-epoch) event of each analysis whose composition bounds the run: the one its
# PLD composes; for the epoch-based samplers the deterministic-order Gaussian, their always-valid
# bound. `composition` composes runs in sequence through these.
PLD_EVENTS = {
  'poisson_subsampling': _poisson_event,
  'cyclic_poisson_subsampling': _cyclic_event,
  'fixed_size_subsampling': _fixed_size_event,
  'subsampling_with_replacement': _with_replacement_event,
  'gaussian_per_epoch': _epoch_event,
  'shuffled_epochs': _epoch_event,
  'random_allocation': _epoch_event,
}

ANALYSES = {
  'poisson_subsampling': poisson_subsampling,
  'cyclic_poisson_subsampling': cyclic_poisson_subsampling,
  'fixed_size_subsampling': fixed_size_subsampling,
  'subsampling_with_replacement': subsampling_with_replacement,
  'gaussian_per_epoch': gaussian_per_epoch,
  'shuffled_epochs': shuffled_epochs,
  'random_allocation': balls_and_bins_analysis.random_allocation,
  matrix_mechanism.NAME: matrix_mechanism.matrix_mechanism,
}
