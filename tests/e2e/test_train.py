"""End-to-end training: outputs, ε in checkpoints, exact resume, one compilation."""

import contextlib
import glob
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from dpjax.privacy import accounting
from dpjax import account as account_cli
from dpjax import checkpoints as checkpoints_cli
from dpjax.trainer.workdir import checkpoints
from dpjax.trainer.planning import plan as plan_lib
from dpjax.privacy import privacy_plan
from dpjax import train
from dpjax.configs import digits_mlp
from tests.run_configs import small_config

pytestmark = pytest.mark.slow  # Whole trainings or child processes (`make test-unit` skips).

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def flat_params(params):
  return np.concatenate([np.zeros(0)] + [np.asarray(x).ravel() for x in jax.tree.leaves(params)])


def test_run_writes_config_metrics_events_and_checkpoints_with_epsilon(reference_run, capsys):
  config = small_config()
  tmp_path, result = reference_run
  assert json.load(open(tmp_path / 'config.json'))['num_steps'] == 6
  lines = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert [line['step'] for line in lines] == [0, 2, 3, 4, 6]
  assert {'nonprivate_train_loss', 'nonprivate_train_accuracy', 'epsilon', 'eval_accuracy'} <= set(
    lines[-1]
  )
  assert glob.glob(str(tmp_path / 'tensorboard' / 'events.out.tfevents.*'))
  # The ε in metrics and checkpoints is the accountant's, for the same config.
  acct = plan_lib.make_accountant(config, 1437)
  rows = checkpoints.read_metadata(str(tmp_path))
  assert [row['step'] for row in rows] == [2, 4, 6]  # keep_checkpoints = 3
  for row in rows:
    expected = acct.epsilon_at(row['step'])
    assert row['privacy']['epsilon'] == pytest.approx(expected.epsilon, rel=1e-12)
    assert row['privacy']['bound'] == expected.bound == 'upper'
    assert (
      row['noise_multiplier'] == 1.0 and row['clip_norm'] == 1.0 and row['num_examples'] == 1437
    )
    assert row['sampler']['name'] == 'poisson' and 'seed' not in row
    assert row['fingerprint']['seed_sha256'] == privacy_plan.seed_digest(0)
    assert row['config']['privacy']['delta'] == 1e-5
  assert lines[-1]['epsilon'] == pytest.approx(rows[-1]['privacy']['epsilon'])
  assert result['privacy']['epsilon'] == pytest.approx(rows[-1]['privacy']['epsilon'])
  # Listing CLI.
  capsys.readouterr()
  assert checkpoints_cli.main([str(tmp_path)]) == 0
  listing = capsys.readouterr().out
  assert 'upper' in listing and f'{rows[-1]["privacy"]["epsilon"]:.4f}' in listing


@pytest.mark.parametrize('sampler', ['poisson', 'balls_and_bins'])
def test_step_compiles_once_over_an_epoch_of_variable_batches(
  tmp_path, sampler, in_process_pld_builds
):
  """(Balls-and-bins' one-epoch PLDs are built in this process: this test is about the step.)"""
  config = small_config(**{'sampler.name': sampler, 'num_steps': 14, 'checkpoint_every_steps': 100})
  if sampler == 'balls_and_bins':  # The epoch's PLD (~2 s at σ = 1) is cheaper to build at σ = 4.
    config.privacy.noise_multiplier = 4.0
  result = train.train_and_evaluate(config, str(tmp_path))
  assert 14 > 1437 / 128  # More than one epoch (12 steps).
  assert result['compilations'] == {'train_steps': 1}  # One program (S steps a call).


def test_non_private_baseline_reports_no_epsilon(tmp_path):
  result = train.train_and_evaluate(small_config(**{'privacy.enabled': False}), str(tmp_path))
  assert 'privacy' not in result
  meta = checkpoints.read_metadata(str(tmp_path))[-1]
  assert meta['privacy']['epsilon'] is None and meta['fingerprint']['privacy.enabled'] is False
  assert meta['noise_multiplier'] is None


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(reference_run, tmp_path, capsys):
  """The reference run (checkpoints 2, 4, 6) as if stopped at step 4, its checkpoint 4 corrupt:
  the rerun restores 2 and ends bit for bit where the reference did. (It trained a 4-step run
  of its own first: the same state, one training more.)"""
  reference_dir, reference = reference_run
  work = tmp_path / 'run'
  shutil.copytree(reference_dir, work)
  shutil.rmtree(work / 'checkpoints' / '6')
  for path in glob.glob(str(work / 'checkpoints' / '4' / 'state' / '**'), recursive=True):
    if os.path.isfile(path):
      with open(path, 'wb') as f:
        f.write(b'garbage')
  capsys.readouterr()
  resumed = train.train_and_evaluate(small_config(), str(work))
  err = capsys.readouterr().err
  assert 'checkpoint 4 is unreadable' in err
  np.testing.assert_array_equal(flat_params(resumed['params']), flat_params(reference['params']))


def test_resume_after_sigkill_is_bit_identical(tmp_path):
  """SIGKILL `python -m dpjax.train` mid-run and rerun (the seed drawn in secret, kept in the
  workdir); separately train uninterrupted with that seed: same params and ε. The run uses
  correlated noise (BandMF, 3 bands, cyclic Poisson with 3 groups: issue 36), whose noise state
  (the last 2 noise vectors) must survive the kill in the checkpoint too; DP-SGD's stateless
  noise is the special case without it (its resumes: test_corrupt_latest_checkpoint_*,
  tests/e2e/test_correlated_training.py). The kill needs a
  process; the rerun and the uninterrupted run train in this one (the same config and XLA flags:
  the same programs), which spares two interpreters. b = 128 and P = 32, as small_config():
  the programs of the other runs here (B = 288, K = 9), which the child loads from the suite's
  compilation cache instead of compiling its own (b = 64, P = 16 were programs of this test
  alone)."""
  overrides = {
    'num_steps': 30,
    'num_epochs': 0,
    'checkpoint_every_steps': 10,
    'log_every_steps': 15,
    'eval_every_steps': 15,
    'privacy.target_epsilon': 0.0,
    'privacy.noise_multiplier': 1.0,
    'sampler.batch_size': 128,
    'sampler.physical_batch_size': 32,
    'sampler.name': 'cyclic_poisson',
    'sampler.num_groups': 3,
    'privacy.noise': 'bandmf',
    'privacy.num_bands': 3,
  }
  killed = tmp_path / 'killed'
  proc = subprocess.Popen(
    [
      sys.executable,
      '-m',
      'dpjax.train',
      f'--config={REPO}/configs/digits_mlp.py',
      f'--workdir={killed}',
      *[f'--config.{name}={value}' for name, value in overrides.items()],
    ],
    cwd=REPO,
    # The suite's XLA cache (tests/conftest.py), not ~/.cache/dpjax/xla: the two runs below
    # load the programs the child compiled instead of compiling them again.
    env=dict(
      os.environ, JAX_PLATFORMS='cpu', DPJAX_CACHE_DIR=os.environ['JAX_COMPILATION_CACHE_DIR']
    ),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  deadline = time.time() + 300
  while not os.path.isdir(killed / 'checkpoints' / '10') and time.time() < deadline:
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL
  steps_at_kill = checkpoints.read_metadata(str(killed))[-1]['step']
  assert 10 <= steps_at_kill < 30, 'the kill must land mid-run'

  def config(**extra):
    config = digits_mlp.get_config()  # What --config=configs/digits_mlp.py loads.
    config.update_from_flattened_dict({**overrides, **extra})
    return config

  train.train_and_evaluate(config(), str(killed))  # Resumes with the stored seed.
  seed = json.load(open(killed / 'private' / 'seed.json'))['seed']
  train.train_and_evaluate(config(seed=seed), str(tmp_path / 'full'))

  full_meta = checkpoints.read_metadata(str(tmp_path / 'full'))[-1]
  resumed_meta = checkpoints.read_metadata(str(killed))[-1]
  assert resumed_meta['step'] == full_meta['step'] == 30
  assert resumed_meta['privacy'] == full_meta['privacy']  # Same ε, same bound.
  assert resumed_meta['num_truncated'] == full_meta['num_truncated']
  assert resumed_meta['fingerprint'] == full_meta['fingerprint']
  assert resumed_meta['noise']['name'] == 'bandmf' and resumed_meta['noise']['bands'] == 3
  restore = lambda w: checkpoints.make_manager(str(w), 1, read_only=True).restore(
    30, args=checkpoints.ocp.args.Composite(state=checkpoints.ocp.args.StandardRestore())
  )['state']
  full_state, resumed_state = restore(tmp_path / 'full'), restore(killed)
  np.testing.assert_array_equal(
    flat_params(resumed_state['params']), flat_params(full_state['params'])
  )
  np.testing.assert_array_equal(
    flat_params(resumed_state['opt_state']), flat_params(full_state['opt_state'])
  )
  # Every logged step appears exactly once after the resume.
  steps = [json.loads(line)['step'] for line in open(killed / 'metrics.jsonl')]
  assert steps == sorted(set(steps)) and steps[-1] == 30
  # The ε of the run is `dpjax.account --config` of its config (amplified BandMF: ⌈30/3⌉
  # Poisson participations at 128·3/1437), one accountant for both.
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    argv = [f'--config={REPO}/configs/digits_mlp.py', '--json']
    assert account_cli.main(argv + [f'--config.{k}={v}' for k, v in overrides.items()]) == 0
  report = json.loads(stdout.getvalue())
  assert report['epsilon'] == pytest.approx(full_meta['privacy']['epsilon'], rel=1e-12)
  assert report['details']['participations'] == 10


def test_target_epsilon_is_met_and_never_exceeded(tmp_path):
  config = small_config(**{'privacy.noise_multiplier': None, 'privacy.target_epsilon': 2.0})
  plan = plan_lib.make_plan(config, 1437)  # σ calibrated once, target kept.
  assert plan.config.privacy.target_epsilon == 2.0 and plan.privacy.noise_multiplier > 0
  assert plan.privacy.noise_multiplier_source == 'calibrated'
  final = plan.privacy.accountant.epsilon(6)
  assert 0.98 * 2.0 <= final <= 2.0
  # A fixed σ with a target acts as a budget: a run that would exceed it is refused.
  config = small_config(**{'privacy.noise_multiplier': 0.8, 'privacy.target_epsilon': 1.0})
  with pytest.raises(ValueError, match='target_epsilon'):
    train.train_and_evaluate(config, str(tmp_path / 'b'))
  assert not os.path.exists(tmp_path / 'b' / 'checkpoints')  # Refused before any step.


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'sampler.name': 'poison'}, 'sampler.name'),
    ({'sampler.batch_size': 5000}, 'sampler.batch_size'),
    ({'sampler.physical_batch_size': -8}, 'physical_batch_size'),
    ({'sampler.max_batch_size': 100}, 'multiple of'),
    ({'privacy.noise_multiplier': None}, 'noise_multiplier'),
    ({'privacy.target_epsilon': -1.0}, 'target_epsilon'),
    ({'privacy.delta': 1.5}, 'delta'),
    ({'privacy.clip_norm': -1.0}, 'clip_norm'),
    ({'num_epochs': 3}, 'num_steps'),
    ({'optimizer.name': 'lamb'}, 'optimizer.name'),
    ({'model.name': 'resnet'}, 'model.name'),
    ({'data.source': 'imagenet'}, 'data.source'),
    ({'eval_every_steps': 0}, 'eval_every_steps'),
  ],
)
def test_bad_config_fails_before_any_compute(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(small_config(**overrides), str(tmp_path))
  assert not os.path.exists(tmp_path / 'checkpoints')


def test_mnist_cnn_config_trains_on_mock_tfds_data(tmp_path):
  """The MNIST config end to end on tfds.testing.mock_data (one real step)."""
  import tensorflow_datasets as tfds
  from dpjax.configs import mnist_cnn

  config = mnist_cnn.get_config('runlocal')
  config.num_steps = 1
  config.data.data_dir = str(tmp_path)
  with tfds.testing.mock_data(num_examples=64, policy=tfds.testing.MockPolicy.USE_CODE):
    result = train.train_and_evaluate(config, str(tmp_path / 'work'))
  assert result['step'] == 1 and np.isfinite(result['nonprivate_train_loss'])
  assert result['privacy']['bound'] == 'upper' and result['privacy']['epsilon'] <= 3.0


def test_ema_is_evaluated_and_checkpointed_beside_the_raw_parameters(tmp_path, reference_run):
  result = train.train_and_evaluate(small_config(ema_decay=0.9), str(tmp_path / 'ema'))
  rows = [json.loads(line) for line in open(tmp_path / 'ema' / 'metrics.jsonl')]
  evaluated = [row for row in rows if 'eval_accuracy' in row]
  assert all('eval_accuracy_ema' in row and 'eval_loss_ema' in row for row in evaluated)
  state = checkpoints.read_state(str(tmp_path / 'ema'), 6)
  assert int(state['ema']['count']) == 6  # One EMA update per logical step.
  assert not np.array_equal(flat_params(state['ema']['params']), flat_params(state['params']))
  assert result['eval_accuracy_ema'] > 0
  # ema_decay = 0 (small_config's, the reference run's): the "EMA" is the parameters themselves.
  reference_dir, _ = reference_run
  assert json.load(open(reference_dir / 'config.json'))['ema_decay'] == 0
  state = checkpoints.read_state(str(reference_dir), 6)
  np.testing.assert_array_equal(flat_params(state['ema']['params']), flat_params(state['params']))


def test_frozen_layer_is_not_trained_and_not_checkpointed_as_trainable(tmp_path, reference_run):
  from dpjax.trainer.planning import finetune  # pylint: disable=import-outside-toplevel

  _, reference = reference_run  # Pretrained: the reference run's parameters.
  finetune.save_npz(str(tmp_path / 'pre.npz'), reference['params'])
  result = train.train_and_evaluate(
    small_config(**{'init_from': str(tmp_path / 'pre.npz'), 'freeze': ('Dense_0/.*',)}),
    str(tmp_path / 'ft'),
  )
  assert set(result['params']) == {'Dense_1'}  # Only the trainable part is trained and saved.
  assert not np.array_equal(
    np.asarray(result['params']['Dense_1']['kernel']),
    np.asarray(reference['params']['Dense_1']['kernel']),
  )


def test_automatic_physical_batch_size_keeps_b_independent_of_the_device(tmp_path, capsys):
  """P = 0: B is resolved to the row before P (it enters ε, so it must not depend on the
  device); P is the largest power of two whose compiled step fits (on this CPU: the first
  >= B); the run equals one with that P given explicitly, and compiles once.

  b = 8 (B = 58): the search compiles P = 32 (the trainer's first), then 64 >= B, and stops.
  At b = 128 (B = 269) it compiled five programs, 32 to 512, for the same checks. σ = 4: B and
  P do not depend on σ, and ε at q = 8/1437 costs ~3 s of CPU less to account than at σ = 1
  (a narrower privacy loss, fewer grid points) over the two runs."""
  from dpjax.privacy import batching

  small = {'sampler.batch_size': 8, 'privacy.noise_multiplier': 4.0}
  auto = train.train_and_evaluate(
    small_config(**small, **{'sampler.physical_batch_size': 0}), str(tmp_path / 'auto')
  )
  meta = checkpoints.read_metadata(str(tmp_path / 'auto'))[-1]
  cap = meta['fingerprint']['sampler.max_batch_size']
  chosen = meta['sampler']['physical_batch_size']
  config = small_config(**small)
  sampler = plan_lib.make_sampler(config, meta['num_examples'])
  assert cap == batching.resolve_max_batch_size(sampler, 0, num_steps=6, delta=config.privacy.delta)
  assert chosen >= cap > chosen // 2 and chosen & (chosen - 1) == 0
  assert chosen > 32  # Past the first candidate: the search went up.
  assert f'P = {chosen}' in capsys.readouterr().out
  assert auto['compilations'] == {'train_steps': 1}
  explicit = train.train_and_evaluate(
    small_config(
      **small, **{'sampler.physical_batch_size': chosen, 'sampler.max_batch_size': chosen}
    ),
    str(tmp_path / 'explicit'),
  )
  np.testing.assert_array_equal(flat_params(auto['params']), flat_params(explicit['params']))
