"""ε pays for the float rounding of the noised sum: every analysis is of σ/(1 + η).

Examples are clipped at C exactly and the accountant takes the sensitivity C(1 + η)
(`dpjax.privacy.rounding`). Each number is checked against dp_accounting called directly with
the noise multiplier σ/(1 + η). All fail on da06065, where the accountant had no sensitivity
(a TypeError) and a plan's ε was that of σ.
"""

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpjax.privacy import precision
from dpjax.privacy import privacy_plan
from dpjax.privacy import rounding
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import analyses
from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import calibration
from dpjax.privacy.accounting import monte_carlo

N, SIGMA, DELTA, STEPS = 20_000, 2.0, 1e-6, 100


def _plan(accountant='pld', **kwargs):
  sampler = samplers.PoissonSampler(num_examples=N, batch_size=100, seed=1)
  args = dict(
    num_steps=STEPS,
    clip_norm=1.0,
    delta=DELTA,
    noise_multiplier=SIGMA,
    max_batch_size=4096,
    accountant=accountant,
    check_budget=False,
  )
  args.update(kwargs)
  return privacy_plan.PrivacyPlan.create(sampler, **args)


@pytest.mark.parametrize('accountant', ['pld', 'rdp'])
def test_a_plans_epsilon_is_dp_accounting_at_sigma_over_one_plus_eta(accountant):
  """The plan's η is that of its cap B = 4,096 and matmul format (7.3e-3 in float32); its ε
  is dp_accounting's Poisson-subsampled Gaussian at σ/(1 + η) (no truncation at this cap),
  and the report keeps σ, the noise that ran."""
  plan = _plan(accountant)
  eta = rounding.eta(4096, precision.matmul_format('default'))
  assert plan.rounding.eta == eta and plan.accountant.sensitivity == 1 + eta
  event = dp_event.PoissonSampledDpEvent(100 / N, dp_event.GaussianDpEvent(SIGMA / (1 + eta)))
  report = plan.epsilon_at(STEPS)
  if accountant == 'pld':  # At the grid the report names (the grid follows ε).
    direct = pld_privacy_accountant.PLDAccountant(
      value_discretization_interval=report.details['pld_grid']
    )
  else:
    direct = rdp_privacy_accountant.RdpAccountant()
  direct.compose(event, STEPS)
  assert report.epsilon == pytest.approx(direct.get_epsilon(DELTA), rel=1e-9)
  assert report.noise_multiplier == SIGMA
  assert report.details['sensitivity'] == 1 + eta
  assert report.details['accounted_noise_multiplier'] == SIGMA / (1 + eta)
  cost = plan.rounding_cost()
  ideal = accountant_lib.Accountant(
    plan.sampler, SIGMA, DELTA, accountant=accountant, max_batch_size=4096
  ).epsilon(STEPS)
  assert cost == pytest.approx(report.epsilon - ideal) and 0 < cost < 0.05 * ideal


def test_every_sampler_analysis_is_of_the_accounted_noise_multiplier(monkeypatch):
  """The deterministic order against dp_accounting's closed-form Gaussian at σ/(1 + η),
  balls-and-bins' deterministic fallback alike; fixed size builds its MoG event at σ/(1 + η)."""
  from dp_accounting.pld import privacy_loss_mechanism  # pylint: disable=import-outside-toplevel

  s = 1.02
  det = accountant_lib.Accountant(
    samplers.DeterministicSampler(num_examples=N, batch_size=100), SIGMA, DELTA, sensitivity=s
  )
  got = det.epsilon(3 * det.steps_per_epoch)  # 3 epochs: one Gaussian of σ/((1 + η)√3).
  gaussian = privacy_loss_mechanism.GaussianPrivacyLoss(SIGMA / s / math.sqrt(3))
  assert (
    gaussian.get_delta_for_epsilon(got) <= DELTA < gaussian.get_delta_for_epsilon(got * (1 - 1e-6))
  )
  bb = accountant_lib.Accountant(
    samplers.BallsAndBinsSampler(num_examples=N, batch_size=100),
    SIGMA,
    DELTA,
    sensitivity=s,
    random_allocation=False,
    max_batch_size=None,
  )
  assert bb.epsilon(3 * bb.steps_per_epoch) == got
  seen = []
  monkeypatch.setattr(
    analyses.sampler_events,
    'fixed_size_step_event',
    lambda n, b, sigma, **k: seen.append(sigma) or (_ for _ in ()).throw(ValueError('stop')),
  )
  with pytest.raises(ValueError, match='stop'):
    accountant_lib.Accountant(
      samplers.FixedSizeSampler(num_examples=N, batch_size=100), SIGMA, DELTA, sensitivity=s
    ).epsilon(STEPS)
  assert seen == [SIGMA / s]


def test_monte_carlo_draws_at_the_accounted_noise_multiplier(monkeypatch):
  seen = []
  monkeypatch.setattr(
    monte_carlo,
    'balls_and_bins_epsilon',
    lambda sigma, *a, **k: seen.append(sigma) or (_ for _ in ()).throw(ValueError('stop')),
  )
  acct = accountant_lib.Accountant(
    samplers.BallsAndBinsSampler(num_examples=N, batch_size=100),
    SIGMA,
    DELTA,
    sensitivity=1.25,
    random_allocation=False,
    monte_carlo_estimate=True,
    max_batch_size=None,
  )
  acct.epsilon_at(acct.steps_per_epoch, estimates=True)
  assert seen == [SIGMA / 1.25]


def test_calibration_meets_the_target_with_eta():
  """The calibrated σ meets the target with η: ε(σ) at sensitivity 1 + η, which is ε(σ/(1 + η))
  at sensitivity 1, is within the search's tolerance below the target; without η the same σ
  would have been reported lower (σ was raised for η). A deterministic order (closed form:
  cheap to search)."""
  sampler = samplers.DeterministicSampler(num_examples=N, batch_size=100, seed=1)
  plan = privacy_plan.PrivacyPlan.create(
    sampler, num_steps=3 * sampler.steps_per_epoch, clip_norm=1.0, delta=DELTA, target_epsilon=2.0
  )
  sigma, eta, steps = plan.noise_multiplier, plan.rounding.eta, plan.num_steps
  eps = plan.epsilon_at(steps).epsilon
  assert 2.0 * (1 - calibration.DEFAULT_EPSILON_RTOL - 1e-3) <= eps <= 2.0
  ideal = lambda s: accountant_lib.Accountant(sampler, s, DELTA).epsilon(steps)
  assert eps == ideal(sigma / (1 + eta))
  assert ideal(sigma) < eps * (1 - eta / 2)


def test_sensitivity_is_refused_below_one():
  for bad in (0.99, math.inf, math.nan, True):
    with pytest.raises(ValueError, match='sensitivity must be a finite number >= 1'):
      accountant_lib.Accountant(
        samplers.PoissonSampler(num_examples=N, batch_size=100), SIGMA, DELTA, sensitivity=bad
      )
