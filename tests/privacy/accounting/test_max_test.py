"""Max-test lower bounds: closed forms, quadrature, dp_accounting and the paper's numbers."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from scipy import special
from scipy import stats

from dpjax.privacy.accounting import max_test
from tests import independent


def gaussian_delta(epsilon, sigma):
  """Exact δ(ε) of the Gaussian mechanism with sensitivity 1 and noise σ."""
  return stats.norm.cdf(-epsilon * sigma + 1 / (2 * sigma)) - math.exp(epsilon) * stats.norm.cdf(
    -epsilon * sigma - 1 / (2 * sigma)
  )


def poisson_pld_delta(sigma, q, num_steps, epsilon):
  accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
  accountant.compose(
    dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), num_steps
  )
  return accountant.get_delta(epsilon)


@pytest.mark.parametrize('sigma', [0.5, 1.0, 3.0])
@pytest.mark.parametrize('epsilon', [0.0, 0.5, 2.0])
def test_one_step_is_the_gaussian_mechanism(sigma, epsilon):
  # T = 1: both pairs are N(1, σ²) vs N(0, σ²) (shuffle shifted by 1) and max is the identity.
  exact = gaussian_delta(epsilon, sigma)
  bb = max_test.balls_and_bins_lower_bound_delta(sigma, 1, epsilon)
  shuffle = max_test.shuffle_lower_bound_delta(sigma, 1, epsilon)
  for value in (bb, shuffle):
    assert value <= exact * (1 + 1e-12)
    assert value == pytest.approx(exact, rel=1e-5)


def test_one_step_many_epochs_is_the_gaussian_with_sensitivity_sqrt_epochs():
  # E epochs of N(1,σ²) vs N(0,σ²) = N(0,σ²/E)-noise with sensitivity 1: PLD composition.
  sigma, epochs = 2.0, 3
  for epsilon in (0.25, 1.0):
    exact = gaussian_delta(epsilon, sigma / math.sqrt(epochs))
    lower = max_test.balls_and_bins_lower_bound_delta(sigma, 1, epsilon, num_epochs=epochs)
    assert exact * (1 - 2e-3) <= lower <= exact  # optimistic rounding: below, but close


@pytest.mark.parametrize('pair', [max_test.balls_and_bins_max_pair, max_test.shuffle_max_pair])
@pytest.mark.parametrize('num_steps', [10, 100])
def test_binned_divergence_matches_quadrature_of_the_densities(pair, num_steps):
  p_law, q_law = pair(1.0, num_steps)
  lower = (
    max_test.balls_and_bins_lower_bound_delta
    if pair is max_test.balls_and_bins_max_pair
    else max_test.shuffle_lower_bound_delta
  )
  for epsilon in (0.3, 1.0, 2.5):
    integral = max_test.max_test_delta_by_quadrature(p_law, q_law, epsilon)
    binned = lower(1.0, num_steps, epsilon)
    assert binned <= integral * (1 + 1e-9)
    assert binned == pytest.approx(integral, rel=1e-5)


def test_max_law_cdf_and_density_are_consistent():
  p_law, _ = max_test.balls_and_bins_max_pair(0.7, 50)
  rng = np.random.default_rng(0)
  x = 0.7 * rng.standard_normal((20_000, 50))
  x[:, 0] += 1
  # The analytic CDF of the max against samples of the max (KS test, fixed seed).
  assert stats.kstest(x.max(axis=1), lambda z: np.exp(p_law.log_cdf(z))).pvalue > 1e-3
  z, h = np.linspace(-1, 4, 101), 1e-5
  numeric = (np.exp(p_law.log_cdf(z + h)) - np.exp(p_law.log_cdf(z - h))) / (2 * h)
  np.testing.assert_allclose(np.exp(p_law.log_pdf(z)), numeric, rtol=1e-5, atol=1e-9)
  np.testing.assert_allclose(np.exp(p_law.log_sf(z)), 1 - np.exp(p_law.log_cdf(z)), rtol=1e-9)
  # The tail stays resolved far beyond 1 − F = 1e-16 (here ≈ e^{-860}, union of the 50 tails).
  expected = np.logaddexp(special.log_ndtr(-29 / 0.7), math.log(49) + special.log_ndtr(-30 / 0.7))
  assert p_law.log_sf(30.0) == pytest.approx(expected, rel=1e-12)


def test_shuffle_reference_value_and_comparison_with_poisson():
  # docs/accounting.md §3: σ = 1, T = 100, one epoch, ε = 1.
  shuffle = max_test.shuffle_lower_bound_delta(1.0, 100, 1.0)
  assert shuffle == pytest.approx(0.0167, abs=5e-5)
  poisson = poisson_pld_delta(1.0, 0.01, 100, 1.0)
  assert poisson == pytest.approx(6.7e-7, rel=0.02)
  # The shuffle lower bound beats the Poisson figure by 4 orders of magnitude (what users must
  # be shown), and the balls-and-bins lower bound sits at the Poisson scale, far below shuffle.
  # (That balls-and-bins' *upper* bound is below it is checked in test_monte_carlo.)
  balls_and_bins = max_test.balls_and_bins_lower_bound_delta(1.0, 100, 1.0)
  assert shuffle > 1e4 * poisson
  assert 0.1 * poisson < balls_and_bins < poisson


@pytest.mark.parametrize('num_steps,epochs', [(10, 1), (100, 2), (1000, 1)])
def test_balls_and_bins_lower_bound_is_below_deterministic(num_steps, epochs):
  # δ_max-test ≤ δ_BnB ≤ δ_deterministic (joint convexity, seed 000 §3), Gaussian with √E.
  sigma = 0.9
  for epsilon in (0.2, 1.0, 2.0):
    lower = max_test.balls_and_bins_lower_bound_delta(sigma, num_steps, epsilon, num_epochs=epochs)
    assert 0 < lower < gaussian_delta(epsilon, sigma / math.sqrt(epochs))


@pytest.mark.parametrize('epochs', [1, 3])
def test_shuffle_lower_bound_is_below_deterministic(epochs):
  for epsilon in (0.0, 0.5, 2.0):
    lower = max_test.shuffle_lower_bound_delta(1.0, 20, epsilon, num_epochs=epochs)
    assert 0 < lower <= gaussian_delta(epsilon, 1.0 / math.sqrt(epochs))


@pytest.mark.slow
def test_more_epochs_give_larger_lower_bounds():
  deltas = [
    max_test.balls_and_bins_lower_bound_delta(1.0, 50, 1.0, num_epochs=e) for e in (1, 2, 4)
  ]
  assert deltas[0] < deltas[1] < deltas[2]
  epsilons = [max_test.shuffle_lower_bound_epsilon(1.0, 50, 1e-5, num_epochs=e) for e in (1, 2, 4)]
  assert epsilons[0] < epsilons[1] < epsilons[2]


@pytest.mark.parametrize(
  'lower_delta,lower_epsilon,epochs',
  [
    (max_test.balls_and_bins_lower_bound_delta, max_test.balls_and_bins_lower_bound_epsilon, 1),
    (max_test.balls_and_bins_lower_bound_delta, max_test.balls_and_bins_lower_bound_epsilon, 2),
    (max_test.shuffle_lower_bound_delta, max_test.shuffle_lower_bound_epsilon, 1),
  ],
)
def test_epsilon_inverts_delta_from_below(lower_delta, lower_epsilon, epochs):
  for delta in (1e-3, 1e-6):
    epsilon = lower_epsilon(1.0, 30, delta, num_epochs=epochs)
    assert epsilon > 0
    # Just below the returned ε the lower bound on δ is still above δ: ε_true ≥ ε.
    assert lower_delta(1.0, 30, epsilon * (1 - 1e-6), num_epochs=epochs) >= delta
    assert lower_delta(1.0, 30, epsilon + 1e-3, num_epochs=epochs) < delta


def test_epsilon_is_zero_when_delta_is_above_the_zero_epsilon_divergence():
  assert max_test.balls_and_bins_lower_bound_epsilon(10.0, 100, 0.5) == 0.0


@pytest.mark.slow
def test_lower_bound_epsilon_is_below_random_allocation_upper_bound():
  # pld-accounting's provable upper bound for random allocation (Feldman & Shenfeld): its public
  # range, computed once per process (test_balls_and_bins compares with the same one).
  upper = independent.allocation_epsilon_range(1.0, 10, 1e-5).upper_bound
  lower = max_test.balls_and_bins_lower_bound_epsilon(1.0, 10, 1e-5)
  assert 0.9 * upper < lower <= upper


@pytest.mark.parametrize(
  'kwargs,field',
  [
    (dict(sigma=0.0, num_steps=10, epsilon=1.0), 'sigma'),
    (dict(sigma=float('nan'), num_steps=10, epsilon=1.0), 'sigma'),
    (dict(sigma=1.0, num_steps=0, epsilon=1.0), 'num_steps'),
    (dict(sigma=1.0, num_steps=2.5, epsilon=1.0), 'num_steps'),
    (dict(sigma=1.0, num_steps=10, epsilon=-1.0), 'epsilon'),
    (dict(sigma=1.0, num_steps=10, epsilon=1.0, num_epochs=0), 'num_epochs'),
  ],
)
def test_bad_arguments_raise_value_errors_naming_the_field(kwargs, field):
  for fn in (max_test.balls_and_bins_lower_bound_delta, max_test.shuffle_lower_bound_delta):
    with pytest.raises(ValueError, match=field):
      fn(**kwargs)


@pytest.mark.parametrize('delta', [0.0, 1.0, -1e-5, float('nan')])
def test_bad_delta_raises(delta):
  for fn in (max_test.balls_and_bins_lower_bound_epsilon, max_test.shuffle_lower_bound_epsilon):
    with pytest.raises(ValueError, match='delta'):
      fn(1.0, 10, delta)
