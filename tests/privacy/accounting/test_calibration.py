"""Calibration round trips: ε(calibrated σ) <= target and within 1% of it, for every sampler."""

import math

import pytest

from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import calibration
from dpjax.privacy.accounting import target_search

DELTA = 1e-5


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
  monkeypatch.setenv('DPJAX_CACHE_DIR', str(tmp_path))


def _sampler(name, n, b):
  return samplers.sampler_class(name)(num_examples=n, batch_size=b)


def _round_trip(sampler, target, steps, delta=DELTA, **kwargs):
  kwargs.setdefault('max_batch_size', None)  # Batches never truncated.
  sigma = calibration.calibrate_noise_multiplier(sampler, target, delta, steps, **kwargs)
  eps = accountant_lib.Accountant(sampler, sigma, delta, **kwargs).epsilon(steps)
  assert 0.99 * target <= eps <= target, (sigma, eps)
  return sigma


@pytest.mark.slow
@pytest.mark.parametrize(
  'name, accountant',
  [
    ('poisson', 'rdp'),
    ('fixed_size', 'pld'),
    ('fixed_size', 'rdp'),
    ('deterministic', 'auto'),
    ('shuffle', 'auto'),
    ('shuffle', 'rdp'),
  ],
)
def test_round_trip(name, accountant):
  # Poisson with PLD is test_pld_calibration_is_fast's round trip (N = 60,000, T = 20,000).
  _round_trip(_sampler(name, 10_000, 100), 2.0, 1000, accountant=accountant)


# The mixtures' round trips run at one fixed grid (`value_discretization_interval`, the same in
# the search and in the check): dp_accounting's mixture PLD costs per grid point, and the grid
# that follows ε (test_pld_grid.py) is 1e-4 at these ε, ten times the points and twice the CPU.
# The search with the grid that follows ε is the one of test_round_trip (fixed_size-pld is the
# mixture [0, 2]) and test_pld_grid's calibration; what these two add is their event.
MIXTURE_GRID = 1e-3


@pytest.mark.slow
def test_round_trip_fixed_size_with_replacement():
  sampler = _sampler('fixed_size_with_replacement', 1000, 4)  # σ ≈ 4.4: a small grid.
  _round_trip(sampler, 0.1, 250, value_discretization_interval=MIXTURE_GRID)


@pytest.mark.slow
def test_round_trip_group_poisson():
  # ε = 0.2 (σ ≈ 7.5 vs 3.8 for one record): high-σ grids are small.
  sampler = _sampler('poisson', 10_000, 100)
  options = dict(max_batch_size=None, value_discretization_interval=MIXTURE_GRID)
  sigma_group = _round_trip(sampler, 0.2, 500, group_size=2, **options)
  # The group σ is far more than one record needs (ε ≈ 0.1 at it): a calibration that ignored
  # k would give ε within 0.5 % of the target here. (One ε, not a second calibration.)
  one = accountant_lib.Accountant(sampler, sigma_group, DELTA, **options).epsilon(500)
  assert one < 0.9 * 0.2


def test_round_trip_balls_and_bins_deterministic_fallback():
  sampler = _sampler('balls_and_bins', 10_000, 100)
  sigma = _round_trip(sampler, 3.0, 300, random_allocation=False)
  shuffle = calibration.calibrate_noise_multiplier(
    _sampler('shuffle', 10_000, 100), 3.0, DELTA, 300
  )
  assert sigma == pytest.approx(shuffle, rel=0.01)  # Both are the deterministic bound here.


@pytest.mark.slow
def test_round_trip_balls_and_bins_monte_carlo():
  sampler = _sampler('balls_and_bins', 500, 50)  # T = 10; δ = 1e-3 < 1/N.
  # One process draws the samples: the estimate does not depend on the worker count
  # (test_accountant.py), and the ~20 evaluations of the search would each start a pool.
  options = dict(
    accountant='monte_carlo',
    monte_carlo_samples=10_000,
    beta=1e-2,
    monte_carlo_seed=3,
    monte_carlo_workers=1,
  )
  sigma = _round_trip(sampler, 1.5, 10, delta=1e-3, **options)
  det = calibration.calibrate_noise_multiplier(
    sampler, 1.5, 1e-3, 10, random_allocation=False, max_batch_size=None
  )
  assert sigma < det


@pytest.mark.slow
def test_pld_calibration_is_fast():
  # Also the Poisson-PLD case of test_round_trip: the same assertion at a realistic size.
  import time  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  _round_trip(_sampler('poisson', 60_000, 256), 3.0, 20_000)
  assert time.perf_counter() - start < 30  # < 10 s on an idle core; CI machines are shared.


@pytest.mark.slow
@pytest.mark.parametrize(
  # Poisson at σ = 3, ε = 0.5: 1671 steps (at σ = 1.5, ε = 3: 8977 steps, 2x the CPU).
  'name, sigma, target',
  [('poisson', 3.0, 0.5), ('shuffle', 1.5, 3.0)],
)
def test_largest_number_of_steps(name, sigma, target):
  sampler = _sampler(name, 10_000, 100)
  acct = accountant_lib.Accountant(sampler, sigma, DELTA, max_batch_size=None)
  steps = calibration.max_num_steps(sampler, sigma, target, DELTA, max_batch_size=None)
  unit = sampler.steps_per_epoch if name == 'shuffle' else 1
  assert steps % unit == 0
  assert steps > 0 and acct.epsilon(steps) <= target < acct.epsilon(steps + unit)


def test_search_helpers_on_closed_forms():
  # ε(σ) = 2/σ: the smallest σ with ε <= 0.5 is 4; ε(n) = n/10: the largest n with ε <= 3 is 30.
  sigma = target_search.smallest_noise_multiplier(lambda s: 2 / s, 0.5, epsilon_rtol=1e-9)
  assert 2 / sigma <= 0.5 and sigma == pytest.approx(4.0, rel=1e-6)
  assert target_search.largest_count(lambda n: n / 10, 3.0) == 30
  assert target_search.largest_count(lambda n: n / 10, 0.05) == 0


@pytest.mark.parametrize('target', [0.0, -1.0, math.inf])
def test_bad_target(target):
  with pytest.raises(ValueError, match='target_epsilon'):
    calibration.calibrate_noise_multiplier(_sampler('poisson', 100, 10), target, DELTA, 10)


def test_bad_arguments_fail_before_the_search():
  with pytest.raises(ValueError, match='delta'):
    calibration.calibrate_noise_multiplier(_sampler('poisson', 100, 10), 1.0, 0.0, 10)
  with pytest.raises(ValueError, match='num_steps'):
    calibration.calibrate_noise_multiplier(_sampler('poisson', 100, 10), 1.0, DELTA, 0)
  with pytest.raises(ValueError, match='not reached'):
    target_search.smallest_noise_multiplier(lambda s: 1.0, 0.5)
