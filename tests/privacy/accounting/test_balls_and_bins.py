"""Provable balls-and-bins ε: random-allocation PLD (child process, cache, budget) and fallback.

Each piece against a closed form or `PLD_accounting` called directly, at small T (seconds).
The child process itself is tested here (its build, its time budget, its failure); elsewhere
the builds run in this process (`in_process_pld_builds`, tests/conftest.py).
"""

import math
import os
import subprocess

import numpy as np
import PLD_accounting
import pytest

from dpjax.trainer.planning import plan as plan_lib
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import max_test
from dpjax.privacy.accounting import monte_carlo
from dpjax.privacy.accounting import provable_bound
from dpjax.privacy.accounting import random_allocation
from tests import independent

DELTA = 1e-5


@pytest.fixture(scope='module')
def cache(tmp_path_factory):
  """One fresh cache for the module: builds here are real, and shared between its tests."""
  path = tmp_path_factory.mktemp('dpjax-cache')
  old, memo = os.environ.get('DPJAX_CACHE_DIR'), dict(random_allocation._memo)
  os.environ['DPJAX_CACHE_DIR'] = str(path)
  random_allocation._memo.clear()
  yield path
  random_allocation._memo.clear()
  random_allocation._memo.update(memo)
  if old is None:
    del os.environ['DPJAX_CACHE_DIR']
  else:
    os.environ['DPJAX_CACHE_DIR'] = old


def _library_pld(sigma, steps, grid, tail, bound_type):
  return PLD_accounting.gaussian_allocation_pld(
    params=PLD_accounting.PrivacyParams(sigma=sigma, num_steps=steps, num_selected=1, num_epochs=1),
    config=PLD_accounting.AllocationSchemeConfig(loss_discretization=grid, tail_truncation=tail),
    bound_type=bound_type,
  )


def test_one_step_is_the_gaussian_mechanism(cache, in_process_pld_builds):
  # T = 1: every example is in the only batch, so the pair is N(1, σ²) vs N(0, σ²) exactly.
  for sigma in (0.7, 2.0):
    exact = balls_and_bins.deterministic_epsilon(sigma, 1, DELTA)  # closed form (Balle & Wang)
    bound = provable_bound.provable_epsilon(sigma, 1, DELTA, lower=True)
    assert bound.random_allocation_lower <= exact <= bound.random_allocation_upper
    # Pessimistic by at most a fraction of the loss grid.
    assert bound.random_allocation_upper - exact <= bound.discretization
    assert bound.epsilon == min(exact, bound.random_allocation_upper)


@pytest.mark.slow
def test_epoch_pld_is_the_library_pld_and_inside_its_adaptive_range(cache, request):
  sigma, steps, grid, tail = 1.0, 10, 0.02, 1e-8
  ours = balls_and_bins.random_allocation_epoch_pld(
    sigma, steps, discretization=grid, tail_truncation=tail
  )
  direct = _library_pld(sigma, steps, grid, tail, PLD_accounting.BoundType.DOMINATES)
  for eps in (0.5, 1.0, 2.0, 3.0):  # the (real) child's build, saved and loaded, is the same PLD
    assert ours.get_delta_for_epsilon(eps) == direct.get_delta_for_epsilon(eps)
  # The range's lower PLD (grid 0.04) is built in this process: one real child per module is
  # the child's test, a second one costs an interpreter start (~3 s CPU) and tests nothing new.
  request.getfixturevalue('in_process_pld_builds')
  library = independent.allocation_epsilon_range(sigma, steps, DELTA)  # Its public range.
  upper, lower = library.upper_bound, library.lower_bound
  mine_upper, mine_lower = balls_and_bins.random_allocation_epsilon_range(sigma, steps, DELTA)
  # Both ours and the library's are valid bounds on one true ε: the intervals intersect.
  assert mine_lower <= upper and lower <= mine_upper
  assert mine_lower <= mine_upper <= 1.05 * upper


@pytest.mark.slow
def test_epochs_compose_the_one_epoch_pld(cache, in_process_pld_builds):
  sigma, steps = 1.0, 10
  bounds = [provable_bound.provable_epsilon(sigma, steps, DELTA, num_epochs=e) for e in (1, 3, 4)]
  # E = 1-3 share one build, E = 4-15 another at half the grid (rounding adds up over epochs).
  assert bounds[0].discretization == bounds[1].discretization == 2 * bounds[2].discretization
  for epochs, bound in zip((1, 3, 4), bounds):
    pld = balls_and_bins.random_allocation_epoch_pld(
      sigma,
      steps,
      discretization=bound.discretization,
      tail_truncation=random_allocation.default_tail_truncation(DELTA),
    )
    composed = pld.self_compose(epochs) if epochs > 1 else pld
    assert bound.epsilon == composed.get_epsilon_for_delta(DELTA)
    assert bound.method.startswith('random_allocation_pld')
    assert (
      max_test.balls_and_bins_lower_bound_epsilon(sigma, steps, DELTA, num_epochs=epochs)
      <= bound.epsilon
      < balls_and_bins.deterministic_epsilon(sigma, epochs, DELTA)
    )
  assert bounds[0].epsilon < bounds[1].epsilon < bounds[2].epsilon


@pytest.mark.slow
def test_cache_returns_identical_numbers_without_a_child(cache, monkeypatch):
  first = provable_bound.provable_epsilon(1.0, 10, DELTA, num_epochs=2)

  def no_child(*args, **kwargs):
    raise AssertionError('the cache should have answered')

  monkeypatch.setattr(random_allocation.subprocess, 'run', no_child)
  random_allocation._memo.clear()  # a new process: the disk answers
  assert provable_bound.provable_epsilon(1.0, 10, DELTA, num_epochs=2) == first
  files = sorted(p.name for p in cache.iterdir())
  assert files and all(name.endswith(('.npz', '.json')) for name in files)  # no pickle


def test_cache_key_names_everything_the_pld_depends_on(monkeypatch):
  base = dict(
    noise_multiplier=1.0, num_steps=10, discretization=0.02, tail_truncation=1e-8, bound='upper'
  )
  keys = {random_allocation.cache_key(**base)}
  for change in (
    dict(noise_multiplier=1.0 + 1e-12),
    dict(num_steps=11),
    dict(discretization=0.01),
    dict(tail_truncation=1e-9),
    dict(bound='lower'),
  ):
    keys.add(random_allocation.cache_key(**dict(base, **change)))
  monkeypatch.setattr(random_allocation, 'library_version', lambda: '9.9')
  keys.add(random_allocation.cache_key(**base))
  assert len(keys) == 7


def test_npz_round_trip_is_exact(tmp_path):
  pld = _library_pld(1.5, 4, 0.05, 1e-8, PLD_accounting.BoundType.DOMINATES)
  random_allocation.save_pld(pld, tmp_path / 'p.npz')
  back = random_allocation.load_pld(tmp_path / 'p.npz')
  for a, b in ((pld._pmf_remove, back._pmf_remove), (pld._pmf_add, back._pmf_add)):
    a = a.to_dense_pmf()
    assert (a._lower_loss, a._infinity_mass, a._pessimistic_estimate, a._discretization) == (
      b._lower_loss,
      b._infinity_mass,
      b._pessimistic_estimate,
      b._discretization,
    )
    np.testing.assert_array_equal(a._probs, b._probs)


@pytest.mark.slow
def test_timeout_falls_back_to_the_labelled_deterministic_bound(tmp_path, monkeypatch):
  monkeypatch.setenv('DPJAX_CACHE_DIR', str(tmp_path))
  monkeypatch.setattr(random_allocation, '_memo', {})
  calls = []

  def times_out(argv, **kwargs):
    calls.append(kwargs['timeout'])
    raise subprocess.TimeoutExpired(argv, kwargs['timeout'])

  monkeypatch.setattr(random_allocation.subprocess, 'run', times_out)
  bound = provable_bound.provable_epsilon(1.0, 20, DELTA, timeout=5.0)
  assert (
    bound.epsilon
    == bound.deterministic_epsilon
    == balls_and_bins.deterministic_epsilon(1.0, 1, DELTA)
  )
  assert bound.method.startswith('deterministic FALLBACK')
  assert '5.0 s' in bound.method and '--random-allocation-timeout' in bound.method
  assert 'privacy.random_allocation_timeout' in bound.method
  # Remembered with its budget, in-process and on disk: no larger budget is not tried again.
  assert (
    provable_bound.provable_epsilon(1.0, 20, DELTA, timeout=4.0).random_allocation_upper is None
  )
  monkeypatch.setattr(random_allocation, '_memo', {})
  provable_bound.provable_epsilon(1.0, 20, DELTA, timeout=5.0)
  assert calls == [5.0]
  provable_bound.provable_epsilon(1.0, 20, DELTA, timeout=6.0)
  assert calls == [5.0, 6.0]
  # The accountant carries the label into its report.
  sampler = samplers.sampler_class('balls_and_bins')(num_examples=1000, batch_size=50)
  report = accountant_lib.Accountant(
    sampler, 1.0, DELTA, random_allocation_timeout=6.0, max_batch_size=None
  ).epsilon_at(20, estimates=False)
  assert report.bound == 'upper' and report.details['method'].startswith('deterministic FALLBACK')


def test_real_child_is_killed_at_the_budget(tmp_path, monkeypatch):
  monkeypatch.setenv('DPJAX_CACHE_DIR', str(tmp_path))
  monkeypatch.setattr(random_allocation, '_memo', {})
  # Far too little time for even the child's imports.
  assert balls_and_bins.random_allocation_epoch_pld(1.0, 30, timeout=0.05) is None
  assert not list(tmp_path.glob('*.npz'))


def test_child_failure_is_an_error_with_its_stderr(tmp_path, monkeypatch):
  monkeypatch.setenv('DPJAX_CACHE_DIR', str(tmp_path))
  monkeypatch.setattr(random_allocation, '_memo', {})

  def fails(argv, **kwargs):
    raise subprocess.CalledProcessError(1, argv, stderr='Traceback ... boom')

  monkeypatch.setattr(random_allocation.subprocess, 'run', fails)
  with pytest.raises(RuntimeError, match='random-allocation PLD failed: .*boom'):
    provable_bound.provable_epsilon(1.5, 10, DELTA)


def test_default_grid_follows_poisson_epsilon():
  # ε_Poisson/12, two significant digits, within [MIN_GRID, MAX_GRID].
  assert random_allocation.default_discretization(1.0, 1000, DELTA) == 0.012
  assert random_allocation.default_discretization(0.5, 10, DELTA) == random_allocation.MAX_GRID
  assert random_allocation.default_discretization(50.0, 1000, DELTA) == random_allocation.MIN_GRID
  assert random_allocation.default_tail_truncation(1e-5) == 1e-8
  assert random_allocation.default_tail_truncation(1e-9) == 1e-12


def test_accountant_reports_monte_carlo_as_opt_in(cache, in_process_pld_builds):
  sampler = samplers.sampler_class('balls_and_bins')(num_examples=1000, batch_size=100)  # T = 10
  report = accountant_lib.Accountant(sampler, 1.0, DELTA, max_batch_size=None).epsilon_at(10)
  m = monte_carlo.default_num_samples(1.0, 10, DELTA)
  assert report.details['monte_carlo'].startswith('not computed (opt-in')
  assert f'{m} samples per direction' in report.details['monte_carlo']
  assert report.confidence is None and report.bound == 'upper'
  assert report.epsilon_lower == max(
    report.details['max_test_lower_bound'], report.details['random_allocation_lower']
  )
  assert report.epsilon_lower <= report.epsilon


def test_monte_carlo_workers_default_to_the_available_cores():
  sampler = samplers.sampler_class('balls_and_bins')(num_examples=1000, batch_size=100)
  acct = accountant_lib.Accountant(sampler, 1.0, DELTA, max_batch_size=None)
  assert acct.monte_carlo_workers == len(os.sched_getaffinity(0)) == monte_carlo.available_cores()
  assert acct.monte_carlo_samples is None  # chosen from δ and β when needed


def test_bad_budget_is_one_clear_error():
  sampler = samplers.sampler_class('balls_and_bins')(num_examples=1000, batch_size=100)
  with pytest.raises(ValueError, match='random_allocation_timeout must be'):
    accountant_lib.Accountant(
      sampler, 1.0, DELTA, random_allocation_timeout=-1, max_batch_size=None
    )
  with pytest.raises(ValueError, match='bound must be one of'):
    random_allocation.epoch_pld(1.0, 10, discretization=0.02, bound='middle')


def test_group_size_uses_the_deterministic_bound():
  bound = provable_bound.provable_epsilon(1.0, 10, DELTA, group_size=2)
  assert bound.epsilon == balls_and_bins.deterministic_epsilon(1.0, 1, DELTA, group_size=2)
  assert bound.random_allocation_upper is None and math.isfinite(bound.epsilon)


@pytest.mark.slow
def test_calibration_meets_the_target_in_few_builds(cache, monkeypatch, in_process_pld_builds):
  from dpjax.privacy.accounting import calibration  # pylint: disable=g-import-not-at-top

  builds = []
  real = random_allocation.subprocess.run

  def count(argv, **kwargs):
    builds.append(argv[-2])  # the bound
    return real(argv, **kwargs)

  monkeypatch.setattr(random_allocation.subprocess, 'run', count)
  sampler = samplers.sampler_class('balls_and_bins')(num_examples=1000, batch_size=100)  # T = 10
  target = 2.5
  sigma = calibration.calibrate_noise_multiplier(sampler, target, DELTA, 10, max_batch_size=None)
  eps = lambda s: accountant_lib.Accountant(sampler, s, DELTA, max_batch_size=None).epsilon(10)
  assert target * (1 - calibration.DEFAULT_EPSILON_RTOL) <= eps(sigma) <= target
  assert eps(0.99 * sigma) > target
  assert builds.count('upper') <= 7 and 'lower' not in builds  # estimates are not needed
  # Inside the provable bracket: below the deterministic σ.
  det = calibration.calibrate_noise_multiplier(
    sampler, target, DELTA, 10, random_allocation=False, max_batch_size=None
  )
  assert sigma < det


def test_finer_epochs_grid_over_budget_falls_back_to_the_one_epoch_grid(
  tmp_path, monkeypatch, in_process_pld_builds
):
  monkeypatch.setenv('DPJAX_CACHE_DIR', str(tmp_path))  # nothing built yet
  monkeypatch.setattr(random_allocation, '_memo', {})
  real = random_allocation.subprocess.run
  coarse = random_allocation.default_discretization(1.0, 10, DELTA)
  grids = []

  def fine_times_out(argv, **kwargs):
    grids.append(float(argv[-4]))
    if float(argv[-4]) < coarse:
      raise subprocess.TimeoutExpired(argv, kwargs['timeout'])
    return real(argv, **kwargs)

  monkeypatch.setattr(random_allocation.subprocess, 'run', fine_times_out)
  bound = provable_bound.provable_epsilon(1.0, 10, DELTA, num_epochs=4, timeout=30.0)
  assert grids[0] == coarse / 2 and bound.discretization == coarse
  assert 'missed the time budget' in bound.method and bound.method.startswith('random_alloc')
  pld = balls_and_bins.random_allocation_epoch_pld(1.0, 10, discretization=coarse)
  assert bound.epsilon == pld.self_compose(4).get_epsilon_for_delta(DELTA)


def test_config_field_sets_the_budget(cache, in_process_pld_builds):
  from dpjax.configs import digits_mlp  # pylint: disable=g-import-not-at-top

  config = digits_mlp.get_config()
  config.sampler.name = 'balls_and_bins'
  config.privacy.noise_multiplier, config.privacy.target_epsilon = 1.0, 0.0  # nothing to compute
  # make_accountant computes the final ε: T = 10, one epoch, the PLD built above (σ = 1).
  config.sampler.batch_size, config.num_epochs = 100, 1
  config.privacy.random_allocation_timeout = 7.5
  assert plan_lib.make_accountant(config, 1000).random_allocation_timeout == 7.5


def test_grid_refinement_within_a_budget_keeps_a_dominating_bound(
  cache, in_process_pld_builds, monkeypatch
):
  """Issue 34, item 9: with a refinement budget the random-allocation grid is halved while the
  next build (6× the last one's recorded seconds) fits: ε falls, and is the library's own
  dominating PLD at the grid reported (an upper bound), never below its dominated one. No
  budget (the default): the grid is not refined. Fails on da06065 (no `refine_seconds`),
  checked."""
  monkeypatch.setattr(random_allocation, 'build_seconds', lambda *args: 1.0)  # Every build: 1 s.
  sigma, steps = 2.0, 4
  plain = provable_bound.provable_epsilon(sigma, steps, DELTA)
  refined = provable_bound.provable_epsilon(sigma, steps, DELTA, refine_seconds=6.5)
  assert refined.discretization == plain.discretization / 2  # 6 s fit once in 6.5 s.
  assert refined.epsilon < plain.epsilon
  tail = random_allocation.default_tail_truncation(DELTA)
  upper = _library_pld(
    sigma, steps, refined.discretization, tail, PLD_accounting.BoundType.DOMINATES
  ).get_epsilon_for_delta(DELTA)
  lower = _library_pld(
    sigma, steps, refined.discretization, tail, PLD_accounting.BoundType.IS_DOMINATED
  ).get_epsilon_for_delta(DELTA)
  assert refined.epsilon == pytest.approx(upper, rel=1e-9) and lower <= refined.epsilon
  assert provable_bound.provable_epsilon(sigma, steps, DELTA) == plain  # Budget 0: unrefined.
