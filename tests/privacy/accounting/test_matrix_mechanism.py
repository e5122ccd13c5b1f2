"""Correlated noise without amplification (docs/accounting.md §9): one Gaussian mechanism of
the strategy's sensitivity over the sampler's participation patterns, against dp_accounting
called directly with Δ from a brute-force enumeration; the refusals; and an observer's attack
on the released noise showing the reported ε holds where DP-SGD's would not."""

import contextlib
import io
import itertools
import json

import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import stats

from dpjax import account
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import calibration
from dpjax.privacy.accounting import matrix_mechanism
from dpjax.privacy.correlated import strategy

N, B, DELTA = 30, 10, 1e-3  # 3 steps per epoch.
BLT = strategy.make('blt', 6, num_buffers=2)
BANDMF = strategy.make('bandmf', 6, num_bands=4)  # 4 bands > 3 steps apart: cross terms.


def _brute_force_sensitivity(c: np.ndarray, patterns) -> float:
  """max over the patterns π and the signs of the 1-D contributions u_t = ±1 of ‖Σ_t C[:, t]u_t‖
  (the maximum over |u_t| <= 1 of a convex function is at the vertices): no Gram matrix, no
  assumption on its signs."""
  best = 0.0
  for pi in patterns:
    for signs in itertools.product((1.0, -1.0), repeat=len(pi)):
      best = max(best, float(np.linalg.norm(c[:, list(pi)] @ np.array(signs))))
  return best


def _deterministic_patterns(sampler, steps):
  """Each example's steps among the first `steps`, read off the sampler's own batches."""
  where = [set() for _ in range(sampler.num_examples)]
  for t in range(steps):
    for i in sampler.indices(t):
      where[i].add(t)
  return {tuple(sorted(p)) for p in where if p}


def _dp_accounting_gaussian(sigma_over_delta, delta):
  acct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
  acct.compose(dp_event.GaussianDpEvent(sigma_over_delta))
  return acct.get_epsilon(delta)


@pytest.mark.parametrize('s', [BLT, BANDMF], ids=['blt', 'bandmf'])
def test_deterministic_order_is_one_gaussian_of_the_enumerated_sensitivity(s):
  """ε after 6 steps (2 epochs) and after 4 (the patterns possible so far, on C's leading
  4 × 4 block): dp_accounting's PLD of GaussianDpEvent(σ/Δ), Δ by brute force over the
  patterns the sampler's batches produce. A Δ of one participation (1), DP-SGD's √2, or C's
  full n columns at step 4 each miss by > 1 %."""
  sampler = samplers.make('deterministic', N, B)
  sigma = 2.0
  acct = accountant_lib.Accountant(sampler, sigma, DELTA, noise=s.kind, strategy=s, num_steps=6)
  for steps in (6, 4):
    c = s.dense()[:steps, :steps]
    delta_t = _brute_force_sensitivity(c, _deterministic_patterns(sampler, steps))
    report = acct.epsilon_at(steps)
    assert report.details['strategy_sensitivity'] == pytest.approx(delta_t, rel=1e-12)
    assert report.details['strategy_sensitivity_exact'] is True
    direct = _dp_accounting_gaussian(sigma / delta_t, DELTA)
    assert report.epsilon == pytest.approx(direct, rel=1e-6)  # Both exact Gaussians.
    assert report.bound == 'upper' and report.steps == steps
  assert acct.epsilon_at(6).details['strategy_sensitivity'] > 2**0.5 * 1.01  # Cross terms.


def test_cyclic_poisson_without_amplification_covers_each_groups_steps():
  """BLT with cyclic Poisson (k = 2 groups): Δ is the brute force over {g, g + 2, g + 4};
  BandMF with bands <= groups stays amplified (the sampler's own analysis)."""
  sampler = samplers.make('cyclic_poisson', 1000, 10, num_groups=2)
  acct = accountant_lib.Accountant(
    sampler, 2.0, 1e-5, noise='blt', strategy=BLT, max_batch_size=None
  )
  assert acct.analysis == matrix_mechanism.NAME
  brute = _brute_force_sensitivity(BLT.dense(), [(0, 2, 4), (1, 3, 5)])
  assert acct.epsilon_at(6).details['strategy_sensitivity'] == pytest.approx(brute, rel=1e-12)
  two = strategy.make('bandmf', 6, num_bands=2)
  amplified = accountant_lib.Accountant(
    sampler, 2.0, 1e-5, noise='bandmf', strategy=two, max_batch_size=None
  )
  assert amplified.analysis == 'cyclic_poisson_subsampling' and amplified.num_bands == 2


def test_a_shuffle_is_never_more_private_than_a_fixed_order():
  """A shuffle's patterns include the fixed order's and adjacent steps (the last of one epoch,
  the first of the next): Δ and ε at least the deterministic ones, strictly for these C."""
  for s in (BLT, BANDMF):
    eps = {
      name: accountant_lib.Accountant(
        samplers.make(name, N, B), 2.0, DELTA, noise=s.kind, strategy=s
      ).epsilon_at(6)
      for name in ('deterministic', 'shuffle')
    }
    assert eps['shuffle'].epsilon > eps['deterministic'].epsilon
    brute = _brute_force_sensitivity(s.dense(), [(a, b) for a in range(3) for b in range(3, 6)])
    assert eps['shuffle'].details['strategy_sensitivity'] == pytest.approx(brute, rel=1e-12)


def test_one_band_is_todays_deterministic_epsilon():
  """C = I: the matrix mechanism's Gaussian of Δ = √E is DP-SGD's deterministic ε (σ/√E);
  a 1-band strategy is routed to the sampler's own analysis, and the two agree."""
  identity = strategy.Strategy('bandmf', 6, coefs=(1.0,))
  acct = accountant_lib.Accountant(
    samplers.make('deterministic', N, B), 1.5, DELTA, noise='bandmf', strategy=identity
  )
  assert acct.analysis == 'gaussian_per_epoch'
  ours = matrix_mechanism.matrix_mechanism(acct, 6, False)
  assert ours.details['strategy_sensitivity'] == pytest.approx(2**0.5, rel=1e-12)
  assert ours.epsilon == pytest.approx(acct.epsilon(6), rel=1e-12)


def test_calibration_passes_the_strategy_through():
  """σ for ε = 2 with BLT in a fixed order: ε(σ) <= 2 within 1 %, and σ/Δ is the σ that
  calibrates one Gaussian of sensitivity 1 (the strategy really entered the search)."""
  sampler = samplers.make('deterministic', N, B)
  sigma = calibration.calibrate_noise_multiplier(sampler, 2.0, DELTA, 6, noise='blt', strategy=BLT)
  acct = accountant_lib.Accountant(sampler, sigma, DELTA, noise='blt', strategy=BLT)
  assert 0.99 * 2.0 <= acct.epsilon(6) <= 2.0
  plain = calibration.calibrate_noise_multiplier(
    samplers.make('deterministic', N, N), 2.0, DELTA, 1
  )
  delta_6 = acct.epsilon_at(6).details['strategy_sensitivity']
  assert sigma / delta_6 == pytest.approx(plain, rel=0.01)


@pytest.mark.parametrize(
  'sampler, options, match',
  [
    ('poisson', {'noise': 'blt', 'strategy': BLT}, 'participation patterns are unbounded'),
    ('balls_and_bins', {'noise': 'bandmf', 'strategy': BANDMF}, 'unbounded or not analysed'),
    ('fixed_size', {'noise': 'blt', 'strategy': BLT}, 'unbounded or not analysed'),
    ('deterministic', {'noise': 'blt'}, "noise = 'blt' needs its strategy"),
    ('deterministic', {'noise': 'bandmf', 'num_bands': 4}, 'accounted by the sensitivity'),
    ('deterministic', {'noise': 'bandmf', 'strategy': BLT}, "strategy.kind = 'blt' must be"),
    ('deterministic', {'noise': 'bandmf', 'strategy': BANDMF, 'num_bands': 3}, 'bands = 4'),
    ('deterministic', {'noise': 'blt', 'strategy': BLT, 'num_bands': 2}, 'needs noise'),
    ('deterministic', {'noise': 'blt', 'strategy': BLT, 'group_size': 2}, 'group_size = 2'),
    ('deterministic', {'noise': 'blt', 'strategy': BLT, 'num_steps': 7}, 'num_steps = 6'),
    ('deterministic', {'noise': 'gaussian', 'strategy': BLT}, 'must be noise'),
  ],
)
def test_combinations_without_an_analysis_are_refused_with_one_line(sampler, options, match):
  """Refused when the accountant is made (before any computation), never accounted as DP-SGD."""
  s = samplers.make(sampler, N, B)
  with pytest.raises(ValueError, match=match) as info:
    accountant_lib.Accountant(s, 1.0, DELTA, max_batch_size=None, **options)
  assert '\n' not in str(info.value)


def test_a_step_past_the_strategy_is_refused():
  acct = accountant_lib.Accountant(
    samplers.make('deterministic', N, B), 1.0, DELTA, noise='blt', strategy=BLT
  )
  with pytest.raises(ValueError, match="past the strategy's num_steps = 6"):
    acct.epsilon(7)


def test_an_observer_of_the_release_sees_no_more_than_the_reported_epsilon():
  """House rule 2, the attack. T = 6 steps of 1-D sums, a fixed order of 2 epochs of 3 steps,
  the BLT strategy; D holds x (its clipped contribution +1 at its two steps), D − {x} not.
  200,000 independent coordinates of the real BLT privatizer (zero sums but x's) are 200,000
  runs of the mechanism; the observer computes the exact log-likelihood ratio L of the release
  (Gaussian, covariance σ²C⁻¹C⁻ᵀ, means 1_π vs 0) and δ(ε) = E_D[(1 − e^(ε − L))₊] (the
  Gaussian shift is symmetric: the other direction is the same).
  - The simulation agrees with the closed form of a Gaussian of shift ‖C·1_π‖/σ (5 s.e.).
  - At the reported ε, δ <= the δ asked (+4 s.e.), for every position of x.
  - DP-SGD's deterministic ε (σ/√2: what a naive accountant reports) lets the observer reach
    δ > 2× the δ asked, by > 10 s.e.: accounting correlated noise as DP-SGD fails here."""
  sampler, sigma, coords = samplers.make('deterministic', N, B), 2.0, 200_000
  reported = accountant_lib.Accountant(sampler, sigma, DELTA, noise='blt', strategy=BLT).epsilon(6)
  naive = accountant_lib.Accountant(sampler, sigma, DELTA).epsilon(6)
  privatizer = BLT.privatizer(sigma, 1.0, 1.0, seed=99)
  c = BLT.dense()
  precision = c.T @ c / sigma**2  # (σ²C⁻¹C⁻ᵀ)⁻¹: the release's inverse covariance.
  worst = {'reported': 0.0, 'naive': 0.0}
  for x in (0, 10, 20):  # One example per batch position.
    pi = [t for t in range(6) if x in sampler.indices(t)]
    shift = np.zeros(6)
    shift[pi] = 1.0
    state = privatizer.init(jnp.zeros(coords))
    released = []
    for t in range(6):
      g, state = privatizer.release(
        jnp.full(coords, shift[t], jnp.float32), state, np.uint32(t), privatizer.key_data()
      )
      released.append(np.asarray(g, np.float64))
    y = np.stack(released)  # [6, coords]: what the observer sees under D.
    loss = shift @ precision @ y - 0.5 * shift @ precision @ shift
    mu = np.linalg.norm(c @ shift) / sigma
    for name, eps in (('reported', reported), ('naive', naive)):
      samples = np.maximum(0.0, 1.0 - np.exp(eps - loss))
      estimate, se = samples.mean(), samples.std() / np.sqrt(coords)
      exact = stats.norm.cdf(-eps / mu + mu / 2) - np.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
      assert abs(estimate - exact) <= 5 * se, (name, x, estimate, exact, se)
      if name == 'reported':
        assert estimate <= DELTA + 4 * se, (x, estimate, se)
      worst[name] = max(worst[name], estimate)
      worst[name + '_se'] = se
  assert worst['naive'] > 2 * DELTA and worst['naive'] - DELTA > 10 * worst['naive_se'], worst


def test_the_command_builds_the_strategy_for_its_steps_and_accounts_it():
  """`python -m dpjax.account --noise blt --num-buffers 2` (and bandmf, 4 bands) with a fixed
  order: the ε, sensitivity and expected error of `strategy.make(kind, --steps)` accounted
  directly; --noise blt without --num-buffers and with Poisson are one line (exit 2)."""
  flags = ['--sampler=deterministic', f'--num-examples={N}', f'--batch-size={B}', '--steps=6']
  flags += ['--noise-multiplier=2', f'--delta={DELTA}', '--json']
  for s, extra in (
    (BLT, ['--noise=blt', '--num-buffers=2']),
    (BANDMF, ['--noise=bandmf', '--num-bands=4']),
  ):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
      assert account.main([*flags, *extra]) == 0
    report = json.loads(stdout.getvalue())
    direct = accountant_lib.Accountant(
      samplers.make('deterministic', N, B), 2.0, DELTA, noise=s.kind, strategy=s
    ).epsilon_at(6)
    assert report['epsilon'] == pytest.approx(direct.epsilon, rel=1e-9)
    for key in ('strategy_sensitivity', 'expected_error_vs_dp_sgd'):
      assert report['details'][key] == pytest.approx(direct.details[key], rel=1e-9)
    assert report['details']['expected_error_vs_dp_sgd'] < 1
  for bad, match in (
    (['--noise=blt'], 'needs num_buffers'),
    (['--noise=blt', '--num-buffers=2', '--sampler=poisson'], 'unbounded or not analysed'),
  ):
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as info, contextlib.redirect_stderr(stderr):
      account.main([*flags, *bad])
    assert info.value.code == 2 and match in stderr.getvalue()


def test_rdp_is_dp_accountings_rdp_of_the_same_gaussian():
  """accountant='rdp': dp_accounting's RdpAccountant on GaussianDpEvent(σ/Δ), above the exact
  ε (RDP's conversion is looser)."""
  sampler = samplers.make('deterministic', N, B)
  acct = accountant_lib.Accountant(sampler, 2.0, DELTA, noise='blt', strategy=BLT, accountant='rdp')
  report = acct.epsilon_at(6)
  direct = rdp_privacy_accountant.RdpAccountant()
  direct.compose(dp_event.GaussianDpEvent(2.0 / report.details['strategy_sensitivity']))
  assert report.epsilon == pytest.approx(direct.get_epsilon(DELTA), rel=1e-9)
  exact = accountant_lib.Accountant(sampler, 2.0, DELTA, noise='blt', strategy=BLT).epsilon(6)
  assert report.epsilon > exact
