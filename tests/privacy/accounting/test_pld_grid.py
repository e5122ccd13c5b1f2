"""The PLD grid follows ε (issue 34, item 9): tight at small ε, still an upper bound everywhere.

References are dp_accounting called directly here, at a finer grid than the accountant's:
the pessimistic (connect-the-dots) PLD, an upper bound on the true ε, and the optimistic
(privacy-buckets, rounded down) PLD, a *lower* bound on it: no observer of the run, however
strong, can tell D from D minus one record beyond the true ε, so a reported ε below the
optimistic reference would be a false claim.
"""

import logging

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import calibration
from dpjax.privacy.accounting import pld_grid


def _reference(q, sigma, steps, delta, interval, *, sensitivity=1.0, pessimistic=True):
  """ε of `steps` Poisson-subsampled Gaussian steps from dp_accounting at `interval`:
  pessimistic (connect the dots) or optimistic (privacy buckets rounded down)."""
  logging.disable(logging.WARNING)  # dp_accounting names the algorithm it falls back to.
  try:
    pld = pld_lib.from_gaussian_mechanism(
      standard_deviation=sigma,
      sensitivity=sensitivity,
      sampling_prob=q,
      value_discretization_interval=interval,
      pessimistic_estimate=pessimistic,
      use_connect_dots=pessimistic,
    )
  finally:
    logging.disable(logging.NOTSET)
  return float(pld.self_compose(steps).get_epsilon_for_delta(delta))


# (sampler, N, b, σ, T, δ, reference grid, ε on da06065's fixed grid 1e-4): ε from 0.014 to 32.
# fixed_size is the MoG [0, 2] (Ganesh), the Poisson-subsampled Gaussian with sensitivity 2.
CASES = [
  ('poisson', 1_000_000, 100, 2.0, 5000, 1e-7, 1e-6, 0.0180814),
  ('poisson', 1_000_000, 100, 3.0, 20_000, 1e-7, 5e-7, 0.0284247),
  ('poisson', 1_000_000, 200, 2.0, 5000, 1e-7, 2e-6, 0.031712),
  ('poisson', 1_000_000, 500, 2.0, 5000, 1e-7, 4e-6, 0.079077),
  ('poisson', 1000, 50, 1.2, 40, 1e-5, 4e-4, 1.6720935),
  ('fixed_size', 1000, 50, 1.0, 40, 1e-5, 1.6e-3, 12.8783),
  ('poisson', 1000, 200, 0.55, 50, 1e-5, 1.6e-3, 31.7378),
]


@pytest.mark.parametrize('name, n, b, sigma, steps, delta, fine, old', CASES)
def test_reported_epsilon_is_an_upper_bound_within_one_percent_of_a_fine_grid(
  name, n, b, sigma, steps, delta, fine, old
):
  """Reported ε >= dp_accounting's pessimistic ε at a finer grid (and >= its optimistic lower
  bound), and within 1 % of it. Fails on da06065 for the four smallest ε, at large N, by the
  1 % check (1.28×, 1.55×, 1.07×, 1.012× the fine value), checked; the three large ones also
  fail there, only because da06065's fixed grid 1e-4 is finer than these references."""
  sampler = samplers.sampler_class(name)(num_examples=n, batch_size=b)
  report = accountant_lib.Accountant(sampler, sigma, delta, max_batch_size=None).epsilon_at(
    steps, estimates=False
  )
  sensitivity = 2.0 if name == 'fixed_size' else 1.0
  upper = _reference(b / n, sigma, steps, delta, fine, sensitivity=sensitivity)
  lower = _reference(b / n, sigma, steps, delta, fine, sensitivity=sensitivity, pessimistic=False)
  assert lower <= upper * (1 + 1e-9) <= report.epsilon * (1 + 2e-9)  # FFT rounding only.
  assert report.epsilon <= 1.01 * upper
  assert report.details['pld_grid_converged'] and report.details['pld_grid'] > fine
  assert report.epsilon <= old * (1 + 1e-4)  # Never (materially) looser than da06065's grid.


def test_large_n_small_epsilon_of_the_issue():
  """Issue 34's case: Poisson, N = 12.8M, b = 1024, T = 12,500, σ = 2, δ = 1e-8 reported
  0.0286 on da06065 (grid 1e-4; RDP 0.215); dp_accounting at grid 1e-6 gives 0.02060.
  Fails on da06065 (0.0286 > 1.01 × 0.0206), checked."""
  sampler = samplers.PoissonSampler(num_examples=12_800_000, batch_size=1024)
  report = accountant_lib.Accountant(sampler, 2.0, 1e-8, max_batch_size=None).epsilon_at(
    12_500, estimates=False
  )
  upper = _reference(1024 / 12_800_000, 2.0, 12_500, 1e-8, 1e-6)
  assert upper * (1 - 1e-9) <= report.epsilon <= 1.01 * upper
  assert report.details['pld_grid'] < 1e-5  # Refined far below the old grid.


def test_each_grid_tried_is_dp_accountings_own_bound_and_the_smallest_is_reported():
  """The reported ε is dp_accounting's at the reported grid; every grid tried gives a bound at
  least as large (the minimum over valid upper bounds is one). Fails on da06065: the report
  has no grid, checked."""
  sampler = samplers.PoissonSampler(num_examples=10_000, batch_size=100)
  acct = accountant_lib.Accountant(sampler, 3.0, 1e-5, max_batch_size=None)
  report = acct.epsilon_at(50, estimates=False)
  refined = next(iter(acct.compositions.grids.values()))
  assert len(refined.tried) >= 3 and refined.tried[0][0] == pld_grid.START_GRID
  for grid, eps in refined.tried:
    assert eps == pytest.approx(_reference(0.01, 3.0, 50, 1e-5, grid), rel=1e-9)
    assert eps >= report.epsilon
  assert report.epsilon == min(eps for _, eps in refined.tried)
  assert report.details['pld_grid'] == refined.grid


def test_refine_keeps_the_smallest_bound_and_stops_where_told():
  """On a made-up ε(grid) = 1 + 100·grid (with a bump): the minimum is kept even when a finer
  grid is worse, a declined grid (None) ends the search, and a coarse first grid cannot end
  it by chance."""
  bumped = {pld_grid.START_GRID / 4: 5.0}
  values = lambda g: (bumped.get(g, 1 + 100 * g), g)
  result = pld_grid.refine(values, pld_grid.START_GRID, next_grid=pld_grid.halve)
  assert result.converged and result.epsilon == min(e for _, e in result.tried)
  assert result.epsilon < 1.001 and 5.0 in [e for _, e in result.tried]
  assert result.tried[-2][1] - result.tried[-1][1] < 1e-3 * result.epsilon
  stopped = pld_grid.refine(
    lambda g: values(g) if g > 1e-3 else None, pld_grid.START_GRID, next_grid=pld_grid.halve
  )
  assert not stopped.converged and stopped.grid > 1e-3
  flat_then_falling = lambda g: (1.0 if g > 1e-3 else 0.5 + g, g)  # Equal at two coarse grids.
  ended = pld_grid.refine(
    flat_then_falling, 0.1, next_grid=pld_grid.halve, coarsest_compared=lambda eps: 2e-3
  )
  assert ended.epsilon < 0.51
  with pytest.raises(ValueError, match='first grid'):
    pld_grid.refine(lambda g: None, 0.1)
  assert pld_grid.on_ladder(3e-4) == 2e-4 and pld_grid.on_ladder(1e-4) == 1e-4


@pytest.mark.slow
def test_calibrated_sigma_meets_the_target_at_the_reported_grid():
  """Calibration uses the same rule: the σ found meets the target at the grid the report
  names (dp_accounting there, directly). Fails on da06065: no grid in the report, checked."""
  sampler = samplers.PoissonSampler(num_examples=1000, batch_size=50)
  target, delta, steps = 3.0, 1e-5, 40
  sigma = calibration.calibrate_noise_multiplier(sampler, target, delta, steps, max_batch_size=None)
  report = accountant_lib.Accountant(sampler, sigma, delta, max_batch_size=None).epsilon_at(
    steps, estimates=False
  )
  at_grid = _reference(0.05, sigma, steps, delta, report.details['pld_grid'])
  assert report.epsilon == pytest.approx(at_grid, rel=1e-9)
  assert target * (1 - calibration.DEFAULT_EPSILON_RTOL) <= report.epsilon <= target
