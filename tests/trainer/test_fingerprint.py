"""The privacy fingerprint: a resume that would change what enters ε is refused, byte for byte.

Each case trains nothing new: a finished 6-step run is copied, the config is
changed in one field and the run is restarted on the copy. The restart must be
refused before any compute with a message naming the field, and the copy must
be byte-identical afterwards.
"""

import hashlib
import json
import os
import pathlib
import shutil

import numpy as np
import pytest
from scipy import stats

from dpjax.trainer.planning import plan as plan_lib
from dpjax.privacy import accounting
from dpjax.trainer.workdir import checkpoints
from dpjax.data import digits
from dpjax.privacy import samplers
from dpjax import train
from tests import independent
from tests.run_configs import small_config
from tests.run_configs import tree_digest

pytestmark = pytest.mark.slow  # Whole trainings or child processes (`make test-unit` skips).


def _configs(root):
  return {
    'given': small_config(),
    'calibrated': small_config(**{'privacy.noise_multiplier': None, 'privacy.target_epsilon': 2.0}),
    'non_private': small_config(**{'privacy.enabled': False}),
    'npz': small_config(
      **{'data.source': 'npz', 'data.path': str(root / 'digits.npz'), 'data.num_classes': 10}
    ),
  }


def _train_runs(root, given):
  """Into root: the digits npz and the runs of `_configs`, 'given' (small_config()) a copy of
  the finished run `given` (the session's `reference_run`: the same config, trained once)."""
  root = pathlib.Path(root)
  x_train, y_train, x_test, y_test = digits.load_digits_arrays()
  np.savez(root / 'digits.npz', x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
  for name, config in _configs(root).items():
    if name == 'given':
      shutil.copytree(given, root / name)
    else:
      train.train_and_evaluate(config, str(root / name))


def built_runs(shared_setup, reference_run) -> pathlib.Path:
  """The root of `_train_runs`, built once per test session (pytest-xdist workers share it)."""
  build = lambda root: _train_runs(root, reference_run[0])
  return pathlib.Path(shared_setup('fingerprint_runs', build))


@pytest.fixture(scope='module')
def finished_runs(shared_setup, reference_run):
  """A private run with a given σ, one with a calibrated σ, a non-private one, one on an npz.

  Trained once per test session (pytest-xdist workers share them): every test copies a run
  before changing anything, or only reads it."""
  root = built_runs(shared_setup, reference_run)
  return root, _configs(root)


def restart_on_copy(finished_runs, tmp_path, run, overrides):
  root, configs = finished_runs
  work = tmp_path / run
  shutil.copytree(root / run, work)
  before = tree_digest(work)
  config = configs[run].copy_and_resolve_references()
  config.update_from_flattened_dict(overrides)
  try:
    return train.train_and_evaluate(config, str(work)), before, tree_digest(work)
  except ValueError as e:
    after = tree_digest(work)
    assert after == before, 'a refused resume changed the workdir'
    raise e


@pytest.mark.parametrize(
  'overrides, field',
  [
    ({'sampler.name': 'balls_and_bins'}, 'sampler.name'),
    ({'sampler.name': 'shuffle'}, 'sampler.name'),
    ({'sampler.batch_size': 64}, 'sampler.batch_size'),
    ({'sampler.max_batch_size': 320}, 'sampler.max_batch_size'),
    ({'seed': 1}, 'seed: another seed'),
    ({'privacy.clip_norm': 2.0}, 'privacy.clip_norm'),
    ({'privacy.noise_multiplier': 1.5}, 'privacy.noise_multiplier'),
    ({'privacy.delta': 1e-6}, 'privacy.delta'),
    ({'privacy.accountant': 'rdp'}, 'privacy.accountant'),
    ({'privacy.group_size': 2}, 'privacy.group_size'),
    ({'privacy.enabled': False}, 'privacy.enabled'),
    # Correlated noise (issue 36): its groups, mechanism and strategy enter ε.
    ({'sampler.name': 'cyclic_poisson', 'sampler.num_groups': 2}, 'sampler.num_groups'),
    (
      {
        'sampler.name': 'cyclic_poisson',
        'sampler.num_groups': 2,
        'privacy.noise': 'bandmf',
        'privacy.num_bands': 2,
      },
      'privacy.noise_strategy',
    ),
    (
      {'data.source': 'synthetic', 'data.num_examples': 1437, 'data.num_classes': 10},
      'data.source',
    ),
  ],
)
def test_changing_a_fingerprint_field_is_refused_and_changes_nothing(
  finished_runs, tmp_path, overrides, field
):
  with pytest.raises(ValueError, match=f'Changed: .*{field}(: .* → |)') as info:
    restart_on_copy(finished_runs, tmp_path, 'given', overrides)
  assert 'new --workdir' in str(info.value)


def test_enabling_privacy_on_a_non_private_run_is_refused(finished_runs, tmp_path):
  with pytest.raises(ValueError, match='privacy.enabled: False → True'):
    restart_on_copy(finished_runs, tmp_path, 'non_private', {'privacy.enabled': True})


def _changed_npz(finished_runs, tmp_path, change):
  root, _ = finished_runs
  arrays = dict(np.load(root / 'digits.npz'))
  change(arrays)
  np.savez(tmp_path / 'changed.npz', **arrays)
  return {'data.path': str(tmp_path / 'changed.npz')}


def test_other_labels_in_the_same_file_are_refused(finished_runs, tmp_path):
  def one_label(arrays):
    arrays['y_train'][700] = (arrays['y_train'][700] + 1) % 10  # One label of 1437.

  with pytest.raises(ValueError, match='data.content_sha256'):
    restart_on_copy(
      finished_runs, tmp_path, 'npz', _changed_npz(finished_runs, tmp_path, one_label)
    )


def test_one_changed_feature_value_is_refused(finished_runs, tmp_path):
  """Issue 24 item 2: the fingerprint hashed shapes and at most 4,096 labels, so a changed
  feature (here one pixel of one image) resumed silently on the main before this change."""

  def one_pixel(arrays):
    arrays['x_train'][321, 4, 4, 0] += 1.0

  with pytest.raises(ValueError, match='data.content_sha256'):
    restart_on_copy(
      finished_runs, tmp_path, 'npz', _changed_npz(finished_runs, tmp_path, one_pixel)
    )


def test_swapping_the_features_of_two_same_label_rows_is_refused(finished_runs, tmp_path):
  """The attack of issue 24 item 2: a swap mid-epoch made the shuffle and deterministic
  samplers use one record twice in an epoch (claimed ε 2.94, true 3.71)."""

  def swap(arrays):
    y = arrays['y_train']
    i, j = np.flatnonzero(y == y[0])[:2]
    arrays['x_train'][[i, j]] = arrays['x_train'][[j, i]]

  with pytest.raises(ValueError, match='data.content_sha256'):
    restart_on_copy(finished_runs, tmp_path, 'npz', _changed_npz(finished_runs, tmp_path, swap))


def test_the_same_content_at_another_path_resumes(finished_runs, tmp_path):
  overrides = _changed_npz(finished_runs, tmp_path, lambda arrays: None)
  restart_on_copy(finished_runs, tmp_path, 'npz', {**overrides, 'num_steps': 7})


def test_a_calibrated_run_refuses_a_change_of_any_calibration_input(finished_runs, tmp_path):
  for overrides, field in (
    ({'sampler.batch_size': 64}, 'sampler.batch_size'),
    ({'privacy.delta': 1e-6}, 'privacy.delta'),
    ({'privacy.noise_multiplier': 1.0}, 'privacy.noise_multiplier'),
  ):
    with pytest.raises(ValueError, match=field):
      restart_on_copy(finished_runs, tmp_path / field, 'calibrated', overrides)


def test_non_privacy_fields_may_change(finished_runs, tmp_path):
  result, _, _ = restart_on_copy(
    finished_runs,
    tmp_path,
    'given',
    {
      'optimizer.learning_rate': 0.5,
      'log_every_steps': 3,
      'eval_every_steps': 2,
      'keep_checkpoints': 5,
      'sampler.physical_batch_size': 16,
    },
  )
  assert result['step'] == 6  # Nothing left to do, and no refusal.


def test_a_physical_batch_that_does_not_divide_the_cap_is_refused(finished_runs, tmp_path):
  root, _ = finished_runs
  cap = checkpoints.read_metadata(str(root / 'given'))[-1]['fingerprint']['sampler.max_batch_size']
  bad = next(p for p in (48, 96, 80, 112) if cap % p)
  with pytest.raises(ValueError, match=f'physical_batch_size = {bad}.*B = {cap}'):
    restart_on_copy(finished_runs, tmp_path, 'given', {'sampler.physical_batch_size': bad})


def test_extension_recomputes_epsilon_and_respects_the_budget(finished_runs, tmp_path):
  root, _ = finished_runs
  old = checkpoints.read_metadata(str(root / 'calibrated'))[-1]
  sigma = old['fingerprint']['privacy.noise_multiplier']
  assert old['noise_multiplier_source'] == 'calibrated' and old['privacy']['epsilon'] <= 2.0
  # σ was calibrated for 6 steps at ε ≈ 2: 10 steps exceed the budget, and say by how much.
  with pytest.raises(ValueError, match=r'extending the run to 10 steps would reach ε = 2\.\d+'):
    restart_on_copy(finished_runs, tmp_path / 'a', 'calibrated', {'num_steps': 10})
  # Raising the budget allows it; σ is the checkpoint's (never re-calibrated), ε is recomputed.
  result, _, _ = restart_on_copy(
    finished_runs, tmp_path / 'b', 'calibrated', {'num_steps': 10, 'privacy.target_epsilon': 3.0}
  )
  rows = checkpoints.read_metadata(str(tmp_path / 'b' / 'calibrated'))
  assert rows[-1]['step'] == 10 and rows[-1]['noise_multiplier'] == sigma
  assert rows[-1]['noise_multiplier_source'] == 'checkpoint'
  sampler = plan_lib.make_sampler(small_config(), 1437)
  cap = old['fingerprint']['sampler.max_batch_size']  # B is the checkpoint's, not re-derived.
  assert rows[-1]['fingerprint']['sampler.max_batch_size'] == cap
  eta = old['fingerprint']['privacy.rounding_eta']  # The float rounding ε pays for, kept.
  assert rows[-1]['fingerprint']['privacy.rounding_eta'] == eta > 0
  expected = accounting.Accountant(
    sampler, sigma, 1e-5, max_batch_size=cap, sensitivity=1 + eta
  ).epsilon(10)
  assert result['privacy']['epsilon'] == pytest.approx(expected, rel=1e-9)
  assert 2.0 < result['privacy']['epsilon'] <= 3.0


def test_a_run_cannot_end_before_its_checkpoint(finished_runs, tmp_path):
  with pytest.raises(ValueError, match='checkpoint is at step 6'):
    restart_on_copy(finished_runs, tmp_path, 'given', {'num_steps': 4})


def test_checkpoint_without_fingerprint_is_refused(finished_runs, tmp_path):
  root, _ = finished_runs
  work = tmp_path / 'old'
  shutil.copytree(root / 'given', work)
  for row_dir in (work / 'checkpoints').iterdir():
    path = row_dir / 'metadata' / 'metadata'
    if path.exists():
      meta = json.loads(path.read_text())
      meta.pop('fingerprint')
      path.write_text(json.dumps(meta))
  with pytest.raises(ValueError, match='no privacy fingerprint'):
    train.train_and_evaluate(finished_runs[1]['given'], str(work))


def test_sigma_zero_and_infinite_clip_norm_are_refused_before_anything(tmp_path):
  """Regression: σ = 0 used to train without noise and report the ε of a calibrated σ."""
  for overrides, field in (
    ({'privacy.noise_multiplier': 0.0}, 'privacy.noise_multiplier'),
    ({'privacy.noise_multiplier': -1.0}, 'privacy.noise_multiplier'),
    ({'privacy.clip_norm': float('inf')}, 'privacy.clip_norm'),
    ({'privacy.clip_norm': float('nan')}, 'privacy.clip_norm'),
    ({'privacy.clip_norm': 0.0}, 'privacy.clip_norm'),
  ):
    with pytest.raises(ValueError, match=f'{field} = .*privacy.enabled=False'):
      train.train_and_evaluate(
        small_config(**overrides, **{'privacy.target_epsilon': 3.0}), str(tmp_path / 'w')
      )
    assert not os.path.exists(tmp_path / 'w')


@pytest.mark.parametrize('run', ['given', 'calibrated'])
def test_every_fingerprint_field_matches_an_independent_derivation(finished_runs, run):
  """Every field that enters ε, derived here without dpjax: the config's values, N counted
  from the data, η from its closed form, the truncation mass from scipy's binomial tail, ε
  from dp_accounting, and for the calibrated run a σ whose ε meets the target tightly.

  The test this replaces compared the row's σ with the fingerprint's and the privacy block's,
  three copies of one value, which agree whatever the plan got wrong (planted: a
  `PrivacyPlan.create` that counts N + 200 rows, as canaries counted twice would: σ
  calibrated and ε accounted for q = 128/1637; the old test passed, this one fails)."""
  root, configs = finished_runs
  config = configs[run]
  rows = checkpoints.read_metadata(str(root / run))
  num_examples = 1437  # sklearn's 1,797 digits less the 360 of the test split.
  seed_digest = hashlib.sha256(b'dpjax-seed:0').hexdigest()
  q = config.sampler.batch_size / num_examples
  for row in rows:
    fp = row['fingerprint']
    cap, sigma, eta = (
      fp['sampler.max_batch_size'],
      fp['privacy.noise_multiplier'],
      fp['privacy.rounding_eta'],
    )
    assert fp == {
      'fingerprint_version': 3,
      'privacy.enabled': True,
      'sampler.name': 'poisson',
      'sampler.num_examples': num_examples,
      'sampler.batch_size': 128,
      'sampler.max_batch_size': cap,
      'privacy.group_size': 1,
      'privacy.noise_multiplier': sigma,
      'privacy.clip_norm': config.privacy.clip_norm,
      'privacy.delta': config.privacy.delta,
      'privacy.accountant': 'pld',
      'privacy.matmul_format': 'float32',
      'privacy.rounding_eta': eta,
      'seed_sha256': seed_digest,
      'audit.num_canaries': 0,
      'audit.kind': None,
      'data.source': 'digits',
      'data.split': 'train',
      'data.num_examples': num_examples,
      'data.content_sha256': fp['data.content_sha256'],
    }
    # σ, C and B reported are those of the fingerprint (what ran), not re-resolved.
    assert row['noise_multiplier'] == sigma == row['privacy']['noise_multiplier']
    assert row['clip_norm'] == fp['privacy.clip_norm'] == 1.0
    assert row['sampler']['max_batch_size'] == cap
    assert cap % config.sampler.physical_batch_size == 0 and cap > 128
    assert eta == pytest.approx(independent.float32_eta(cap), rel=1e-9)
    # The cap's truncation mass T·Pr[Bin(N, q) > B] that ε pays for is an upper bound of
    # scipy's (and negligible).
    steps = row['privacy']['steps']
    assert steps == row['step']
    tail = steps * stats.binom.sf(cap, num_examples, q)
    assert tail <= row['privacy']['details']['truncation_mass'] <= 2 * tail and tail < 1e-30
    # ε: dp_accounting with the sensitivity C(1 + η), i.e. σ/(1 + η), at the step's T.
    assert row['privacy']['epsilon'] == pytest.approx(
      independent.poisson_gaussian_epsilon(q, sigma, steps, config.privacy.delta, eta), rel=1e-3
    )
    if run == 'calibrated' and steps == config.num_steps:
      assert row['privacy']['epsilon'] <= config.privacy.target_epsilon  # The target is met ...
      tighter = independent.poisson_gaussian_epsilon(
        q, 0.98 * sigma, config.num_steps, config.privacy.delta, eta
      )
      assert tighter > config.privacy.target_epsilon  # ... with σ no larger than needed.
    elif run == 'given':
      assert sigma == config.privacy.noise_multiplier
