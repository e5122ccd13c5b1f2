"""Cyclic Poisson sampling and its accounting (issue 36): ⌈T/k⌉ Poisson-subsampled Gaussian
participations at rate bk/N, for DP-SGD's noise and for BandMF with ≤ k bands, against
dp_accounting called directly; the sampler's draws against their law; the combinations that
are refused."""

import contextlib
import io
import itertools
import json

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import linalg
from scipy import stats

from dpjax import account
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.correlated import strategy


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
  monkeypatch.setenv('DPJAX_CACHE_DIR', str(tmp_path))


def _account_json(*argv):
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    assert account.main([*argv, '--json']) == 0
  return json.loads(stdout.getvalue())


def _dp_accounting_pld(q, sigma, count, delta, grid):
  acct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=grid)
  acct.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), count)
  return acct.get_epsilon(delta)


def test_bandmf_with_four_bands_and_groups_is_100_poisson_steps_at_rate_004():
  """Issue 36's case: N = 10⁴, b = 100, k = 4 bands and groups, T = 400, σ = 1, δ = 1e-6:
  the reported upper bound is dp_accounting's 100 Poisson-subsampled Gaussian steps at
  q = 0.04, at the grid the report names. Accounting T = 400 steps at q = 0.01 (Poisson's
  answer for the same b) gives a smaller ε: a sampler mistaken for Poisson fails here."""
  report = _account_json(
    '--sampler=cyclic_poisson',
    '--num-examples=10000',
    '--batch-size=100',
    '--num-groups=4',
    '--noise=bandmf',
    '--num-bands=4',
    '--steps=400',
    '--noise-multiplier=1',
    '--delta=1e-6',
  )
  details = report['details']
  assert report['bound'] == 'upper' and (details['noise'], details['num_bands']) == ('bandmf', 4)
  assert details['participations'] == 100 and details['participation_probability'] == 0.04
  direct = _dp_accounting_pld(0.04, 1.0, 100, 1e-6, details['pld_grid'])
  assert report['epsilon'] == pytest.approx(direct, rel=1e-9)
  as_if_poisson = _dp_accounting_pld(0.01, 1.0, 400, 1e-6, details['pld_grid'])
  assert as_if_poisson < 0.75 * report['epsilon']


def test_one_group_is_poisson_and_rdp_is_dp_accountings():
  """k = 1 is Poisson sampling: the same ε, PLD and RDP; RDP of ⌈T/k⌉ steps at bk/N is
  dp_accounting's RdpAccountant's; T not a multiple of k counts the partial cycle."""
  n, b, sigma, delta = 2000, 20, 1.2, 1e-5
  one = samplers.make('cyclic_poisson', n, b, num_groups=1)
  poisson = samplers.make('poisson', n, b)
  for name in ('pld', 'rdp'):
    ours = accountant_lib.Accountant(one, sigma, delta, accountant=name, max_batch_size=None)
    theirs = accountant_lib.Accountant(poisson, sigma, delta, accountant=name, max_batch_size=None)
    assert ours.epsilon(300) == pytest.approx(theirs.epsilon(300), rel=1e-12)
  three = samplers.make('cyclic_poisson', n, b, num_groups=3)
  rdp = accountant_lib.Accountant(three, sigma, delta, accountant='rdp', max_batch_size=None)
  direct = rdp_privacy_accountant.RdpAccountant()
  direct.compose(dp_event.PoissonSampledDpEvent(0.03, dp_event.GaussianDpEvent(sigma)), 101)
  assert rdp.epsilon(301) == pytest.approx(direct.get_epsilon(delta), rel=1e-9)


def test_a_cap_pays_the_tv_penalty_of_binomial_n_plus_one_b_over_n():
  """Each step's batch is Binomial(N, b/N) marginally, so a cap B costs τ = T·Pr[Bin(N + 1,
  b/N) > B] (not bk/N, the within-group rate: that τ would be ~1)."""
  sampler = samplers.make('cyclic_poisson', 10_000, 100, num_groups=4)
  acct = accountant_lib.Accountant(sampler, 1.0, 1e-6, max_batch_size=180)
  report = acct.epsilon_at(400)
  tau = 400 * stats.binom.sf(180, 10_001, 0.01)
  assert report.details['truncation_mass'] == pytest.approx(tau, rel=1e-9)
  assert report.details['method'].endswith('tv_truncation_penalty')
  plain = accountant_lib.Accountant(sampler, 1.0, 1e-6, max_batch_size=None).epsilon(400)
  assert plain < report.epsilon < plain * 1.02


@pytest.mark.parametrize(
  'sampler, fields, match',
  [
    ('poisson', {}, 'accounted for sampler cyclic_poisson'),
    ('balls_and_bins', {}, 'accounted for sampler cyclic_poisson'),
    ('cyclic_poisson', {'num_groups': 3}, 'num_bands = 4 must be <= .* num_groups = 3'),
  ],
)
def test_bandmf_where_sampling_does_not_amplify_it_is_refused(sampler, fields, match):
  """Participations closer than the bands overlap in C (their sensitivity adds cross terms),
  and samplers without the cyclic structure are not analysed for correlated noise: refused,
  never accounted as DP-SGD."""
  s = samplers.make(sampler, 1000, 10, **fields)
  with pytest.raises(ValueError, match=match):
    accountant_lib.Accountant(s, 1.0, 1e-5, max_batch_size=None, noise='bandmf', num_bands=4)


def test_group_privacy_is_refused_and_options_are_checked():
  s = samplers.make('cyclic_poisson', 1000, 10, num_groups=2)
  with pytest.raises(ValueError, match='not analysed for sampler'):
    accountant_lib.Accountant(s, 1.0, 1e-5, max_batch_size=None, group_size=2)
  with pytest.raises(ValueError, match="num_bands = 2 needs noise = 'bandmf'"):
    accountant_lib.Accountant(s, 1.0, 1e-5, max_batch_size=None, num_bands=2)
  with pytest.raises(ValueError, match='batch_size \\* num_groups'):
    samplers.make('cyclic_poisson', 100, 30, num_groups=4)
  with pytest.raises(ValueError, match='num_groups must be an integer'):
    samplers.make('cyclic_poisson', 100, 10, num_groups=0)


def test_batches_come_from_one_group_each_at_the_stated_rates():
  """Step t holds members of group t mod k only; the groups are i.i.d. uniform (χ², fixed
  seed); within a group each member joins at p = bk/N (χ² of the per-member counts over the
  group's steps against Binomial(S, p)); E[n_t] = b. Removing the last example changes no
  other example's group."""
  n, b, k, steps = 3000, 30, 3, 600
  sampler = samplers.make('cyclic_poisson', n, b, seed=11, num_groups=k)
  groups = sampler.groups()
  sizes = np.bincount(groups, minlength=k)
  assert stats.chisquare(sizes).pvalue > 1e-3
  counts = np.zeros(n, np.int64)
  batch_sizes = []
  for t in range(steps):
    idx = sampler.indices(t)
    assert np.all(groups[idx] == t % k) and len(np.unique(idx)) == len(idx)
    counts[idx] += 1
    batch_sizes.append(len(idx))
  p = b * k / n
  per_group_steps = steps // k
  observed = np.bincount(counts, minlength=per_group_steps + 1)
  law = stats.binom(per_group_steps, p)
  cut = 12  # Pool the tail so every expected cell is >= 5.
  expected = n * np.append(law.pmf(np.arange(cut)), law.sf(cut - 1))
  observed = np.append(observed[:cut], observed[cut:].sum())
  assert stats.chisquare(observed, expected).pvalue > 1e-3
  assert abs(np.mean(batch_sizes) - b) < 4 * np.sqrt(b / steps)
  smaller = samplers.make('cyclic_poisson', n - 1, b, seed=11, num_groups=k)
  np.testing.assert_array_equal(smaller.groups(), groups[:-1])


def test_attack_the_true_privacy_curve_of_bandmf_with_cyclic_poisson_is_under_the_bound():
  """The attack: T = 4 steps, k = 2 groups at p = bk/N = 1/2, a 2-banded strategy, 1-D sums.
  An observer of the releases sees (up to post-processing) Y = C·u + N(0, σ²I) with u the
  removed example's participations (its group uniform, each of its steps with prob. p) under D,
  and N(0, σ²I) under D − {x}. The true δ(ε) of both directions, estimated from 4·10⁵ draws
  of each with the exact likelihood ratio (a mixture over the 8 patterns), stays below the
  accountant's δ at its ε (Monte-Carlo error ~3e-4); the ε of T Poisson steps at b/N, what a
  sampler mistaken for Poisson would report, is broken by the same attack (true δ 0.07 > 0.05)."""
  steps, k, sigma, n, b, delta = 4, 2, 1.0, 100, 25, 0.05
  p = b * k / n
  column = np.zeros(steps)
  column[:2] = strategy.for_run('bandmf', steps, num_bands=2).coefs
  c = linalg.toeplitz(column, np.zeros(steps))
  means, weights = [], []
  for group in range(k):
    mine = range(group, steps, k)
    for bits in itertools.product([0, 1], repeat=len(mine)):
      u = np.zeros(steps)
      u[list(mine)] = bits
      means.append(c @ u)
      weights.append(np.prod([p if bit else 1 - p for bit in bits]) / k)
  means, log_w = np.array(means), np.log(weights)
  rng = np.random.default_rng(0)
  draws = 400_000

  def log_ratio(y):  # log dP/dQ(y), P = D's mixture, Q = N(0, σ²I).
    a = (y @ means.T - 0.5 * np.sum(means**2, 1)) / sigma**2 + log_w
    top = a.max(1)
    return top + np.log(np.exp(a - top[:, None]).sum(1))

  under_q = log_ratio(rng.normal(size=(draws, steps)) * sigma)
  picks = rng.choice(len(weights), size=draws, p=np.exp(log_w))
  under_p = log_ratio(means[picks] + rng.normal(size=(draws, steps)) * sigma)

  def true_delta(eps):  # max of remove (P vs Q) and add (Q vs P).
    return max(
      np.mean(np.maximum(0, 1 - np.exp(eps - under_p))),
      np.mean(np.maximum(0, 1 - np.exp(eps + under_q))),
    )

  sampler = samplers.make('cyclic_poisson', n, b, num_groups=k)
  ours = accountant_lib.Accountant(
    sampler, sigma, delta, max_batch_size=None, noise='bandmf', num_bands=2, allow_large_delta=True
  ).epsilon(steps)
  assert true_delta(ours) <= delta - 0.01
  naive = accountant_lib.Accountant(
    samplers.make('poisson', n, b), sigma, delta, max_batch_size=None, allow_large_delta=True
  ).epsilon(steps)
  assert true_delta(naive) >= delta + 0.01


def test_sigma_calibrated_for_bandmf_meets_the_target_and_is_tight():
  """calibrate_noise_multiplier with noise = 'bandmf': the accountant at the returned σ is within
  the target and at most 1 % under it (the search is of this analysis, not Poisson's: at the
  same target Poisson at b/N needs a σ 30 % smaller)."""
  from dpjax.privacy.accounting import calibration  # pylint: disable=import-outside-toplevel

  sampler = samplers.make('cyclic_poisson', 10_000, 100, num_groups=4)
  options = dict(max_batch_size=None, noise='bandmf', num_bands=4)
  sigma = calibration.calibrate_noise_multiplier(sampler, 2.0, 1e-6, 400, **options)
  eps = accountant_lib.Accountant(sampler, sigma, 1e-6, **options).epsilon(400)
  assert 0.99 * 2.0 <= eps <= 2.0
  poisson = calibration.calibrate_noise_multiplier(
    samplers.make('poisson', 10_000, 100), 2.0, 1e-6, 400, max_batch_size=None
  )
  assert poisson < 0.8 * sigma
