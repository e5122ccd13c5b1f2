"""The trainer with correlated noise (issue 36): BandMF with cyclic Poisson sampling trains,
reports the ε `dpjax.account` gives for the same config, records the mechanism that ran, and
resumes from a checkpoint bit for bit (the noise state is in it); a change of the mechanism on
resume, and BandMF where its accounting does not hold, are refused before any compute."""

import contextlib
import io
import json
import shutil

import jax
import numpy as np
import pytest

from dpjax import account
from dpjax import train
from dpjax.privacy.correlated import strategy
from dpjax.trainer.workdir import checkpoints
from tests.run_configs import small_config

pytestmark = pytest.mark.slow  # Whole trainings (`make test-unit` skips).

BANDMF = {
  'privacy.noise': 'bandmf',
  'privacy.num_bands': 3,
  'sampler.name': 'cyclic_poisson',
  'sampler.num_groups': 3,
  'sampler.batch_size': 128,  # b·k = 384 <= N = 1437.
}
# BLT in dataset order (no amplification): b = 480, 3 steps per epoch, 2 epochs in 6 steps.
BLT = {
  'privacy.noise': 'blt',
  'privacy.num_buffers': 2,
  'sampler.name': 'deterministic',
  'sampler.batch_size': 480,
  'sampler.physical_batch_size': 96,
}


def _flat(params):
  return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(params)])


# BandMF (cyclic Poisson) runs the same checks through a SIGKILL and a rerun in
# tests/e2e/test_train.py::test_resume_after_sigkill_is_bit_identical.
@pytest.mark.parametrize('mechanism', ['blt'])
def test_trains_reports_accounts_epsilon_and_resumes_bit_for_bit(tmp_path, mechanism):
  """6 steps straight vs the same run stopped after step 2 (its later checkpoints removed) and
  rerun: the same parameters bit for bit, so the restored noise state (the last 2 noise
  vectors, or BLT's 2 buffers) continued the recursion exactly; a lost or zeroed state changes
  every parameter. The Final ε is `dpjax.account --config` of the same config (one accountant
  for both: BandMF amplified by cyclic Poisson, BLT by its sensitivity over the epochs), and the
  checkpoint records the mechanism and its parameters as the step ran them; a resume that
  would change the strategy (8 steps instead of 6) is refused and writes nothing."""
  settings = BANDMF if mechanism == 'bandmf' else BLT
  straight = train.train_and_evaluate(small_config(**settings), str(tmp_path / 'straight'))
  resumed_dir = tmp_path / 'resumed'
  shutil.copytree(tmp_path / 'straight', resumed_dir)
  for step in ('4', '6'):
    shutil.rmtree(resumed_dir / 'checkpoints' / step)
  resumed = train.train_and_evaluate(small_config(**settings), str(resumed_dir))
  np.testing.assert_array_equal(_flat(resumed['params']), _flat(straight['params']))
  meta = checkpoints.read_metadata(str(resumed_dir))[-1]
  if mechanism == 'bandmf':
    coefs = strategy.for_run('bandmf', 6, num_bands=3).coefs
    assert meta['noise'] == {'name': 'bandmf', 'bands': 3, 'coefficients': list(coefs)}
    assert meta['fingerprint']['privacy.noise_strategy']['coefficients'] == list(coefs)
    assert meta['sampler']['num_groups'] == 3
  else:
    run = strategy.for_run('blt', 6, num_buffers=2)
    assert meta['noise']['name'] == 'blt' and meta['noise']['decays'] == list(run.decays)
    assert meta['fingerprint']['privacy.noise_strategy']['scale'] == run.scale
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    argv = ['--config=configs/digits_mlp.py', '--json', '--config.seed=0']
    argv += [
      f'--config.{k}={v}'
      for k, v in {
        'sampler.physical_batch_size': 32,
        **settings,
        'num_epochs': 0,
        'num_steps': 6,
        'privacy.target_epsilon': 0.0,
        'privacy.noise_multiplier': 1.0,
      }.items()
    ]
    assert account.main(argv) == 0
  report = json.loads(stdout.getvalue())
  assert straight['privacy']['epsilon'] == pytest.approx(report['epsilon'], rel=1e-12)
  if mechanism == 'bandmf':
    assert report['details']['participations'] == 2  # ⌈6 / 3⌉ at rate 128·3/1437.
  else:
    assert report['details']['strategy_sensitivity_exact'] is True

  changed = small_config(**{**settings, 'num_steps': 8})
  with pytest.raises(Exception, match='Changed: privacy.noise_strategy'):
    train.train_and_evaluate(changed, str(resumed_dir))
  assert checkpoints.read_metadata(str(resumed_dir))[-1]['step'] == 6  # Nothing written.


@pytest.mark.parametrize(
  'overrides, match',
  [
    ({'sampler.name': 'poisson', 'sampler.num_groups': 1}, 'accounted for sampler cyclic_poisson'),
    ({'sampler.name': 'balls_and_bins', 'sampler.num_groups': 1}, 'not analysed'),
    ({'sampler.name': 'poisson', 'privacy.noise': 'gaussian'}, 'sampler.num_groups = 3'),
  ],
)
def test_bandmf_where_it_is_not_accounted_is_refused_before_training(tmp_path, overrides, match):
  with pytest.raises(Exception, match=match):
    train.train_and_evaluate(small_config(**{**BANDMF, **overrides}), str(tmp_path / 'w'))
  assert not (tmp_path / 'w' / 'checkpoints').exists()


def test_a_noise_state_that_does_not_fit_the_device_is_refused_before_compiling(
  tmp_path, monkeypatch
):
  """b − 1 copies of the parameters beside ~4 more: on a device of 100 kB (MLP: 4,810
  float32 parameters, 19 kB each) 3 bands need 38 kB + 77 kB, refused in one line naming
  privacy.num_bands; nothing is trained or checkpointed."""
  from dpjax.trainer.planning import physical_batch  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(physical_batch, 'device_memory_bytes', lambda device=None: 100_000)
  with pytest.raises(Exception, match=r'privacy.num_bands = 3: the correlated-noise state needs'):
    train.train_and_evaluate(small_config(**BANDMF), str(tmp_path / 'w'))
  assert not (tmp_path / 'w' / 'checkpoints').exists()
