"""Accounting that cannot exhaust memory or hang: trimmed mixtures, grid limits, cap errors."""

import math
import time

import numpy as np
import pytest
from dp_accounting import dp_event
from scipy import stats

from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import calibration
from dpjax.privacy.accounting import sampler_events
from dpjax.privacy.accounting import step_pld
from tests.privacy.accounting.test_accounting_events import _pld_epsilon as _direct_epsilon
from tests.privacy.accounting.test_accounting_events import _sampler
from tests.privacy.accounting.test_accounting_events import DELTA


def _tail_sums(event):
  """Pr[sensitivity >= s] of the event, per sensitivity."""
  probs = np.asarray(event.sampling_probs)
  return dict(zip(event.sensitivities, np.cumsum(probs[::-1])[::-1]))


def test_trimmed_with_replacement_event_dominates_the_exact_binomial_at_b256():
  """b = 256, N = 50,000: the event that made a ~1.3e8-point grid (24 GB) on 05e2da3."""
  n, b = 50_000, 256
  event = sampler_events.fixed_size_with_replacement_step_event(n, b, 1.0)
  assert math.isclose(sum(event.sampling_probs), 1.0, rel_tol=1e-12)
  # Round-off no longer lands on sensitivity 2b: what sits there is the trimmed tail only,
  # far below the mass dp_accounting truncates (so the grid stays small).
  assert event.sensitivities[-1] == 2 * b and event.sampling_probs[-1] <= 1e-30
  tails = _tail_sums(event)
  for count in range(1, b + 1):  # Pr[K >= count], exactly, in log space.
    exact = math.exp(stats.binom.logsf(count - 1, b, 1 / n))
    trimmed = max(t for s, t in tails.items() if s >= 2 * count)  # Mass at >= 2·count.
    assert trimmed >= exact * (1 - 1e-12)
  points = step_pld.estimate_pld_grid_points(event, 1e-3)
  assert points < 2e6  # ~1.1e6 grid points × components: seconds, not 24 GB.


@pytest.mark.slow
def test_trimming_is_pessimistic_and_close_to_the_untrimmed_event():
  """Small b, where the untrimmed mixture is cheap: trimmed ε >= untrimmed ε, and close."""
  n, b, sigma, steps, interval = 100, 8, 4.0, 20, 1e-2
  counts = np.arange(b + 1)
  pmf = stats.binom.pmf(counts, b, 1 / n)
  untrimmed = dp_event.MixtureOfGaussiansDpEvent(sigma, list(2.0 * counts), list(pmf))
  exact = _direct_epsilon(untrimmed, steps, interval)
  for tail_mass, components in ((1e-30, b + 1), (1e-8, 6)):  # 1e-8: K >= 5 merged into 2b.
    trimmed = sampler_events.mixture_of_gaussians_event(sigma, 2 * counts, pmf, tail_mass=tail_mass)
    assert len(trimmed.sensitivities) == components and trimmed.sensitivities[-1] == 2 * b
    got = _direct_epsilon(trimmed, steps, interval)
    assert exact <= got <= exact * (1 + 1e-3)
  # The accountant uses the default trimming.
  acct = accountant_lib.Accountant(
    _sampler('fixed_size_with_replacement', n, b),
    sigma,
    DELTA,
    value_discretization_interval=interval,
  )
  assert acct.epsilon(steps) == pytest.approx(exact, rel=1e-6)


@pytest.mark.slow
def test_with_replacement_b1_is_the_poisson_gaussian_with_sensitivity_2():
  """b = 1: K ~ Bernoulli(1/N), MoG [0, 2]: the Poisson-subsampled Gaussian, σ/2 (closed form)."""
  n, sigma, steps = 1000, 2.0, 100
  acct = accountant_lib.Accountant(_sampler('fixed_size_with_replacement', n, 1), sigma, DELTA)
  poisson = dp_event.PoissonSampledDpEvent(1 / n, dp_event.GaussianDpEvent(sigma / 2))
  report = acct.epsilon_at(steps, estimates=False)  # At the grid it names (test_pld_grid.py).
  assert report.epsilon == pytest.approx(
    _direct_epsilon(poisson, steps, report.details['pld_grid']), rel=1e-6
  )


@pytest.mark.parametrize(
  'name, b, k',
  [('poisson', 256, 1024), ('fixed_size', 256, 1024), ('fixed_size_with_replacement', 256, 1024)],
)
def test_group_size_above_batch_size_fails_fast_with_what_to_change(name, b, k):
  """k = 1024 > b = 256 hung for minutes with no output on 05e2da3."""
  acct = accountant_lib.Accountant(
    _sampler(name, 50_000, b), 1.0, DELTA, group_size=k, max_batch_size=None
  )
  start = time.perf_counter()
  with pytest.raises(
    step_pld.GridTooLargeError, match=r'more than the .* allowed .*lower privacy.group_size = 1024'
  ):
    acct.epsilon(100)
  assert time.perf_counter() - start < 5


@pytest.mark.slow
def test_group_size_above_batch_size_fixed_size_is_capped_by_b():
  """Without replacement at most b of the k group members are in a batch: Hypergeometric
  support {0, ..., b}; ε matches dp_accounting with the exact pmf."""
  n, b, k, sigma, steps, interval = 200, 4, 10, 4.0, 10, 1e-2
  event = sampler_events.fixed_size_step_event(n, b, sigma, group_size=k)
  assert max(event.sensitivities) == 2 * b
  counts = np.arange(b + 1)
  exact = dp_event.MixtureOfGaussiansDpEvent(
    sigma, list(2.0 * counts), list(stats.hypergeom.pmf(counts, n, k, b))
  )
  acct = accountant_lib.Accountant(
    _sampler('fixed_size', n, b), sigma, DELTA, group_size=k, value_discretization_interval=interval
  )
  assert acct.epsilon(steps) == pytest.approx(_direct_epsilon(exact, steps, interval), rel=1e-3)


def test_max_grid_points_is_configurable_and_checked_before_building():
  sampler = _sampler('fixed_size_with_replacement', 1000, 10)
  options = dict(value_discretization_interval=1e-2)
  acct = accountant_lib.Accountant(sampler, 4.0, DELTA, max_grid_points=100, **options)
  with pytest.raises(step_pld.GridTooLargeError, match='raise max_grid_points'):
    acct.epsilon(10)
  assert not acct.compositions.step_plds  # Nothing was built.
  assert math.isfinite(accountant_lib.Accountant(sampler, 4.0, DELTA, **options).epsilon(10))
  with pytest.raises(ValueError, match='max_grid_points must be an integer >= 1'):
    accountant_lib.Accountant(sampler, 4.0, DELTA, max_grid_points=0)


@pytest.mark.parametrize(
  'event, interval, components',
  [
    (sampler_events.fixed_size_with_replacement_step_event(1000, 10, 4.0), 1e-2, 11),
    (sampler_events.poisson_step_event(0.01, 0.8), 1e-4, 1),  # Closed form: points once.
  ],
)
def test_grid_estimate_matches_the_grid_dp_accounting_builds(event, interval, components):
  estimate = step_pld.estimate_pld_grid_points(event, interval)
  pld = step_pld.step_pld(event, interval)
  # pylint: disable-next=protected-access
  built = max(pld._pmf_remove.size, pld._pmf_add.size)
  assert estimate == pytest.approx(built * components, rel=1e-2)


@pytest.mark.slow
def test_too_small_cap_is_reported_as_the_cap_with_the_b_needed():
  """05e2da3 said 'target ε = 2.0 is not reached even with σ = 10000.0'."""
  n, b, steps, target = 60_000, 256, 235, 2.0
  sampler = _sampler('poisson', n, b)
  with pytest.raises(ValueError, match=r'max_batch_size B = 300 is too small') as info:
    calibration.calibrate_noise_multiplier(sampler, target, DELTA, steps, max_batch_size=300)
  needed = int(info.value.args[0].split('B >= ')[1].split()[0])

  def penalty(cap):  # (1 + e^ε)·T·Pr[Binomial(N + 1, q) > B] / δ, computed directly.
    return (1 + math.exp(target)) * steps * stats.binom.sf(cap, n + 1, b / n) / DELTA

  assert penalty(needed) <= 0.5 < penalty(needed - 1)
  # At the B named, the target is reached (TV penalty alone: the fast, looser accounting).
  options = dict(max_batch_size=needed, exact_truncation=False)
  sigma = calibration.calibrate_noise_multiplier(sampler, target, DELTA, steps, **options)
  got = accountant_lib.Accountant(sampler, sigma, DELTA, **options).epsilon(steps)
  assert target * 0.99 <= got <= target


def test_progress_bars_are_quiet_without_a_terminal():
  with step_pld.progress_bar(2, 'test') as bar:
    assert bar.disable  # pytest captures stderr: not a TTY.
