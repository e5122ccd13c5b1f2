"""Auditing through the trainer: canaries sampled like examples, the bound beside ε, the CLI."""

import json
import shutil

import pytest

from dpjax import audit as audit_cli
from dpjax.trainer import checkpoints
from dpjax import train
from dpjax.privacy.auditing import one_run
from tests import run_configs

pytestmark = pytest.mark.slow  # Whole trainings or child processes (`make test-unit` skips).


def audited_config(**overrides):
  return run_configs.small_config(**{
      'num_steps': 12, 'log_every_steps': 6, 'eval_every_steps': 12,
      'checkpoint_every_steps': 6, 'audit.num_canaries': 200, **overrides})


@pytest.fixture(scope='module')
def audited_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('audited')
  return workdir, train.train_and_evaluate(audited_config(), str(workdir))


def test_audit_bound_sits_beside_epsilon_and_below_it(audited_run, capsys):
  workdir, result = audited_run
  meta = checkpoints.read_metadata(str(workdir))[-1]
  assert meta['num_examples'] == 1437 + 200  # Canaries are examples: N + m.
  assert meta['fingerprint']['audit.num_canaries'] == 200
  audit = meta['audit']
  assert audit == result['audit'] and audit['audit_num_canaries'] == 200
  # Correct code: the empirical lower bound stays below the proven upper bound.
  assert 0 <= audit['audit_epsilon_lower'] <= meta['privacy']['epsilon']
  assert audit['audit_epsilon_lower'] <= one_run.max_epsilon_lower(
      200, delta=1e-5, confidence=audit['audit_confidence'])
  rows = [json.loads(line) for line in open(workdir / 'metrics.jsonl')]
  assert rows[-1]['audit_epsilon_lower'] == audit['audit_epsilon_lower']
  # The CLI recomputes the same audit from what the run saved.
  capsys.readouterr()
  assert audit_cli.main(['--workdir', str(workdir), '--json']) == 0
  out = json.loads(capsys.readouterr().out)
  assert out['audit_epsilon_lower'] == pytest.approx(audit['audit_epsilon_lower'])
  assert out['num_canaries'] == 200 and out['epsilon'] == meta['privacy']['epsilon']


def test_changing_the_canaries_on_resume_is_refused(audited_run, tmp_path):
  workdir, _ = audited_run
  copy = tmp_path / 'copy'
  shutil.copytree(workdir, copy)
  with pytest.raises(ValueError, match='audit.num_canaries: 200 → 100'):
    train.train_and_evaluate(audited_config(**{'audit.num_canaries': 100}), str(copy))
