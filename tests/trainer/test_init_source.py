"""init_from a dpjax run or export composes its privacy loss with the new run's (issue 34 item 2).

Run A is the fingerprint tests' finished 6-step run on digits D (σ = 1, b = 128, N = 1437),
trained once per session. B starts from it; what B may claim is checked against
dp_accounting's PLD accountant called here on the Poisson events of every run in the chain.
"""

import functools
import json
import os
import re
import shutil

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution

from dpjax import export
from dpjax import train
from dpjax.data import digits
from dpjax.trainer.workdir import checkpoints
from dpjax.privacy import lora
from dpjax.trainer.planning import finetune
from dpjax.trainer.planning import init_source
from dpjax.trainer.planning import plan as plan_lib
from tests.run_configs import small_config
from tests.run_configs import tree_digest
from tests.trainer import test_fingerprint

DELTA, N, B, STEPS = 1e-5, 1437, 128, 6  # Run A: N, b and steps (σ = 1).
COARSE = {'value_discretization_interval': 1e-3}  # Cheaper PLDs; the same on both sides.


@pytest.fixture(scope='module')
def runs(shared_setup, reference_run):
  """The fingerprint tests' finished runs: 'given' is A; 'non_private' trained without noise."""
  return test_fingerprint.built_runs(shared_setup, reference_run)


@functools.lru_cache(maxsize=16)
def _step(n, sigma, interval):
  """dp_accounting's PLD of one Poisson step (rate b/N, σ), built once per test session."""
  return privacy_loss_distribution.from_gaussian_mechanism(
    sigma, sampling_prob=B / n, value_discretization_interval=interval
  )


def _independent(*runs, interval=1e-4):
  """ε at δ of Poisson runs (N, σ, steps), b = 128, in sequence: dp_accounting's PLDs."""
  pld = None
  for n, sigma, steps in runs:
    run = _step(n, sigma, interval).self_compose(steps)
    pld = run if pld is None else pld.compose(run)
  return pld.get_epsilon_for_delta(DELTA)


def _sigma(sigma, fingerprint):
  """σ/(1 + η): the noise multiplier a run's ε is of (η, the float rounding it paid for)."""
  return sigma / (1 + fingerprint['privacy.rounding_eta'])


def _a_sigma(runs):
  """Run A's σ = 1 as accounted."""
  return _sigma(1.0, checkpoints.read_metadata(str(runs / 'given'))[-1]['fingerprint'])


def _plan(init_from, data=None, previous=None, options=None, **overrides):
  """B's plan: from `init_from`, on digits or on `data` (an .npz path), 6 steps, σ = 1."""
  if data is not None:
    overrides.update({'data.source': 'npz', 'data.path': str(data), 'data.num_classes': 10})
  config = small_config(**{'init_from': str(init_from), **overrides})
  source, _ = plan_lib.make_training_sources(config)
  return plan_lib.make_plan(config, source, previous, seed=0, accountant_options=options)


def _digits_npz(path, rows):
  x, y, x_test, y_test = digits.load_digits_arrays()
  np.savez(path, x_train=x[rows], y_train=y[rows], x_test=x_test, y_test=y_test)
  return path


@pytest.mark.slow
def test_b_from_a_on_d_permuted_or_d_minus_one_reports_the_composition(runs, tmp_path):
  """The attack: B starts from A's workdir on D with its rows permuted, or on D minus one row,
  so B's release depends on every record of D through both runs. B's ε must be that of A's 6
  steps then B's 6 (dp_accounting: 2.75 for both), not B's own (2.27, A's too). On da06065 both
  were accepted (their content digests differ from A's) and reported B's own ε, 2.27: this
  test failed there (checked)."""
  order = np.random.default_rng(0).permutation(N)
  for name, rows in (('permuted', order), ('minus_one', np.arange(1, N))):
    plan = _plan(runs / 'given', _digits_npz(tmp_path / f'{name}.npz', rows), options=COARSE)
    n, a, b = len(rows), _a_sigma(runs), _sigma(1.0, plan.fingerprint)
    composed = _independent((N, a, STEPS), (n, b, STEPS), interval=1e-3)
    alone = _independent((n, b, STEPS), interval=1e-3)
    report = plan.privacy.accountant.epsilon_at(STEPS, estimates=False)
    assert composed <= report.epsilon <= composed + 1e-6, name
    assert report.epsilon > alone + 0.4
    assert report.details['composed_with'] == [str(runs / 'given')]


@pytest.mark.slow
def test_a_run_from_an_export_reports_the_composition_everywhere_and_a_chain_composes_all(
  runs, tmp_path, capsys
):
  """An export's params.npz (its card beside it) was taken as public on da06065: B reported its
  own ε (1.78 after 2 steps, where A ∘ B is 2.45). Now B (2 steps from A's export) reports
  A ∘ B on its start and Final lines ("composed with" the source), in metrics.jsonl, in every
  checkpoint and in its own export's card, which records A; C from B's export composes
  A ∘ B ∘ C. Failed on da06065 (checked)."""
  a_export = tmp_path / 'a_export'
  export.export(str(runs / 'given'), str(a_export))
  source = str(a_export / 'params.npz')
  config = small_config(
    **{
      'init_from': source,
      'num_steps': 2,
      'seed': 1,
      'log_every_steps': 1,
      'checkpoint_every_steps': 1,
      'eval_every_steps': 2,
    }
  )
  train.train_and_evaluate(config, str(tmp_path / 'b'))
  out = capsys.readouterr().out
  metas = checkpoints.read_metadata(str(tmp_path / 'b'))
  a, b = _a_sigma(runs), _sigma(1.0, metas[-1]['fingerprint'])
  grids = {m['step']: m['privacy']['details']['pld_grid'] for m in metas}  # Common grids.
  expected = {t: _independent((N, a, STEPS), (N, b, t), interval=grids[t]) for t in (1, 2)}
  assert f'final ε = {expected[2]:.4f}, composed with {source}.' in out
  assert f'ε = {expected[2]:.4f} (upper bound, pld, composed with {source})' in out
  assert f'Init: {source}: a dpjax export (6 steps, ε = ' in out
  logged = [json.loads(line) for line in open(tmp_path / 'b' / 'metrics.jsonl')]
  assert {r['step']: r['epsilon'] for r in logged if 'epsilon' in r} == pytest.approx(
    expected, abs=1e-6
  )
  assert {m['step']: m['privacy']['epsilon'] for m in metas} == pytest.approx(expected, abs=1e-6)
  card = export.export(str(tmp_path / 'b'), str(tmp_path / 'b_export'))
  assert card['epsilon'] == pytest.approx(expected[2], abs=1e-6)
  assert 'the 1 run(s) it started from' in card['guarantee']
  (a_record,) = card['init_from']['chain']
  assert a_record['steps'] == STEPS and a_record['accounting']['privacy.noise_multiplier'] == 1.0
  plan = _plan(tmp_path / 'b_export', num_steps=2, options=COARSE)
  c = _sigma(1.0, plan.fingerprint)
  assert plan.privacy.accountant.epsilon(2) == pytest.approx(
    _independent((N, a, STEPS), (N, b, 2), (N, c, 2), interval=1e-3), abs=1e-6
  )


@pytest.mark.slow
def test_declared_disjoint_data_is_this_run_alone_and_a_resume_cannot_change_the_sources(
  runs, tmp_path
):
  """init_from_disjoint_data = True (recorded in the fingerprint): ε is B's alone; a resume
  that drops the declaration or starts from other weights is refused; the declaration is
  refused when the source trained on content identical to B's. Fails on da06065 (the field did
  not exist; checked)."""
  minus_one = _digits_npz(tmp_path / 'minus_one.npz', np.arange(1, N))
  plan = _plan(runs / 'given', minus_one, options=COARSE, init_from_disjoint_data=True)
  assert plan.privacy.accountant.prior_runs == ()
  assert plan.privacy.accountant.epsilon(STEPS) == pytest.approx(
    _independent((N - 1, _sigma(1.0, plan.fingerprint), STEPS), interval=1e-3), abs=1e-6
  )
  assert plan.fingerprint['init_from_disjoint_data'] is True
  with pytest.raises(plan_lib.PlanError, match='init_from_disjoint_data: True → False'):
    _plan(runs / 'given', minus_one, previous=plan.fingerprint)
  public = tmp_path / 'public.npz'
  finetune.save_npz(str(public), checkpoints.read_state(str(runs / 'given'), STEPS)['params'])
  composed = _plan(runs / 'given', minus_one, options=COARSE).fingerprint
  with pytest.raises(plan_lib.PlanError, match='privacy.prior_runs'):
    _plan(public, minus_one, previous=composed)
  with pytest.raises(ValueError, match='trained on content identical to this run'):
    _plan(runs / 'given', init_from_disjoint_data=True)


@pytest.mark.slow
def test_calibration_meets_the_composed_target_or_refuses_a_spent_budget(runs, tmp_path):
  """σ of B (on D permuted) calibrated for a target ε = 3 after A is the smallest whose
  composition with A meets it (dp_accounting at 1e-3, the discretisation asked for: ≤ 3 at σ,
  > 3 at 0.99σ); on da06065 it was calibrated for B alone (σ = 0.878), and A ∘ B reached 3.29
  (checked). A target that A alone already spends is refused in one line."""
  permuted = _digits_npz(tmp_path / 'permuted.npz', np.random.default_rng(0).permutation(N))
  plan = _plan(
    runs / 'given',
    permuted,
    options=COARSE,
    **{'privacy.noise_multiplier': None, 'privacy.target_epsilon': 3.0},
  )
  a, sigma = _a_sigma(runs), _sigma(plan.privacy.noise_multiplier, plan.fingerprint)
  assert _independent((N, a, STEPS), (N, sigma, STEPS), interval=1e-3) <= 3.0
  assert _independent((N, a, STEPS), (N, 0.99 * sigma, STEPS), interval=1e-3) > 3.0
  a_alone = plan.privacy.accountant.prior_runs[0].accountant.epsilon_at(STEPS, estimates=False)
  spent = (
    f'already reach ε = '
    f'{_independent((N, a, STEPS), interval=a_alone.details["pld_grid"]):.4g} at δ = 1e-05'
  )
  with pytest.raises(plan_lib.PlanError, match=spent):
    _plan(
      runs / 'given',
      permuted,
      options=COARSE,
      **{'privacy.noise_multiplier': None, 'privacy.target_epsilon': 1.5},
    )


@pytest.mark.slow
def test_weights_without_a_card_are_public_and_runs_that_cannot_be_composed_are_refused(
  runs, tmp_path
):
  """An .npz with no card and no dpjax workdir is assumed public, and said so; a non-private
  source, or a checkpoint without accounting inputs (an older dpjax), or one recording an input
  this dpjax cannot rebuild, is refused in one line. Fails on da06065 (no InitSource; checked)."""
  public = tmp_path / 'public.npz'
  finetune.save_npz(str(public), checkpoints.read_state(str(runs / 'given'), STEPS)['params'])
  plan = _plan(public, options=COARSE)
  assert plan.init_source.kind == 'public' and plan.privacy.accountant.prior_runs == ()
  assert 'assumed public' in plan.init_source.describe()
  with pytest.raises(ValueError, match='a non-private run .* trained it') as e:
    _plan(runs / 'non_private')
  assert '\n' not in str(e.value)
  source = init_source.read_source(str(runs / 'given'))
  record = source.chain[0]
  for accounting, match in (
    (None, 'records no accounting inputs'),
    (
      {**record['accounting'], 'privacy.new_input': 1.0},
      r"cannot rebuild \(\['privacy.new_input'\]\)",
    ),
  ):
    changed = init_source.InitSource(source.path, 'run', ({**record, 'accounting': accounting},))
    with pytest.raises(ValueError, match=match):
      changed.prior_runs(1)
  assert os.path.isfile(source.weights + '/metadata/metadata')  # The step that was accounted.


def test_a_group_privacy_run_composes_a_source_accounted_with_rdp_through_its_pld():
  """A run of group size k = 2 from a source whose own ε was RDP's: composition needs only the
  source's PLD, but after the merges the rebuilt source accountant kept 'rdp' and was refused
  ("accountant rdp supports group_size = 1 only. Use accountant pld."), a fix naming this run's
  privacy.accountant for what was the source's. It is rebuilt with the PLD."""
  inputs = {
    'privacy.enabled': True,
    'sampler.name': 'poisson',
    'sampler.num_examples': 1000,
    'sampler.batch_size': 100,
    'sampler.max_batch_size': 200,
    'privacy.group_size': 1,
    'privacy.noise_multiplier': 2.0,
    'privacy.clip_norm': 1.0,
    'privacy.delta': 1e-5,
    'privacy.accountant': 'rdp',
    'privacy.matmul_format': 'float32',
    'privacy.rounding_eta': 1e-4,
  }
  source = init_source.InitSource(
    '/w/a', 'run', ({'name': '/w/a', 'steps': 10, 'accounting': inputs},)
  )
  (one,) = source.prior_runs(1)
  (two,) = source.prior_runs(2)
  assert (one.accountant.accountant, two.accountant.accountant) == ('rdp', 'pld')
  assert two.accountant.group_size == 2 and two.accountant.sensitivity == 1 + 1e-4


def _export_a(runs, out):
  """A's export (params.npz, privacy_card.json) at `out`; its card."""
  return export.export(str(runs / 'given'), str(out))


@pytest.mark.slow
def test_a_link_or_a_copy_of_an_exports_weights_composes_as_the_export_does(runs, tmp_path):
  """The attack on provenance: B's init_from is a symlink to A's exported params.npz placed in
  another directory, or a plain copy of the file there. B's release depends on A's training
  set through the weights either way, so B's ε must be A ∘ B (dp_accounting, 2 steps of B),
  exactly as from A's export directory. On the branch's start commit both were "assumed
  public" (the card was looked up beside the link, and a copy carries none) and B claimed its
  own ε; this test failed there (checked)."""
  a_export = tmp_path / 'a_export'
  _export_a(runs, a_export)
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  (elsewhere / 'pretrained.npz').symlink_to(a_export / 'params.npz')
  shutil.copyfile(a_export / 'params.npz', elsewhere / 'copy.npz')
  epsilons = {}
  for name in ('a_export', 'elsewhere/pretrained.npz', 'elsewhere/copy.npz'):
    plan = _plan(tmp_path / name, num_steps=2, options=COARSE)
    assert plan.init_source.kind == 'export', name
    epsilons[name] = plan.privacy.accountant.epsilon(2)
  b = _sigma(1.0, plan.fingerprint)
  composed = _independent((N, _a_sigma(runs), STEPS), (N, b, 2), interval=1e-3)
  assert epsilons == pytest.approx(dict.fromkeys(epsilons, composed), abs=1e-6)
  assert composed > _independent((N, b, 2), interval=1e-3) + 0.5  # B alone claims much less.


@pytest.mark.slow
def test_the_card_inside_the_weights_changes_no_parameter_and_only_its_removal_makes_them_public(
  runs, tmp_path
):
  """A's export carries its card inside params.npz (the reserved entry), equal to the
  privacy_card.json beside it; the parameters read from the file are exactly A's (the entry is
  skipped). Re-saving the arrays without the entry (the user's declaration) makes the weights
  "assumed public"; a card beside the weights that differs from the one inside is refused in
  one line. Fails on the branch's start commit (no card inside the .npz; checked)."""
  a_export = tmp_path / 'a_export'
  card = _export_a(runs, a_export)
  with np.load(a_export / 'params.npz') as f:
    entries = {k: f[k] for k in f.files}
  inside = json.loads(entries.pop('__dpjax_privacy_card__').tobytes().decode('utf-8'))
  assert inside == card == json.load(open(a_export / 'privacy_card.json'))
  params = checkpoints.read_state(str(runs / 'given'), STEPS)['params']
  loaded = lora.flatten(finetune.load_pretrained(str(a_export / 'params.npz'), params))
  for key, value in lora.flatten(params).items():
    np.testing.assert_array_equal(entries[key], value)
    np.testing.assert_array_equal(loaded[key], value)
  assert set(entries) == set(loaded)
  np.savez(tmp_path / 'stripped.npz', **entries)
  plan = _plan(tmp_path / 'stripped.npz', num_steps=2, options=COARSE)
  assert plan.init_source.kind == 'public' and plan.privacy.accountant.prior_runs == ()
  assert 'assumed public' in plan.init_source.describe()
  other = tmp_path / 'other'
  other.mkdir()
  shutil.copyfile(a_export / 'params.npz', other / 'params.npz')
  (other / 'privacy_card.json').write_text(json.dumps({**card, 'steps': 1}))
  (tmp_path / 'link.npz').symlink_to(other / 'params.npz')
  for source in (other, other / 'params.npz', tmp_path / 'link.npz'):
    with pytest.raises(ValueError, match='the privacy cards of these weights differ') as e:
      init_source.read_source(str(source))
    assert '\n' not in str(e.value)


@pytest.mark.slow
def test_a_fine_tuned_run_exports_and_resumes_only_with_the_weights_it_started_from(runs, tmp_path):
  """The attack on the frozen weights: B starts from A's export X with Dense_0 frozen; X's
  weights are then replaced (the pretraining re-run and exported to the same path). On the
  branch's start commit B's export re-read X and released the new Dense_0 beside a Dense_1
  trained against the old one, a function of three runs while the card composes two, and a
  resume trained on against the new Dense_0. Now both are refused in one line naming the
  change, nothing written; before the change B's export holds the Dense_0 B trained with.
  Failed on the branch's start commit (the export succeeded; checked)."""
  x = tmp_path / 'x'
  _export_a(runs, x)
  config = small_config(
    **{
      'init_from': str(x),
      'freeze': ('Dense_0',),
      'num_steps': 1,
      'seed': 2,
      'checkpoint_every_steps': 1,
      'eval_every_steps': 1,
    }
  )
  train.train_and_evaluate(config, str(tmp_path / 'b'))
  export.export(str(tmp_path / 'b'), str(tmp_path / 'b_export'))
  with np.load(x / 'params.npz') as f:
    entries = {k: f[k] for k in f.files}
  with np.load(tmp_path / 'b_export' / 'params.npz') as f:
    np.testing.assert_array_equal(f['Dense_0/kernel'], entries['Dense_0/kernel'])
  entries['Dense_0/kernel'] = entries['Dense_0/kernel'] + np.float32(1e-3)  # "A2", same card.
  np.savez(x / 'params.npz', **entries)
  with pytest.raises(ValueError, match='these weights are not those this run started from') as e:
    export.export(str(tmp_path / 'b'), str(tmp_path / 'b_export2'), allow_shared_seed=True)
  assert '\n' not in str(e.value) and not os.path.exists(tmp_path / 'b_export2')
  before = tree_digest(tmp_path / 'b')
  config.num_steps = 2
  with pytest.raises(
    ValueError, match=re.escape(f"init_from = '{x}': these weights are not those")
  ):
    train.train_and_evaluate(config, str(tmp_path / 'b'))
  assert tree_digest(tmp_path / 'b') == before
  meta = checkpoints.read_metadata(str(tmp_path / 'b'))[-1]  # Recorded at the start.
  assert meta['fingerprint']['init_from.weights_sha256'] == meta['init_from']['weights_sha256']
