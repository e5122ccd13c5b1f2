"""Per-sampler ε against dp_accounting computed directly here (PLD, RDP, Gaussian, MoG)."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import stats

from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import sampler_events

DELTA = 1e-5
# PLD discretisation for the slower events (both sides use the same, so the comparisons stay
# exact): 3e-3 moves these ε by <= 1 % against 1e-3 and builds the mixtures 3x faster.
COARSE = 3e-3
# The group mixtures at 1e-2 on both sides (dp_accounting's mixture PLD costs per grid point, 3x
# less than at COARSE): the comparison stays exact, and a wrong count distribution or a group
# size ignored moves ε by far more than the 1e-6 allowed (k = 3: ε 2.2 against 0.5 for k = 1).
GROUP_GRID = 1e-2


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
  monkeypatch.setenv('DPJAX_CACHE_DIR', str(tmp_path))


def _sampler(name, n, b):
  return samplers.sampler_class(name)(num_examples=n, batch_size=b)


def _pld_epsilon(event, count, interval=1e-4):
  acct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
  acct.compose(event, count)
  return acct.get_epsilon(DELTA)


def _rdp_epsilon(event, count):
  acct = rdp_privacy_accountant.RdpAccountant()
  acct.compose(event, count)
  return acct.get_epsilon(DELTA)


# --- Poisson ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_poisson_pld_and_rdp_match_dp_accounting():
  sampler = _sampler('poisson', 60_000, 256)
  q = 256 / 60_000
  event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(1.1))
  pld = accountant_lib.Accountant(sampler, 1.1, DELTA, max_batch_size=None).epsilon_at(3000)
  rdp = accountant_lib.Accountant(
    sampler, 1.1, DELTA, accountant='rdp', max_batch_size=None
  ).epsilon_at(3000)
  # dp_accounting at the grid the report names (the grid follows ε: test_pld_grid.py).
  assert pld.epsilon == pytest.approx(_pld_epsilon(event, 3000, pld.details['pld_grid']), rel=1e-9)
  assert rdp.epsilon == pytest.approx(_rdp_epsilon(event, 3000), rel=1e-9)
  assert (pld.accountant, rdp.accountant, pld.bound) == ('pld', 'rdp', 'upper')
  assert pld.epsilon < rdp.epsilon
  assert pld.details['rdp_epsilon'] == pytest.approx(rdp.epsilon, rel=1e-9)


@pytest.mark.slow
def test_poisson_exact_truncated_event_reference():
  # docs/accounting.md §1: N = 1e4, q = 0.01, σ = 1, 5000 steps, δ = 1e-5: ≈4.20 untruncated,
  # ≈5.60 at B = 130 (the penalty is large, so the exact truncated event decides).
  sampler = _sampler('poisson', 10_000, 100)
  plain = accountant_lib.Accountant(
    sampler, 1.0, DELTA, value_discretization_interval=COARSE, max_batch_size=None
  )
  capped = accountant_lib.Accountant(
    sampler, 1.0, DELTA, max_batch_size=130, value_discretization_interval=COARSE
  )
  assert plain.epsilon(5000) == pytest.approx(4.20, rel=0.01)
  report = capped.epsilon_at(5000, estimates=False)
  assert report.epsilon == pytest.approx(5.60, rel=0.01)
  assert report.details['method'] == 'pld(truncated_subsampled_gaussian)'
  # Both neighbouring dataset sizes are evaluated; the report is the worse.
  direct = max(
    _pld_epsilon(dp_event.TruncatedSubsampledGaussianDpEvent(n, 0.01, 130, 1.0), 5000, COARSE)
    for n in (10_000, 10_001)
  )
  assert report.epsilon == pytest.approx(direct, rel=1e-9)


@pytest.mark.slow
def test_poisson_tv_truncation_penalty():
  sampler = _sampler('poisson', 10_000, 100)
  steps = 2000
  untruncated = accountant_lib.Accountant(sampler, 1.0, DELTA, max_batch_size=None).epsilon(steps)
  capped = accountant_lib.Accountant(sampler, 1.0, DELTA, max_batch_size=180)
  report = capped.epsilon_at(steps, estimates=False)
  tau = steps * stats.binom.sf(180, 10_001, 0.01)
  assert report.details['truncation_mass'] == pytest.approx(tau, rel=1e-6)
  assert report.details['method'] == 'pld + tv_truncation_penalty'
  # Valid: δ(ε) of the untruncated PLD plus (1 + e^ε)τ fits in δ; and it costs almost nothing.
  event = dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.0))
  acct = pld_privacy_accountant.PLDAccountant()
  acct.compose(event, steps)
  assert acct.get_delta(report.epsilon) + (1 + math.exp(report.epsilon)) * tau <= DELTA
  assert untruncated <= report.epsilon <= untruncated * 1.001


def test_truncation_mass_in_log_space_at_ten_million():
  log_tau = balls_and_bins.log_truncation_mass(10**7, 1e-3, 11_000, 10**5)
  reference = math.log(1e5) + stats.binom.logsf(11_000, 10**7 + 1, 1e-3)
  assert np.isfinite(log_tau) and log_tau == pytest.approx(reference, rel=1e-12)
  assert balls_and_bins.log_truncation_mass(10**7, 1e-3, 10**7 + 5, 10) == -math.inf


# --- deterministic, shuffle -------------------------------------------------------------------


def test_deterministic_is_the_gaussian_composed_per_epoch():
  sampler = _sampler('deterministic', 10_000, 100)  # T = 100
  acct = accountant_lib.Accountant(sampler, 2.0, DELTA)
  reference = _pld_epsilon(dp_event.GaussianDpEvent(2.0), 3)
  got = acct.epsilon_at(300).epsilon
  assert got == pytest.approx(reference, rel=1e-3)
  # Exact closed form (rounded up), so never below the Gaussian's true ε: δ(ε) <= δ.
  assert balls_and_bins.gaussian_delta(2.0 / math.sqrt(3), got) <= DELTA
  # Mid-epoch checkpoints carry the ε of the epochs started so far.
  assert acct.epsilon_at(201).epsilon == got
  assert acct.epsilon_at(200).epsilon < got
  assert acct.epsilon_at(201).steps == 201 and acct.epsilon_at(201).details['epochs_accounted'] == 3
  rdp = accountant_lib.Accountant(sampler, 2.0, DELTA, accountant='rdp').epsilon(300)
  assert rdp == pytest.approx(_rdp_epsilon(dp_event.GaussianDpEvent(2.0), 3), rel=1e-9)


def test_shuffle_upper_is_deterministic_never_poisson():
  sampler = _sampler('shuffle', 10_000, 100)
  acct = accountant_lib.Accountant(sampler, 1.0, DELTA)
  report = acct.epsilon_at(100)
  det = balls_and_bins.deterministic_epsilon(1.0, 1, DELTA)
  assert report.epsilon == det and report.bound == 'upper'
  assert report.epsilon_lower <= report.epsilon
  poisson = report.details['as_if_poisson_not_a_guarantee']
  event = dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.0))
  grid = acct.pld_grid(sampler_events.poisson_step_event(0.01, 1.0), 100)['pld_grid']
  assert poisson == pytest.approx(_pld_epsilon(event, 100, grid), rel=1e-9)
  # The docs' point: the shuffle lower bound exceeds the Poisson number one might report.
  assert report.epsilon_lower > poisson
  assert report.epsilon != poisson


# --- fixed size -------------------------------------------------------------------------------


@pytest.mark.slow
def test_fixed_size_mog_matches_dp_accounting():
  sampler = _sampler('fixed_size', 50_000, 120)
  steps = 416 * 4
  acct = accountant_lib.Accountant(sampler, 6.0, DELTA)
  mog = dp_event.MixtureOfGaussiansDpEvent(6.0, [0, 2], [1 - 120 / 50_000, 120 / 50_000])
  report = acct.epsilon_at(steps)
  assert report.epsilon == pytest.approx(
    _pld_epsilon(mog, steps, report.details['pld_grid']), rel=1e-6
  )
  # PLD (tight) <= FS-RDP (add/remove) < Wang et al. (replace-one, a different adjacency).
  assert report.epsilon < report.details['fs_rdp_epsilon']
  assert report.details['fs_rdp_epsilon'] < report.details['wang_et_al_rdp_replace_one_epsilon']
  rdp = accountant_lib.Accountant(sampler, 6.0, DELTA, accountant='rdp').epsilon(steps)
  assert rdp == report.details['fs_rdp_epsilon']


@pytest.mark.slow
def test_fixed_size_with_replacement_dominates_without():
  n, b, sigma, steps = 1000, 10, 3.0, 100
  wr = accountant_lib.Accountant(
    _sampler('fixed_size_with_replacement', n, b),
    sigma,
    DELTA,
    value_discretization_interval=COARSE,
  ).epsilon(steps)
  wor = accountant_lib.Accountant(
    _sampler('fixed_size', n, b), sigma, DELTA, value_discretization_interval=COARSE
  ).epsilon(steps)
  counts = np.arange(b + 1)
  mog = dp_event.MixtureOfGaussiansDpEvent(
    sigma, list(2 * counts), list(stats.binom.pmf(counts, b, 1 / n))
  )
  assert wr == pytest.approx(_pld_epsilon(mog, steps, COARSE), rel=1e-3)
  assert wor < wr < wor * 1.05  # Repeats (K >= 2) are rare at b/N = 1%.


def test_mixture_trimming_is_pessimistic():
  event = sampler_events.fixed_size_with_replacement_step_event(10_000, 256, 1.0)
  assert len(event.sensitivities) < 257
  assert event.sensitivities[-1] == 2 * 256  # The trimmed tail sits on the largest sensitivity.
  assert math.isclose(sum(event.sampling_probs), 1.0, rel_tol=1e-12)


# --- group privacy ----------------------------------------------------------------------------


@pytest.mark.slow
def test_group_poisson_is_binomial_mog():
  sampler = _sampler('poisson', 10_000, 100)
  k, steps = 3, 500
  report = accountant_lib.Accountant(
    sampler,
    1.5,
    DELTA,
    group_size=k,
    value_discretization_interval=GROUP_GRID,
    max_batch_size=None,
  ).epsilon_at(steps)
  counts = np.arange(k + 1)
  mog = dp_event.MixtureOfGaussiansDpEvent(
    1.5, list(counts), list(stats.binom.pmf(counts, k, 0.01))
  )
  assert report.epsilon == pytest.approx(_pld_epsilon(mog, steps, GROUP_GRID), rel=1e-6)
  one = accountant_lib.Accountant(sampler, 1.5, DELTA, max_batch_size=None).epsilon(steps)
  assert one < report.epsilon < report.details['group_conversion_epsilon_comparison_only']


@pytest.mark.slow
def test_group_fixed_size_is_hypergeometric_mog():
  sampler = _sampler('fixed_size', 5000, 50)
  k, steps = 2, 300
  report = accountant_lib.Accountant(
    sampler, 3.0, DELTA, group_size=k, value_discretization_interval=GROUP_GRID
  ).epsilon_at(steps)
  counts = np.arange(k + 1)
  mog = dp_event.MixtureOfGaussiansDpEvent(
    3.0, list(2 * counts), list(stats.hypergeom.pmf(counts, 5000, k, 50))
  )
  assert report.epsilon == pytest.approx(_pld_epsilon(mog, steps, GROUP_GRID), rel=1e-6)
  assert report.epsilon < report.details['group_conversion_epsilon_comparison_only']


def test_group_deterministic_has_sensitivity_k():
  sampler = _sampler('deterministic', 1000, 100)
  got = accountant_lib.Accountant(sampler, 4.0, DELTA, group_size=2).epsilon(20)  # 2 epochs
  assert got == pytest.approx(balls_and_bins.deterministic_epsilon(2.0, 2, DELTA), rel=1e-9)
  assert got == pytest.approx(_pld_epsilon(dp_event.GaussianDpEvent(2.0), 2), rel=1e-3)


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'name, kwargs, field',
  [
    ('poisson', dict(noise_multiplier=0.0), 'noise_multiplier'),
    ('poisson', dict(noise_multiplier=-1.0), 'noise_multiplier'),
    ('poisson', dict(delta=0.0), 'delta'),
    ('poisson', dict(delta=1.0), 'delta'),
    ('poisson', dict(group_size=0), 'group_size'),
    ('poisson', dict(group_size=2000), 'group_size'),
    ('poisson', dict(accountant='bogus'), 'accountant'),
    ('poisson', dict(accountant='monte_carlo'), 'monte_carlo'),
    ('poisson', dict(accountant='rdp', group_size=2), 'group_size'),
    ('balls_and_bins', dict(accountant='rdp'), 'rdp'),
    ('balls_and_bins', dict(accountant='monte_carlo', group_size=2), 'group_size'),
    ('fixed_size_with_replacement', dict(accountant='rdp'), 'rdp'),
    ('shuffle', dict(max_batch_size=50), 'max_batch_size'),
    ('fixed_size', dict(max_batch_size=0), 'max_batch_size'),
  ],
)
def test_bad_input_is_rejected_before_compute(name, kwargs, field):
  args = dict(noise_multiplier=1.0, delta=DELTA)
  args.update(kwargs)
  sampler = _sampler(name, 1000, 100)
  with pytest.raises(ValueError, match=field):
    accountant_lib.Accountant(sampler, args.pop('noise_multiplier'), args.pop('delta'), **args)


def test_event_level_validation():
  with pytest.raises(ValueError, match='sampling probability'):
    sampler_events.poisson_step_event(1.5, 1.0)
  with pytest.raises(ValueError, match='batch_size'):
    sampler_events.fixed_size_step_event(10, 11, 1.0)
  with pytest.raises(ValueError, match='step'):
    accountant_lib.Accountant(
      _sampler('poisson', 100, 10), 1.0, DELTA, max_batch_size=None
    ).epsilon_at(-1)
