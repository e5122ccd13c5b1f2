"""The Accountant API: built from the training config, balls-and-bins consistency, reports."""

import json
import math
import subprocess

import pytest
from dp_accounting import dp_event

from dpjax.configs import digits_mlp
from dpjax.privacy import batching
from dpjax.trainer.planning import plan as plan_lib
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import report as report_lib
from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import max_test
from dpjax.privacy.accounting import monte_carlo
from dpjax.privacy.accounting import provable_bound
from dpjax.privacy.accounting import step_compositions

DELTA = 1e-5
NUM_DIGITS_TRAIN = 1437
# Balls-and-bins PLDs are built in this process (tests/conftest.py); tests/privacy/accounting/test_balls_and_bins.py
# tests the child process that dpjax uses for them.
pytestmark = pytest.mark.usefixtures('in_process_pld_builds')


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
  monkeypatch.setenv('DPJAX_CACHE_DIR', str(tmp_path))


def _config(**privacy):
  c = digits_mlp.get_config()
  c.privacy.noise_multiplier = 2.0
  c.privacy.target_epsilon = 0.0  # Unset.
  for k, v in privacy.items():
    setattr(c.privacy, k, v)
  return c


def _sampler(name, n, b):
  return samplers.sampler_class(name)(num_examples=n, batch_size=b)


# --- from the config --------------------------------------------------------------------------


def test_sampler_and_cap_come_from_the_training_code_paths():
  config = _config()
  acct = plan_lib.make_accountant(config, NUM_DIGITS_TRAIN)
  assert acct.sampler == plan_lib.make_sampler(config, NUM_DIGITS_TRAIN)
  steps = config.num_epochs * acct.steps_per_epoch
  assert acct.num_steps == steps
  assert acct.max_batch_size == batching.resolve_max_batch_size(
    acct.sampler, config.sampler.physical_batch_size, requested=0, num_steps=steps, delta=DELTA
  )
  report = acct.final_report(estimates=False)
  assert report.sampler == 'poisson' and report.accountant == 'pld' and report.bound == 'upper'
  assert report.details['max_batch_size'] == acct.max_batch_size
  # The auto cap costs (almost) nothing against the untruncated accountant.
  free = accountant_lib.Accountant(acct.sampler, 2.0, DELTA, max_batch_size=None).epsilon(steps)
  assert free <= report.epsilon <= free * 1.001


def test_epsilon_at_is_memoised():
  acct = plan_lib.make_accountant(_config(), NUM_DIGITS_TRAIN)
  first = acct.epsilon_at(100, estimates=False)
  computed = []
  real = acct._compute  # pylint: disable=protected-access
  acct._compute = lambda *args: computed.append(args) or real(*args)
  again = acct.epsilon_at(100, estimates=False)  # Counted, not timed: CI machines vary.
  assert not computed and again == first
  assert acct.epsilon_at(0).epsilon == 0.0
  assert acct.epsilon(50) < acct.epsilon(100)


def test_step_plds_and_compositions_are_built_once_per_process_for_each_event_and_grid(monkeypatch):
  """Accountants of one process share built step PLDs and their compositions; another σ, rate,
  grid or count is built anew, and ε is the one dp_accounting gives directly."""
  from dp_accounting.pld import pld_privacy_accountant  # pylint: disable=import-outside-toplevel
  from dpjax.privacy.accounting import pld_self_compose  # pylint: disable=import-outside-toplevel
  from dpjax.privacy.accounting import step_pld  # pylint: disable=import-outside-toplevel

  built, composed = [], []
  real = step_pld.step_pld
  real_compose = pld_self_compose.self_compose
  monkeypatch.setattr(step_pld, 'step_pld', lambda *args: built.append(args) or real(*args))
  monkeypatch.setattr(
    pld_self_compose,
    'self_compose',
    lambda pld, count, *a: composed.append(count) or real_compose(pld, count, *a),
  )
  monkeypatch.setattr(step_pld, 'BUILT_STEPS', step_pld.KeptPLDs(8))
  monkeypatch.setattr(step_pld, 'COMPOSED', step_pld.KeptPLDs(8))
  # A grid another test of this worker chose for the same query would skip the refinement.
  monkeypatch.setattr(step_compositions, 'CHOSEN_GRIDS', step_pld.KeptPLDs(8))
  sampler = _sampler('poisson', 10_000, 100)
  eps = lambda s, sigma, steps=300, **kw: accountant_lib.Accountant(
    s, sigma, DELTA, max_batch_size=None, **kw
  ).epsilon(steps)
  first = eps(sampler, 1.3, value_discretization_interval=1e-3)
  assert len(built) == 1 and composed == [300]
  assert eps(sampler, 1.3, value_discretization_interval=1e-3) == first
  assert len(built) == 1 and composed == [300]
  assert eps(sampler, 1.3, 200, value_discretization_interval=1e-3) < first
  assert len(built) == 1 and composed == [300, 200]
  others = [
    eps(sampler, 1.31, value_discretization_interval=1e-3),
    eps(_sampler('poisson', 10_000, 101), 1.3, value_discretization_interval=1e-3),
    eps(sampler, 1.3, value_discretization_interval=2e-3),
  ]
  assert len(built) == 4 and len(composed) == 5 and all(other != first for other in others)
  direct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
  direct.compose(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.3)), 300)
  assert first == pytest.approx(direct.get_epsilon(DELTA), rel=1e-9)
  # The grid that follows ε refines through several grids once; a second accountant (or the
  # trainer's next query of the same count) rebuilds and recomposes nothing.
  built.clear(), composed.clear()
  refined = eps(sampler, 1.3)
  assert len(built) >= 2 and len(composed) == len(built)
  assert eps(sampler, 1.3) == refined and len(composed) == len(built)


def test_target_epsilon_calibrates_sigma():
  config = _config(noise_multiplier=None, target_epsilon=3.0)
  acct = plan_lib.make_accountant(config, NUM_DIGITS_TRAIN)
  eps = acct.final_report(estimates=False).epsilon
  assert 0.99 * 3.0 <= eps <= 3.0


@pytest.mark.parametrize(
  'change, field',
  [
    (dict(enabled=False), 'privacy.enabled'),
    (dict(target_epsilon=0.5), 'above privacy.target_epsilon'),
    (dict(noise_multiplier=None), 'must be set'),
    (dict(delta=2.0), 'privacy.delta'),
    (dict(accountant='nope'), 'privacy.accountant'),
  ],
)
def test_config_errors(change, field):
  with pytest.raises(ValueError, match=field):
    plan_lib.make_accountant(_config(**change), NUM_DIGITS_TRAIN)


def test_sigma_within_the_target_is_accepted():
  acct = plan_lib.make_accountant(_config(target_epsilon=50.0), NUM_DIGITS_TRAIN)
  assert acct.noise_multiplier == 2.0


def test_config_needs_exactly_one_length():
  config = _config()
  config.num_steps = 10
  with pytest.raises(ValueError, match='num_steps'):
    plan_lib.make_accountant(config, NUM_DIGITS_TRAIN)


# --- balls-and-bins ---------------------------------------------------------------------------


@pytest.mark.slow
def test_balls_and_bins_bounds_are_consistent():
  sampler = _sampler('balls_and_bins', 1000, 100)  # T = 10 bins
  # One process draws the Monte-Carlo samples (the estimate does not depend on the count:
  # test_monte_carlo_workers_reach_the_estimate_and_do_not_change_it), here and below.
  acct = accountant_lib.Accountant(
    sampler,
    1.0,
    DELTA,
    monte_carlo_samples=100_000,
    monte_carlo_estimate=True,
    monte_carlo_workers=1,
    max_batch_size=None,
  )
  report = acct.epsilon_at(10)
  d = report.details
  det = balls_and_bins.deterministic_epsilon(1.0, 1, DELTA)
  assert report.bound == 'upper' and d['provable_method'].startswith('random_allocation_pld')
  assert report.epsilon == d['random_allocation_upper'] < det
  assert d['max_test_lower_bound'] == pytest.approx(
    max_test.balls_and_bins_lower_bound_epsilon(1.0, 10, DELTA), rel=1e-12
  )
  assert report.epsilon_lower >= d['max_test_lower_bound']
  # lower <= MC point estimate <= MC UCB, and the truth (<= provable) is near the point estimate.
  point = d['monte_carlo_epsilon_point_estimate_not_a_guarantee']
  ucb = d['monte_carlo_epsilon_high_probability']
  # The provable lower bound is below the point estimate up to Monte-Carlo error (docs §2):
  # the random-allocation lower bound (2.18) is within 0.3% of the truth here.
  assert report.epsilon_lower <= point * 1.01 and point <= ucb * (1 + 1e-9)
  assert point <= report.epsilon <= det
  assert ucb <= det
  assert (report.confidence, report.num_samples) == (0.999, 100_000)
  # A checkpoint in the middle of the epoch carries the whole epoch's ε.
  assert acct.epsilon_at(4).epsilon == report.epsilon
  assert acct.epsilon_at(4).steps == 4


@pytest.mark.slow
def test_balls_and_bins_multi_epoch_composes_the_one_epoch_pld():
  sampler = _sampler('balls_and_bins', 1000, 100)  # T = 10
  acct = accountant_lib.Accountant(sampler, 1.0, DELTA, max_batch_size=None)
  reports = [acct.epsilon_at(10 * e, estimates=False) for e in (2, 3)]
  for epochs, report in zip((2, 3), reports):
    assert 'composed' in report.details['provable_method']
    lower = max_test.balls_and_bins_lower_bound_epsilon(1.0, 10, DELTA, num_epochs=epochs)
    assert lower <= report.epsilon < balls_and_bins.deterministic_epsilon(1.0, epochs, DELTA)
  assert reports[0].epsilon < reports[1].epsilon
  # The one-epoch PLD is built once and cached on disk; the composed value is reproducible.
  pld = balls_and_bins.random_allocation_epoch_pld(
    1.0, 10, discretization=reports[1].details['random_allocation_grid']
  )
  assert pld.self_compose(3).get_epsilon_for_delta(DELTA) == reports[1].epsilon


def test_balls_and_bins_one_step_is_the_gaussian_mechanism():
  sampler = _sampler('balls_and_bins', 100, 100)  # T = 1
  report = accountant_lib.Accountant(
    sampler, 1.0, DELTA, monte_carlo_estimate=True, monte_carlo_workers=1, max_batch_size=None
  ).epsilon_at(1)
  gaussian = balls_and_bins.deterministic_epsilon(1.0, 1, DELTA)
  assert report.epsilon == gaussian
  assert balls_and_bins.gaussian_delta(1.0, gaussian) <= DELTA
  assert report.epsilon_lower == pytest.approx(gaussian, rel=1e-3)
  assert report.details['monte_carlo_epsilon_high_probability'] >= report.epsilon_lower


def test_monte_carlo_accountant_is_labelled_high_probability():
  sampler = _sampler('balls_and_bins', 500, 50)  # T = 10; δ = 1e-3 < 1/N.
  acct = accountant_lib.Accountant(
    sampler,
    1.0,
    1e-3,
    accountant='monte_carlo',
    monte_carlo_samples=20_000,
    beta=1e-2,
    monte_carlo_workers=1,
    max_batch_size=None,
  )
  report = acct.epsilon_at(20, estimates=False)
  assert report.bound == 'high_probability_upper' and report.accountant == 'monte_carlo'
  assert (report.confidence, report.num_samples) == (0.99, 20_000)
  assert report.epsilon == report.details['monte_carlo_epsilon_high_probability']
  assert report.epsilon <= report.details['deterministic_epsilon']
  assert report.details['epochs_accounted'] == 2


def test_monte_carlo_workers_reach_the_estimate_and_do_not_change_it(monkeypatch):
  sampler = _sampler('balls_and_bins', 500, 50)  # T = 10; δ = 1e-3 < 1/N.
  options = dict(accountant='monte_carlo', monte_carlo_samples=20_000, beta=1e-2)
  serial = accountant_lib.Accountant(
    sampler, 1.0, 1e-3, monte_carlo_workers=1, max_batch_size=None, **options
  ).epsilon_at(20, estimates=False)
  seen = []
  real = monte_carlo.balls_and_bins_epsilon

  def spy(*args, **kwargs):
    seen.append(kwargs['workers'])
    return real(*args, **kwargs)

  monkeypatch.setattr(monte_carlo, 'balls_and_bins_epsilon', spy)
  parallel = accountant_lib.Accountant(
    sampler, 1.0, 1e-3, monte_carlo_workers=2, max_batch_size=None, **options
  ).epsilon_at(20, estimates=False)
  assert seen == [2]
  assert parallel.epsilon == serial.epsilon
  assert parallel.details == serial.details


def test_monte_carlo_workers_from_the_config():
  config = _config()  # None (the default): the available cores.
  assert (
    plan_lib.make_accountant(config, NUM_DIGITS_TRAIN).monte_carlo_workers
    == monte_carlo.available_cores()
  )
  config.privacy.monte_carlo_workers = 2
  assert plan_lib.make_accountant(config, NUM_DIGITS_TRAIN).monte_carlo_workers == 2
  assert (
    plan_lib.make_accountant(config, NUM_DIGITS_TRAIN, monte_carlo_workers=1).monte_carlo_workers
    == 1
  )
  config.privacy.monte_carlo_workers = 0
  with pytest.raises(ValueError, match='privacy.monte_carlo_workers'):
    plan_lib.make_accountant(config, NUM_DIGITS_TRAIN)
  with pytest.raises(ValueError, match='monte_carlo_workers'):
    accountant_lib.Accountant(
      _sampler('balls_and_bins', 1000, 100),
      1.0,
      DELTA,
      monte_carlo_workers=1.5,
      max_batch_size=None,
    )


def test_balls_and_bins_truncation_penalty():
  sampler = _sampler('balls_and_bins', 10_000, 100)  # T = 100, n_t ~ Binomial(10^4, 0.01)
  plain = accountant_lib.Accountant(
    sampler, 2.0, DELTA, random_allocation=False, max_batch_size=None
  )
  capped = accountant_lib.Accountant(
    sampler, 2.0, DELTA, random_allocation=False, max_batch_size=170
  )
  report = capped.epsilon_at(200, estimates=False)
  tau = report.details['truncation_mass']
  assert tau == pytest.approx(
    math.exp(balls_and_bins.log_truncation_mass(10_000, 0.01, 170, 200)), rel=1e-9
  )
  assert 0 < tau < DELTA / 100
  eps = report.epsilon
  assert plain.epsilon(200) < eps < plain.epsilon(200) * 1.01
  # (ε, δ₀)-DP untruncated + TV: δ₀ + (1 + e^ε)·τ <= δ, with δ₀ the Gaussian's δ(ε), 2 epochs.
  assert balls_and_bins.gaussian_delta(2.0 / math.sqrt(2), eps) + (1 + math.exp(eps)) * tau <= DELTA
  # A cap so tight that (1 + e^ε)·τ exceeds δ at every useful ε: no guarantee, said plainly.
  tight = accountant_lib.Accountant(
    sampler, 2.0, DELTA, random_allocation=False, max_batch_size=160
  )
  assert tight.epsilon(200) == math.inf


@pytest.mark.slow
def test_random_allocation_pays_the_truncation_penalty_at_its_own_epsilon():
  # Regression (experiments/06_truncation): the penalty (1 + e^ε)·τ priced at the
  # deterministic ε (7.0 here) ate δ and gave ε = ∞, though the random-allocation PLD with the
  # same τ is finite (2.93). T = 6, σ = 1.5, 5 epochs, τ = δ/100: e^{ε_det}·τ > δ.
  sigma, steps, epochs, tau = 1.5, 6, 5, DELTA / 100
  bound = provable_bound.provable_epsilon(
    sigma, steps, DELTA, num_epochs=epochs, log_penalty_mass=math.log(tau)
  )
  assert (1 + math.exp(balls_and_bins.deterministic_epsilon(sigma, epochs, DELTA))) * tau > DELTA
  assert bound.method.startswith('random_allocation_pld')
  pld = balls_and_bins.random_allocation_epoch_pld(
    sigma, steps, discretization=bound.discretization
  ).self_compose(epochs)
  eps = bound.epsilon
  assert math.isfinite(eps)
  # Valid: the dominating PLD's δ(ε) plus the penalty fits in δ; and not loose: 1% less fails.
  assert pld.get_delta_for_epsilon(eps) + (1 + math.exp(eps)) * tau <= DELTA
  assert pld.get_delta_for_epsilon(0.99 * eps) + (1 + math.exp(0.99 * eps)) * tau > DELTA
  untruncated = provable_bound.provable_epsilon(sigma, steps, DELTA, num_epochs=epochs)
  assert untruncated.epsilon <= eps < untruncated.deterministic_epsilon


def test_group_balls_and_bins_falls_back_to_deterministic():
  sampler = _sampler('balls_and_bins', 1000, 100)
  report = accountant_lib.Accountant(
    sampler, 2.0, DELTA, group_size=2, max_batch_size=None
  ).epsilon_at(10)
  assert report.epsilon == balls_and_bins.deterministic_epsilon(2.0, 1, DELTA, group_size=2)
  assert report.epsilon_lower <= report.epsilon
  assert 'monte_carlo_epsilon_high_probability' not in report.details


# --- the report -------------------------------------------------------------------------------


@pytest.mark.slow
def test_report_json_has_the_documented_keys():
  report = accountant_lib.Accountant(_sampler('shuffle', 1000, 100), 1.0, DELTA).epsilon_at(25)
  loaded = json.loads(report.to_json())
  for key in (
    'epsilon',
    'delta',
    'noise_multiplier',
    'steps',
    'steps_per_epoch',
    'sampler',
    'accountant',
    'bound',
    'epsilon_lower',
    'confidence',
    'num_samples',
    'details',
  ):
    assert key in loaded
  assert loaded['bound'] in report_lib.BOUNDS
  assert loaded['steps'] == 25 and loaded['details']['epochs_accounted'] == 3
  assert loaded['epsilon'] == report.epsilon


@pytest.mark.slow
def test_epsilon_ahead_returns_the_accountants_own_reports():
  """Reports computed ahead on the background thread equal direct calls, estimates included."""
  from dpjax.privacy.accounting import ahead  # pylint: disable=import-outside-toplevel

  sampler = samplers.PoissonSampler(num_examples=1000, batch_size=50, seed=0)
  direct = accountant_lib.Accountant(sampler, 1.1, 1e-5, max_batch_size=None)
  with ahead.EpsilonAhead(
    accountant_lib.Accountant(sampler, 1.1, 1e-5, max_batch_size=None), [5, 10, 15, 20]
  ) as e:
    assert e.epsilon_at(5) == direct.epsilon_at(5, estimates=False)
    assert e.epsilon_at(15) == direct.epsilon_at(15, estimates=False)  # 10 skipped: dropped.
    assert e.epsilon_at(20, estimates=True) == direct.epsilon_at(20, estimates=True)
    assert e.epsilon_at(7) == direct.epsilon_at(7, estimates=False)  # Not announced.


def test_epsilon_if_ready_never_waits_and_drops_passed_steps():
  """A log row takes ε only when it is ready; the worker skips the steps the loop has passed."""
  import threading  # pylint: disable=import-outside-toplevel
  from dpjax.privacy.accounting import ahead  # pylint: disable=import-outside-toplevel

  sampler = samplers.PoissonSampler(num_examples=1000, batch_size=50, seed=0)
  real = accountant_lib.Accountant(sampler, 1.1, 1e-5, max_batch_size=None)
  release, asked = threading.Event(), []

  class Slow:  # The accountant's reports, each held until the test releases the worker.
    def epsilon_at(self, step, estimates=False):
      asked.append(step)
      assert release.wait(10)
      return real.epsilon_at(step, estimates=estimates)

  with ahead.EpsilonAhead(Slow(), [10, 20, 30, 40, 50]) as e:
    assert e.epsilon_if_ready(10) is None  # Computing 10: not ready, and no wait.
    assert e.epsilon_if_ready(20) is None
    assert e.epsilon_if_ready(40) is None  # 20 and 30 passed: dropped unless running.
    release.set()
    assert e.epsilon_at(50) == real.epsilon_at(50, estimates=False)  # A checkpoint waits.
    assert 20 not in asked and 30 not in asked  # Only the running 10 and the newest ran.
    assert asked[0] == 10 and asked[-1] == 50
  with ahead.EpsilonAhead(real, [10, 20]) as e:
    e.epsilon_at(10)
    for _ in range(1000):  # 20 was computed ahead meanwhile: ready without asking twice.
      got = e.epsilon_if_ready(20)
      if got is not None:
        break
      threading.Event().wait(0.01)
    assert got == real.epsilon_at(20, estimates=False)


def test_epsilon_ahead_keeps_its_thread_busy_at_most_busy_fraction():
  """Queries ahead of time leave the host to the training loop: after a query of d seconds the
  next one ahead starts >= d(1 - f)/f later; a step asked for with epsilon_at runs at once."""
  import time  # pylint: disable=import-outside-toplevel
  from dpjax.privacy.accounting import ahead  # pylint: disable=import-outside-toplevel

  spans = []

  class Timed:  # Each query takes 50 ms; records (step, start, end).
    def epsilon_at(self, step, estimates=False):
      start = time.monotonic()
      time.sleep(0.05)
      spans.append((step, start, time.monotonic()))
      return step

  with pytest.raises(ValueError, match='busy_fraction'):
    ahead.EpsilonAhead(Timed(), [], busy_fraction=0)
  with ahead.EpsilonAhead(Timed(), range(1, 10**6), busy_fraction=0.25) as e:
    got, deadline = [], time.monotonic() + 1.5
    step = 0
    while time.monotonic() < deadline:  # A fast loop logging every step.
      step += 1
      got.append(e.epsilon_if_ready(step))
      time.sleep(0.002)
    asked_at = time.monotonic()
    assert e.epsilon_at(step + 1) == step + 1  # A checkpoint: at once, budget or not.
    assert spans[-1][1] - asked_at < 0.04 or spans[-2][2] > asked_at  # Only a running one first.
  queries = spans[:-1]
  busy = sum(end - start for _, start, end in queries)
  assert 3 <= len(queries) and busy / 1.5 < 0.25 + 0.05
  for (_, _, end), (_, start, _) in zip(queries, queries[1:]):
    assert start - end >= 0.05 * 3 * 0.9  # d(1 - f)/f = 3d, with timer slack.
  assert all(r is None or r <= s for s, r in enumerate(got, 1))  # Never a later step's report.


@pytest.mark.parametrize('accountant', ['pld', 'monte_carlo'])
def test_balls_and_bins_cap_whose_penalty_exceeds_delta_reports_infinity_and_says_why(accountant):
  """B = 70 at b = 50: Pr[some bin > B over 40 steps] ≈ 0.1 > δ. ε = ∞ is the honest bound; it
  used to fail with 'delta must be in (0, 1), got 0.0' while sizing the Monte-Carlo estimate."""
  sampler = samplers.BallsAndBinsSampler(num_examples=1000, batch_size=50, seed=0)
  report = accountant_lib.Accountant(
    sampler, 1.2, 1e-5, accountant=accountant, max_batch_size=70, random_allocation=False
  ).epsilon_at(40)
  assert report.epsilon == math.inf
  assert 'raise max_batch_size' in report.details['truncation_note']
  assert report.details['truncation_mass'] > 1e-5
