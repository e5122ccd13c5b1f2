"""The audit record of a run (`<workdir>/audit.json`) and the audit of a finished run.

Contract (what a run writes, what `python -m dpjax.audit` reads):

* `<workdir>/checkpoints/<step>/`: the run's checkpoints (`dpjax.trainer.workdir.checkpoints`);
  the audit uses the newest one, its metadata (`privacy.epsilon`, `privacy.delta`,
  `privacy.bound`, `noise_multiplier`, `clip_norm`) and its `state['params']`.
* `<workdir>/audit.json`: {"version": 1, "canaries": CanarySet.to_dict() (kind,
  num_canaries, seed, num_params, gradient_scale, membership), "confidence",
  "score": "white_box_steps" | "final_params", "initial_projection": ⟨θ_0, u_j⟩
  (final_params only)}.
* `<workdir>/audit_steps.npz` (score = white_box_steps): arrays `released`,
  `ordinary`, `counts` [T, m] as `audited_sgd.AuditedRun` records them.

Scores: with per-step records, Σ_t ⟨s_t − c_t, u_j⟩ / C (white-box, see
`audited_sgd`); from the final parameters only, −⟨θ_T − θ_0, u_j⟩ (gradient
descent moves θ against the summed gradients, so a member canary pushes its
coordinate by −η·C/b per inclusion; exact for SGD, a valid but weaker score
for other optimisers, since drift of the real training also moves the coordinate).
"""

from __future__ import annotations

import contextlib
import json
import math
import os

import numpy as np

from dpjax.trainer.workdir import checkpoints
from dpjax.trainer.workdir import write_errors
from dpjax.trainer.workdir.atomic_write import write_text_atomically
from dpjax.privacy.auditing import audited_sgd
from dpjax.privacy.auditing import canaries as canaries_lib
from dpjax.privacy.auditing import gradient_canary
from dpjax.privacy.auditing import one_run
from dpjax.privacy.auditing import white_box

AUDIT_FILE = 'audit.json'
STEPS_FILE = 'audit_steps.npz'
SCORES = ('white_box_steps', 'final_params')


def write_record(
  workdir: str,
  canaries: canaries_lib.CanarySet,
  *,
  confidence: float,
  records: dict[str, np.ndarray] | None = None,
  initial_params=None,
) -> str:
  """Writes audit.json (and audit_steps.npz with per-step records); returns its path.

  Give `records` (white-box per-step projections) or `initial_params` (θ_0, for
  scores from the final parameters).
  """
  if (records is None) == (initial_params is None):
    raise ValueError(
      'give exactly one of records (per-step) or initial_params (final-model score).'
    )
  record = {'version': 1, 'canaries': canaries.to_dict(), 'confidence': confidence}
  if records is not None:
    steps = os.path.join(workdir, STEPS_FILE)
    with write_errors.writing('the audit record', steps):
      os.makedirs(workdir, exist_ok=True)
      try:
        np.savez(steps, **records)
      except OSError:
        with contextlib.suppress(OSError):
          os.remove(steps)  # Nothing partial.
        raise
    record['score'] = 'white_box_steps'
  else:
    record['score'] = 'final_params'
    record['initial_projection'] = gradient_canary.project(initial_params, canaries).tolist()
  path = os.path.join(workdir, AUDIT_FILE)
  with write_errors.writing('the audit record', workdir):
    os.makedirs(workdir, exist_ok=True)
  write_text_atomically(path, json.dumps(record), what='the audit record')
  return path


def final_params_scores(canaries: canaries_lib.CanarySet, initial_projection, params) -> np.ndarray:
  """−⟨θ_T − θ_0, u_j⟩: a member canary moves its coordinate against u_j by η·C/b per inclusion."""
  return -(gradient_canary.project(params, canaries) - np.asarray(initial_projection, np.float64))


def audit_params(
  canaries: canaries_lib.CanarySet, initial_projection, params, *, delta: float, confidence: float
) -> dict:
  """The metrics/metadata fields of a trainer's audit at a checkpoint (scores from θ only)."""
  audit = one_run.audit(
    final_params_scores(canaries, initial_projection, params),
    canaries.membership,
    delta=delta,
    confidence=confidence,
  )
  return {
    'audit_epsilon_lower': audit.epsilon_lower,
    'audit_confidence': confidence,
    'audit_num_canaries': canaries.num_canaries,
    'audit_num_guesses': audit.num_guesses,
    'audit_num_correct': audit.num_correct,
  }


def save_run(
  workdir: str, run: audited_sgd.AuditedRun, privacy: dict, step: int, *, confidence: float
) -> None:
  """Lays out an `audited_sgd` run like a training workdir: checkpoint, metadata, audit record."""
  manager = checkpoints.make_manager(workdir, keep=1)
  checkpoints.save(
    manager,
    step,
    {'step': np.int32(step), 'params': run.params},
    {
      'step': step,
      'privacy': privacy,
      'noise_multiplier': run.noise_multiplier or None,
      'clip_norm': run.clip_norm,
      'num_examples': run.num_examples,
    },
  )
  manager.wait_until_finished()
  manager.close()
  write_record(workdir, run.canaries, confidence=confidence, records=run.records())


def audit_workdir(workdir: str) -> dict:
  """Recomputes the audit of a finished run from what it saved (see the module docstring)."""
  path = os.path.join(workdir, AUDIT_FILE)
  if not os.path.isfile(path):
    raise ValueError(
      f'--workdir {workdir}: no {AUDIT_FILE} (was the run trained with audit.num_canaries > 0?).'
    )
  with open(path) as f:
    record = json.load(f)
  if record.get('score') not in SCORES:
    raise ValueError(f'{path}: score = {record.get("score")!r}; valid: {SCORES}.')
  canaries = canaries_lib.CanarySet.from_dict(record['canaries'])
  rows = [r for r in checkpoints.read_metadata(workdir) if 'error' not in r]
  if not rows:
    raise ValueError(
      f'--workdir {workdir}: no readable checkpoint in {checkpoints.checkpoint_dir(workdir)}.'
    )
  meta = rows[-1]
  privacy = meta.get('privacy') or {}
  delta = privacy.get('delta') or 0.0
  confidence = float(record['confidence'])
  result = {
    'step': meta['step'],
    'epsilon': privacy.get('epsilon'),
    'delta': delta,
    'bound': privacy.get('bound'),
    'confidence': confidence,
    'num_canaries': canaries.num_canaries,
    'score': record['score'],
  }
  clip_norm = meta.get('clip_norm') or 1.0
  if record['score'] == 'white_box_steps':
    steps = np.load(os.path.join(workdir, STEPS_FILE))
    released, ordinary, counts = steps['released'], steps['ordinary'], steps['counts']
    if released.shape[1] != canaries.num_canaries:
      raise ValueError(
        f'{STEPS_FILE}: {released.shape[1]} canaries, audit.json has {canaries.num_canaries}.'
      )
    scores = np.sum(released - ordinary, axis=0) / clip_norm
    sigma = meta.get('noise_multiplier')
    if sigma:
      result['white_box'] = white_box.effective_sigma(
        released, ordinary, counts, canaries.membership, clip_norm=clip_norm, noise_multiplier=sigma
      ).to_dict()
  else:
    params = checkpoints.read_state(workdir, meta['step'])['params']
    scores = final_params_scores(canaries, record['initial_projection'], params)
  audit = one_run.audit(scores, canaries.membership, delta=delta, confidence=confidence)
  result.update(
    audit_epsilon_lower=audit.epsilon_lower,
    num_guesses=audit.num_guesses,
    num_correct=audit.num_correct,
    max_audit_epsilon_lower=one_run.max_epsilon_lower(
      canaries.num_canaries, delta=delta, confidence=confidence
    ),
  )
  eps = result['epsilon']
  result['refutes_claim'] = eps is not None and math.isfinite(eps) and audit.epsilon_lower > eps
  return result
