"""`AccountingOptions`: how an accountant accounts, as one type (issue 35, item 2).

On da06065 `Accountant.__init__` took 19 keyword arguments and `PrivacyPlan` kept a second
dict of them for its η = 0 accountant; these tests use the new type (they fail there on the
missing `dpjax.privacy.accounting.options` module).
"""

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from dpjax.privacy import privacy_plan
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting.options import AccountingOptions

SAMPLER = samplers.make('poisson', 1000, 50, seed=0)


@pytest.mark.parametrize(
  'field, value, message',
  [
    ('beta', 1.5, r'^beta must be in \(0, 1\)'),
    ('pld_coarsening', 0.5, r'^pld_coarsening must be in \[1, 100\]'),
    ('value_discretization_interval', 0.5, r'^value_discretization_interval must be None or'),
    ('random_allocation_timeout', 0, r'^random_allocation_timeout must be None'),
    ('monte_carlo_samples', 0, r'monte_carlo_samples'),
    ('num_steps', -1, r'num_steps'),
    ('sensitivity', 0.5, r'sensitivity'),
  ],
)
def test_an_option_out_of_range_is_refused_when_the_options_are_made(field, value, message):
  with pytest.raises(ValueError, match=message):
    AccountingOptions(**{field: value})
  with pytest.raises(ValueError, match=message):  # The same line through the keywords.
    accountant_lib.Accountant(SAMPLER, 1.0, 1e-5, **{field: value})


def test_an_unknown_option_is_refused():
  with pytest.raises(TypeError, match='monte_carlo_sample'):
    accountant_lib.Accountant(SAMPLER, 1.0, 1e-5, monte_carlo_sample=10)


def test_options_and_keywords_make_the_same_accountant_whose_epsilon_is_dp_accountings():
  """RDP of the Poisson-subsampled Gaussian, T = 100, no cap: dp_accounting called directly."""
  options = AccountingOptions(accountant='rdp', max_batch_size=None, num_steps=100)
  by_type = accountant_lib.Accountant(SAMPLER, 1.2, 1e-5, options)
  by_keywords = accountant_lib.Accountant(SAMPLER, 1.2, 1e-5, **options.given())
  assert options.given() == {'accountant': 'rdp', 'max_batch_size': None, 'num_steps': 100}
  assert by_type.options == by_keywords.options == options
  rdp = rdp_privacy_accountant.RdpAccountant()
  rdp.compose(dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(1.2)), 100)
  expected = rdp.get_epsilon(1e-5)
  assert by_type.epsilon(100) == by_keywords.epsilon(100) == pytest.approx(expected, rel=1e-9)
  assert by_type.final_report(estimates=False).epsilon == by_type.epsilon(100)


def test_keywords_replace_the_fields_of_the_options_they_come_with():
  acct = accountant_lib.Accountant(
    SAMPLER,
    1.0,
    1e-5,
    AccountingOptions(accountant='rdp', beta=0.01, max_batch_size=None),
    beta=0.02,
  )
  assert (acct.accountant, acct.beta, acct.options.beta) == ('rdp', 0.02, 0.02)


def test_the_plans_accountant_holds_its_cap_steps_and_one_plus_eta_and_its_eta_free_twin_differs_only_there():
  """The plan binds B, T, k and 1 + η into the options; `rounding_cost`'s η = 0 accountant is
  the same options at sensitivity 1, so Δε = ε(σ/(1 + η)) − ε(σ) > 0, and it equals the
  difference of two accountants made here from the same fields."""
  plan = privacy_plan.PrivacyPlan.create(
    SAMPLER,
    num_steps=20,
    clip_norm=1.0,
    noise_multiplier=1.0,
    delta=1e-5,
    max_batch_size=200,
    accountant='rdp',
  )
  options = plan.accountant.options
  assert (options.max_batch_size, options.num_steps, options.group_size) == (200, 20, 1)
  assert options.sensitivity == 1 + plan.rounding.eta and options.accountant == 'rdp'
  ideal = accountant_lib.Accountant(SAMPLER, 1.0, 1e-5, options.replace(sensitivity=1.0))
  cost = plan.rounding_cost()
  assert cost > 0 and math.isclose(cost, plan.accountant.epsilon(20) - ideal.epsilon(20))
