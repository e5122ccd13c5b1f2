"""Runs that survive: divergence stops cleanly, the start is quiet, rates exclude compilation."""

import json
import os
import subprocess
import sys

import pytest

from configs import digits_mlp
from dpjax import checkpoints
from dpjax import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_config(**overrides):
  config = digits_mlp.get_config()
  config.num_epochs, config.num_steps = 0, 8
  config.sampler.batch_size, config.sampler.physical_batch_size = 128, 32
  config.privacy.target_epsilon, config.privacy.noise_multiplier = 0.0, 1.0
  config.log_every_steps, config.eval_every_steps, config.checkpoint_every_steps = 4, 4, 2
  config.update_from_flattened_dict(overrides)
  return config


def test_divergence_stops_with_the_step_range_and_keeps_the_last_good_checkpoint(tmp_path):
  work = tmp_path / 'w'
  train.train_and_evaluate(small_config(num_steps=4), str(work))  # Good checkpoints 2 and 4.
  # Resume with an absurd learning rate (allowed: it does not enter ε): parameters overflow.
  with pytest.raises(train.TrainingDiverged, match=r'between steps 5 and 6.*last checkpoint'):
    train.train_and_evaluate(small_config(**{'optimizer.learning_rate': 1e38}), str(work))
  assert [row['step'] for row in checkpoints.read_metadata(str(work))] == [2, 4]
  leftovers = [n for n in os.listdir(work / 'checkpoints') if not n.isdigit()]
  assert not leftovers, leftovers  # No temporary or partial checkpoint directory.
  # The last good checkpoint still resumes (with a sane learning rate).
  result = train.train_and_evaluate(small_config(), str(work))
  assert result['step'] == 8 and result['train_loss'] < 10


def test_start_is_two_lines_and_progress_states_rate_eta_and_epsilon(tmp_path):
  proc = subprocess.run(
      [sys.executable, '-m', 'dpjax.train', f'--config={REPO}/configs/digits_mlp.py:runlocal',
       f'--workdir={tmp_path / "w"}', '--config.log_every_steps=2'],
      cwd=REPO, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS='cpu'),
      timeout=300, check=True)
  lines = proc.stdout.strip().splitlines()
  assert lines[0].startswith('1 device(s) on 1 process(es)')
  assert lines[1].startswith('Model mlp with 4,810 parameters; poisson sampler, N = 1437, b = 256')
  assert 'σ = ' in lines[1] and '(calibrated)' in lines[1] and 'target ε = 3' in lines[1]
  progress = [line for line in lines if line.startswith('step ')]
  assert [p.split(',')[0] for p in progress] == ['step 2/5', 'step 4/5', 'step 5/5']
  assert all(' ex/s, ETA ' in p and 'epsilon=' in p for p in progress)
  assert lines[-1].startswith('Final: step 5, test accuracy ')
  assert len(lines) == 2 + len(progress) + 1  # No config dump (it is in config.json).
  rows = [json.loads(line) for line in open(tmp_path / 'w' / 'metrics.jsonl')]
  trained = [row for row in rows if 'train_loss' in row]
  assert all(row['compile_seconds'] > 0 for row in trained)
  assert trained[-1]['examples_per_second'] > 0 and trained[-1]['train_window_steps'] == [5, 5]


def test_non_private_checkpoints_say_so(tmp_path):
  result = train.train_and_evaluate(small_config(**{'privacy.enabled': False, 'num_steps': 2}),
                                    str(tmp_path))
  meta = checkpoints.read_metadata(str(tmp_path))[-1]
  assert meta['privacy']['epsilon'] is None and meta['fingerprint']['privacy.enabled'] is False
  assert meta['noise_multiplier'] is None and 'privacy' not in result
