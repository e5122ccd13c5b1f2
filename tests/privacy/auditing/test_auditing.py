"""Empirical auditing: the one-run bound against direct binomial sums, its validity on a
Gaussian mechanism of known ε, planted bugs flagged, the CLI on a saved run."""

import json
import math
import pathlib

import dp_accounting
import jax
import jax.flatten_util
import numpy as np
import pytest

from dpjax.trainer.commands import cli
from dpjax.trainer.planning import plan as plan_lib
from dpjax.privacy import accounting
from dpjax.privacy import clipping
from dpjax.data import sources as data
from dpjax.privacy import dp_step
from dpjax.models import factory as models
from dpjax import audit as audit_cli
from dpjax.privacy.auditing import audited_sgd
from dpjax.privacy.auditing import canaries as canaries_lib
from dpjax.privacy.auditing import gradient_canary
from dpjax.privacy.auditing import one_run
from dpjax.trainer.workdir import audit_record as record
from dpjax.privacy.auditing import white_box
from dpjax.privacy import losses
from dpjax.privacy import prng

ROOT = pathlib.Path(__file__).resolve().parents[3]
DELTA = 1e-5
CONFIDENCE = 0.95


def _direct_p_value(m, r, v, eps, delta):
  """Theorem 3.1 of Steinke et al. 2023 with exact binomial sums (math.comb, floats)."""
  p = math.exp(eps) / (1 + math.exp(eps))
  pmf = [math.comb(r, w) * p**w * (1 - p) ** (r - w) for w in range(r + 1)]
  f = lambda u: sum(pmf[max(u, 0) :])
  slack = max(((f(v - i) - f(v)) / i for i in range(1, v + 1)), default=0.0)
  return min(1.0, f(v) + 2 * m * delta * slack)


@pytest.mark.parametrize(
  'm,r,v,eps,delta',
  [
    (100, 20, 18, 1.0, 1e-5),
    (1000, 100, 80, 0.5, 1e-5),
    (1000, 100, 80, 2.0, 1e-3),
    (500, 400, 300, 0.3, 1e-4),
    (50, 10, 10, 3.0, 0.0),
  ],
)
def test_p_value_matches_direct_binomial_sums(m, r, v, eps, delta):
  assert one_run.p_value(m, r, v, eps, delta) == pytest.approx(
    _direct_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15
  )


@pytest.mark.parametrize('m,r,v', [(100, 20, 18), (1000, 100, 80), (1000, 800, 700)])
def test_lower_bound_is_the_largest_rejected_epsilon(m, r, v):
  eps = one_run.epsilon_lower_bound(m, r, v, DELTA, CONFIDENCE)
  assert eps > 0
  # Rejected (p ≤ β) just below, not rejected just above, by the direct computation.
  assert _direct_p_value(m, r, v, eps - 1e-3, DELTA) <= 1 - CONFIDENCE
  assert _direct_p_value(m, r, v, eps + 1e-3, DELTA) > 1 - CONFIDENCE


def test_max_bound_closed_form_without_delta():
  # All r = 2k guesses right, δ = 0: p^r = β/L, ε = log(p / (1 - p)); best at the largest k.
  m, fractions = 1000, (0.1, 0.8)
  p = (0.05 / 2) ** (1 / 800)
  assert one_run.max_epsilon_lower(m, delta=0.0, confidence=0.95, fractions=fractions) == (
    pytest.approx(math.log(p / (1 - p)), rel=1e-5)
  )


@pytest.mark.slow
def test_gaussian_mechanism_bound_is_valid_and_informative():
  """Scores S_j·μ + N(0, 1): each canary sees a Gaussian mechanism of sensitivity μ."""
  mu, m, trials = 1.0, 1000, 100
  epsilon = (
    dp_accounting.pld.PLDAccountant()
    .compose(dp_accounting.GaussianDpEvent(1 / mu))
    .get_epsilon(DELTA)
  )
  # ε ≈ 4.38 is below the largest bound m = 1000 canaries allow (5.09): the check can fail.
  assert epsilon < one_run.max_epsilon_lower(m, delta=DELTA, confidence=CONFIDENCE)
  bounds = []
  for seed in range(trials):
    rng = np.random.default_rng(seed)
    member = rng.random(m) < 0.5
    scores = mu * member + rng.standard_normal(m)
    bounds.append(one_run.audit(scores, member, delta=DELTA, confidence=CONFIDENCE).epsilon_lower)
  bounds = np.array(bounds)
  assert np.mean(bounds <= epsilon) >= 0.95, (epsilon, np.sort(bounds)[-10:])
  # Informative: a clearly positive ε (median 1.62 with these seeds), not a trivial 0.
  assert np.median(bounds) > 1.0, np.median(bounds)


@pytest.mark.parametrize('confidence,low,high', [(0.95, 0.93, 0.97), (0.5, 0.45, 0.58)])
def test_bound_is_calibrated_on_randomized_response(confidence, low, high):
  """ε-DP randomized response is the theorem's extreme case: W ~ Binomial(r, e^ε/(1+e^ε))
  exactly, so with one guess count the bound exceeds ε in a fraction ≈ β of the trials."""
  eps, m, trials = 2.0, 1000, 400
  p = math.exp(eps) / (1 + math.exp(eps))
  below = []
  for seed in range(trials):
    rng = np.random.default_rng(seed)
    member = rng.random(m) < 0.5
    released = member ^ (rng.random(m) > p)
    scores = released + 1e-6 * rng.standard_normal(m)  # ties broken at random
    bound = one_run.audit(scores, member, delta=0.0, confidence=confidence, fractions=(0.8,))
    below.append(bound.epsilon_lower <= eps)
  assert low <= np.mean(below) <= high, np.mean(below)


def test_count_correct_and_guess_counts():
  scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
  member = np.array([True, True, False, True, False, False])
  assert one_run.count_correct(scores, member, 2) == 4
  assert one_run.count_correct(scores, member, 3) == 4  # top 3: 2 right; bottom 3: 2 right
  assert one_run.guess_counts(1000) == [10, 25, 50, 150, 400]


def test_bad_input_names_the_field():
  with pytest.raises(ValueError, match='audit.confidence'):
    one_run.epsilon_lower_bound(10, 4, 4, 0.0, 1.5)
  with pytest.raises(ValueError, match='audit.num_canaries'):
    canaries_lib.make_canaries(0, 11, 10)


def test_canaries_are_seeded_and_orthonormal_and_recorded():
  a = canaries_lib.make_canaries(3, 200, 1000)
  b = canaries_lib.CanarySet.from_dict(json.loads(json.dumps(a.to_dict())))
  np.testing.assert_array_equal(a.membership, b.membership)
  np.testing.assert_array_equal(a.coordinates, b.coordinates)
  assert len(set(a.coordinates.tolist())) == 200  # distinct: orthonormal directions
  assert 70 < a.membership.sum() < 130
  damaged = a.to_dict()
  damaged['membership'][0] ^= 1
  with pytest.raises(ValueError, match='membership'):
    canaries_lib.CanarySet.from_dict(damaged)


@pytest.fixture(scope='module')
def digits():
  config = cli.load_config_file(str(ROOT / 'configs' / 'digits_mlp.py'))
  config.seed = 0  # Reproducible audits (a real run draws a secret seed).
  config.model.hidden_sizes = (32,)
  config.num_epochs, config.num_steps = 0, 30
  config.privacy.noise_multiplier, config.privacy.target_epsilon = 1.0, 0.0
  train, _ = data.make_sources(config.data)
  model = models.make_model(config.model, train.num_classes, train.input_shape)
  return config, model, train


@pytest.mark.slow
def test_injected_canary_gradient_is_its_clipped_direction_times_its_coin(digits):
  config, model, train = digits
  params = prng.init_params(model, 0, train.input_shape)
  d = jax.flatten_util.ravel_pytree(params)[0].size
  canaries = canaries_lib.make_canaries(1, 8, d)
  source = canaries_lib.CanarySource(train, 8)
  indices = np.array([0, 5, len(train) + 0, len(train) + 3, len(train) + 7, 9, 0, 0])
  batch = source.gather(indices)
  batch['weight'] = np.array([1, 1, 1, 1, 1, 1, 0, 0], np.float32)
  loss_fn = losses.make_loss_fn(model)
  base = clipping.make_clipped_sum_fn('vmap', loss_fn, 1.0)
  fn = gradient_canary.with_gradient_canaries(base, canaries, canary_norm=10.0, clip_norm=1.0)
  # Jitted, each a program (eager, each of their ops was compiled alone: 5 s of CPU).
  with jax.default_matmul_precision('highest'):
    got = jax.flatten_util.ravel_pytree(jax.jit(fn)(params, batch)[0])[0]
  ordinary = dict(batch, weight=np.array([1, 1, 0, 0, 0, 1, 0, 0], np.float32))
  del ordinary['canary_id']
  with jax.default_matmul_precision('highest'):
    want = np.array(
      jax.flatten_util.ravel_pytree(jax.jit(base)(params, ordinary)[0])[0], np.float64
    )
  for j in (0, 3, 7):
    want[canaries.coordinates[j]] += canaries.membership[j] * canaries.signs[j] * 1.0
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-6)
  assert canaries.membership[[0, 3, 7]].any() and not canaries.membership[[0, 3, 7]].all()


_CLAIMS = {}


def _claim(config, run):
  """The ε the plan claims for `run`, composed once per (config, N): the planted-bug runs all
  share it (each recomposed the same 30-step PLD, ~1 s of CPU)."""
  key = (config.to_json(), run.num_examples)
  if key not in _CLAIMS:
    accountant = plan_lib.make_accountant(config, run.num_examples)
    _CLAIMS[key] = accountant.epsilon_at(config.num_steps).epsilon
  return _CLAIMS[key]


def _audit(config, run):
  audit = one_run.audit(run.scores(), run.canaries.membership, delta=DELTA, confidence=CONFIDENCE)
  test = white_box.effective_sigma(
    run.released,
    run.ordinary,
    run.counts,
    run.canaries.membership,
    clip_norm=run.clip_norm,
    noise_multiplier=config.privacy.noise_multiplier,
  )
  return audit, test


M = 200  # canaries in the training tests


@pytest.fixture(scope='module')
def audited_runs(digits):
  """`runs(bug)`: the audited training of `digits` with M canaries and the planted bug (None:
  the correct code), trained once per module (the CLI test reads the 'noise_tenth' run too)."""
  config, model, train = digits
  done = {}

  def runs(bug):
    if bug not in done:
      settings = plan_lib.audit_settings(config)
      done[bug] = audited_sgd.train(settings, model, train, num_canaries=M, _bug=bug)
    return done[bug]

  return runs


@pytest.mark.slow
@pytest.mark.parametrize('bug', [None, *audited_sgd.PLANTED_BUGS])
def test_planted_bugs_are_flagged_and_correct_code_is_not(digits, audited_runs, bug):
  config = digits[0]
  run = audited_runs(bug)
  claim = _claim(config, run)
  audit, test = _audit(config, run)
  flagged = audit.epsilon_lower > claim or test.flagged
  assert flagged == (bug is not None), (bug, claim, audit, test)
  if bug is None:
    assert test.interval[0] <= 1.0 <= test.interval[1]
    assert test.signal == pytest.approx(1.0, abs=0.1)
  if bug == 'noise_tenth':
    assert test.effective == pytest.approx(0.1, rel=0.1)
  if bug == 'skip_clipping':  # the canary's raw gradient 10·C is released unclipped
    assert test.signal == pytest.approx(10.0, rel=0.05)
  if bug == 'count_twice':
    assert test.signal == pytest.approx(2.0, rel=0.1)
  if bug == 'skip_noise_every_4th':
    assert set(test.flagged_steps) == {t for t in range(config.num_steps) if t % 4 == 3}


def test_non_private_run_reaches_half_the_largest_bound(digits):
  config, model, train = digits
  run = audited_sgd.train(
    plan_lib.audit_settings(config), model, train, num_canaries=M, private=False
  )
  audit = one_run.audit(run.scores(), run.canaries.membership, delta=DELTA, confidence=CONFIDENCE)
  largest = one_run.max_epsilon_lower(M, delta=DELTA, confidence=CONFIDENCE)
  assert largest == pytest.approx(3.52, abs=0.01)  # m = 200, β = 0.05, δ = 1e-5
  assert audit.epsilon_lower >= largest / 2, (audit, largest)


@pytest.mark.slow
def test_cli_recomputes_the_audit_of_a_saved_run(digits, audited_runs, tmp_path, capsys):
  config, model, train = digits
  run = audited_runs('noise_tenth')
  report = plan_lib.make_accountant(config, run.num_examples).epsilon_at(config.num_steps)
  record.save_run(str(tmp_path), run, report.to_dict(), config.num_steps, confidence=CONFIDENCE)
  assert audit_cli.main(['--workdir', str(tmp_path), '--json']) == 0
  out = json.loads(capsys.readouterr().out)
  audit, test = _audit(config, run)
  assert out['epsilon'] == pytest.approx(report.epsilon)
  assert out['audit_epsilon_lower'] == pytest.approx(audit.epsilon_lower)
  assert out['confidence'] == CONFIDENCE and out['num_canaries'] == M
  assert out['white_box']['flagged'] and out['white_box']['effective'] == pytest.approx(
    test.effective
  )
  assert audit_cli.main(['--workdir', str(tmp_path)]) == 0
  assert 'FLAGS' in capsys.readouterr().out
  # Scores from the final parameters only (what a trainer without per-step records saves).
  params0 = prng.init_params(model, config.seed, train.input_shape)
  record.write_record(str(tmp_path), run.canaries, confidence=CONFIDENCE, initial_params=params0)
  assert audit_cli.main(['--workdir', str(tmp_path), '--json']) == 0
  out = json.loads(capsys.readouterr().out)
  # SGD: θ_T − θ_0 = −η/b Σ_t s_t, so the final-model score is η/b times the summed releases.
  scale = config.optimizer.learning_rate / (config.sampler.batch_size)
  direct = one_run.audit(
    scale * run.released.sum(0), run.canaries.membership, delta=DELTA, confidence=CONFIDENCE
  )
  assert out['score'] == 'final_params' and 'white_box' not in out
  assert out['audit_epsilon_lower'] == pytest.approx(direct.epsilon_lower, abs=1e-3)
  fields = record.audit_params(
    run.canaries,
    gradient_canary.project(params0, run.canaries),
    run.params,
    delta=DELTA,
    confidence=CONFIDENCE,
  )
  assert fields['audit_epsilon_lower'] == pytest.approx(out['audit_epsilon_lower'])
  assert fields['audit_num_canaries'] == M and fields['audit_confidence'] == CONFIDENCE


def test_cli_bad_workdir_is_one_line_exit_2(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    audit_cli.main(['--workdir', str(tmp_path)])
  assert e.value.code == 2
  assert 'audit.json' in capsys.readouterr().err.strip().splitlines()[-1]


def test_audit_config_block_is_off_by_default_and_validated():
  config = cli.load_config_file(str(ROOT / 'configs' / 'digits_mlp.py'))
  config.seed = 0  # Reproducible audits (a real run draws a secret seed).
  check = lambda a: canaries_lib.check_audit(
    a.num_canaries, a.kind, a.confidence, a.every_checkpoint, prefix='audit.'
  )
  assert check(config.audit) == 0
  for field, value in (
    ('num_canaries', -1),
    ('kind', 'input'),
    ('confidence', 1.0),
    ('every_checkpoint', 'yes'),
  ):
    bad = config.audit.copy_and_resolve_references()
    with bad.ignore_type():
      bad[field] = value
    with pytest.raises(ValueError, match=f'audit.{field}'):
      check(bad)
