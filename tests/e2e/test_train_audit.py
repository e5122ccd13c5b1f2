"""Auditing through the trainer: canaries sampled like examples, the bound beside ε, the CLI."""

import json
import math
import shutil

import jax
import numpy as np
import pytest
from scipy import optimize
from scipy import stats

from dpjax import audit as audit_cli
from dpjax.trainer.workdir import checkpoints
from dpjax import train
from dpjax.privacy.auditing import canaries as canaries_lib
from dpjax.privacy.auditing import one_run
from tests import run_configs

pytestmark = pytest.mark.slow  # Whole trainings or child processes (`make test-unit` skips).


def audited_config(**overrides):
  """12 steps at σ = 0.3 (ε ≈ 34): enough signal that the audit finds ε_lower > 0 (at σ = 1
  it found 0, which no recomputation can tell from a broken audit)."""
  return run_configs.small_config(
    **{
      'num_steps': 12,
      'log_every_steps': 6,
      'eval_every_steps': 12,
      'checkpoint_every_steps': 6,
      'audit.num_canaries': 200,
      'privacy.noise_multiplier': 0.3,
      **overrides,
    }
  )


@pytest.fixture
def audited_run(shared_result):
  return shared_result('audited', lambda w: train.train_and_evaluate(audited_config(), str(w)))


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
    200, delta=1e-5, confidence=audit['audit_confidence']
  )
  rows = [json.loads(line) for line in open(workdir / 'metrics.jsonl')]
  assert rows[-1]['audit_epsilon_lower'] == audit['audit_epsilon_lower']
  # The audit recomputed without dpjax's auditing code (see the test below).
  assert audit['audit_epsilon_lower'] > 0
  # The CLI recomputes the same audit from what the run saved.
  capsys.readouterr()
  assert audit_cli.main(['--workdir', str(workdir), '--json']) == 0
  out = json.loads(capsys.readouterr().out)
  assert out['audit_epsilon_lower'] == pytest.approx(audit['audit_epsilon_lower'])
  assert out['num_canaries'] == 200 and out['epsilon'] == meta['privacy']['epsilon']


def _independent_epsilon_lower(m: int, r: int, v: int, delta: float, level: float) -> float:
  """Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1) Training Run",
  Theorem 3.1: under (ε, δ)-DP, Pr[W ≥ v] ≤ f(v) + 2mδ·max_{i=1..v} (f(v − i) − f(v))/i with
  f(w) = Pr[Binomial(r, e^ε/(1 + e^ε)) ≥ w]; the largest ε rejected at level `level`."""

  def p_value(epsilon):
    p = math.exp(epsilon) / (1 + math.exp(epsilon))
    f = lambda w: stats.binom.sf(w - 1, r, p)
    i = np.arange(1, v + 1)
    return f(v) + 2 * m * delta * np.max((f(v - i) - f(v)) / i)

  if p_value(0.0) > level:
    return 0.0
  return optimize.brentq(lambda e: p_value(e) - level, 0.0, 30.0, xtol=1e-9)


def test_the_audit_recomputed_from_the_checkpoint_and_the_coins(audited_run):
  """The run's audit from what it saved, without `one_run`: scores −⟨θ_T − θ_0, u_j⟩ read at
  the canaries' coordinates, the top and bottom k guessed (k from the fixed list, each tested
  at β/L), the bound from Steinke et al.'s p-value with scipy. The test this completes only
  asserted ε_lower ≤ ε and ≤ the largest bound 200 canaries allow, which an audit returning 0
  meets (it did: ε_lower = 0 at σ = 1; planted: scores of the wrong sign in
  `audit_record.final_params_scores`, ε_lower 0.096 → 0, passed it)."""
  workdir, _ = audited_run
  meta = checkpoints.read_metadata(str(workdir))[-1]
  record = json.loads((workdir / 'audit.json').read_text())
  canaries = canaries_lib.CanarySet.from_dict(record['canaries'])
  membership = np.asarray(record['canaries']['membership'], bool)
  assert record['score'] == 'final_params' and 60 < membership.sum() < 140  # Fair coins.
  params = checkpoints.read_state(str(workdir), meta['step'])['params']
  flat = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(params)])
  assert flat.size == canaries.num_params == 4810
  scores = -(canaries.signs * flat[canaries.coordinates] - np.asarray(record['initial_projection']))
  order = np.argsort(scores)
  m, delta, confidence = 200, meta['privacy']['delta'], record['confidence']
  ks = [k for k in one_run.guess_counts(m) if 2 * k <= m]
  rows = []
  for k in ks:
    correct = int(membership[order[-k:]].sum() + (~membership[order[:k]]).sum())
    rows.append(
      (
        _independent_epsilon_lower(m, 2 * k, correct, delta, (1 - confidence) / len(ks)),
        2 * k,
        correct,
      )
    )
  best, guesses, correct = max(rows)
  audit = meta['audit']
  assert (audit['audit_num_guesses'], audit['audit_num_correct']) == (guesses, correct)
  assert audit['audit_epsilon_lower'] == pytest.approx(best, abs=1e-5)
  assert 0 < best < meta['privacy']['epsilon']


def test_changing_the_canaries_on_resume_is_refused(audited_run, tmp_path):
  workdir, _ = audited_run
  copy = tmp_path / 'copy'
  shutil.copytree(workdir, copy)
  with pytest.raises(ValueError, match='audit.num_canaries: 200 → 100'):
    train.train_and_evaluate(audited_config(**{'audit.num_canaries': 100}), str(copy))
