"""The training loop's logic with a fake step: no model, no XLA compilation, milliseconds a test.

`Loop` receives its step, chunks, evaluation, writer, checkpointer, accountant and clock
(`dpjax.trainer.loop.loop_parts`). Here the step is numpy (θ ← θ + 1 at each logical step, the
loss of step t is t), the checkpointer keeps states in memory, the accountant's ε(t) =
1 + t/100 is distinct at every step and the clock advances only when a fake says so; the
writer is the real `MetricWriter` in a temporary workdir. So each periodic action, stop and
ε can be checked against a closed form. What only a whole training shows (the compiled step,
orbax, the CLI) stays in tests/e2e.
"""

import collections
import contextlib
import json
import os
import re
import signal
import threading

import numpy as np
import pytest

from dpjax.privacy import multi_step
from dpjax.privacy.accounting.report import PrivacyReport
from dpjax.trainer.loop import training_loop as loop_lib
from dpjax.trainer.loop import loop_parts
from dpjax.trainer.loop import metrics as metrics_lib
from dpjax.trainer.workdir import write_errors

Logical = collections.namedtuple('Logical', 'size truncated')
BATCH = 4  # Examples in every fake logical batch.
STEP_SECONDS, COMPILE_SECONDS, EVAL_SECONDS, SAVE_SECONDS = 0.25, 10.0, 3.0, 2.0


class Clock:
  """Seconds that pass only when a fake step, evaluation or save says so."""

  def __init__(self):
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


class FakeSteps:
  """`StepRunner` in numpy: θ ← θ + 1 a step (NaN at step `nan_at`); step t's loss is t
  (`loss_nan_at`: NaN there); the first call 'compiles' for COMPILE_SECONDS."""

  def __init__(self, size: int, clock: Clock, nan_at=None, loss_nan_at=None, on_step=None):
    self.size, self.clock, self.nan_at, self.loss_nan_at = size, clock, nan_at, loss_nan_at
    self.on_step = on_step or (lambda t: None)
    self.calls: list[tuple[int, int]] = []
    self.clipping_choice: list[str] = []

  def __call__(self, params, opt_state, ema, chunk):
    self.clock.now += 0 if self.calls else COMPILE_SECONDS
    self.calls.append((chunk.first_step, int(chunk.count)))
    metrics = {
      k: np.zeros(self.size, np.float32)
      for k in (
        'loss',
        'accuracy',
        'num_nonfinite',
        'num_examples',
        'num_clipped',
        'example_grad_norm',
      )
    }
    w = np.array(params['w'])
    for j in range(int(chunk.count)):
      t = chunk.first_step + j
      self.on_step(t)
      w = w + 1 if t != self.nan_at else w * np.nan
      metrics['loss'][j] = np.nan if t == self.loss_nan_at else t
      metrics['num_nonfinite'][j] = t == self.loss_nan_at
      metrics['num_examples'][j] = metrics['num_clipped'][j] = BATCH
      metrics['accuracy'][j], metrics['example_grad_norm'][j] = 0.5, 2.0
      self.clock.now += STEP_SECONDS
    return {'w': w}, opt_state, ema, metrics

  def diverged(self, params) -> bool:
    return not np.all(np.isfinite(params['w']))

  def compilations(self) -> dict[str, int]:
    return {'train_steps': 1}


def fake_chunks(size: int):
  """`ChunkStream` of logical batches of BATCH examples; every 3rd step (t % 3 == 2) is one
  whose batch the cap truncated."""

  def chunk(call):
    first, count = call
    steps = np.zeros(size, np.uint32)
    steps[:count] = np.arange(first, first + count)
    logicals = [Logical(BATCH, t % 3 == 2) for t in range(first, first + count)]
    return multi_step.Chunk(first, logicals, {}, np.zeros(size, np.int32), steps, np.int32(count))

  return lambda calls: contextlib.nullcontext((call, chunk(call)) for call in calls)


class MemoryCheckpoints:
  """`Checkpointer` in memory: {step: (state, report, audit)}; a save takes SAVE_SECONDS."""

  def __init__(self, clock: Clock):
    self.clock, self.saved, self.waited = clock, {}, 0

  def save(self, state, report, audit):
    self.clock.now += SAVE_SECONDS
    self.saved[state.step] = (state, report, audit)

  def wait_until_finished(self):
    self.waited += 1


def epsilon_of(step: int) -> float:
  return 1.0 + step / 100


class FakeAccountant:
  """ε(t) = 1 + t/100; records (step, estimates, thread name) of every query."""

  def __init__(self):
    self.queries = []

  def epsilon_at(self, step, *, estimates=True):
    self.queries.append((step, estimates, threading.current_thread().name))
    return PrivacyReport(
      epsilon=epsilon_of(step),
      delta=1e-5,
      bound='upper',
      accountant='fake',
      sampler='poisson',
      noise_multiplier=1.0,
      steps=step,
      steps_per_epoch=10,
    )


class Run:
  """One loop over the fakes, in `workdir`; `.train(state)` runs it."""

  def __init__(
    self,
    workdir,
    *,
    num_steps,
    log=0,
    evaluation=0,
    checkpoint=0,
    size=1,
    steps_per_call=None,
    restored_step=None,
    private=True,
    serial=False,
    checkpoints=None,
    auditor=None,
    writer=metrics_lib.MetricWriter,
    **step_options,
  ):
    self.clock = Clock()
    self.steps = FakeSteps(size, self.clock, **step_options)
    self.checkpoints = checkpoints or MemoryCheckpoints(self.clock)
    self.checkpoints.clock = self.clock
    self.accountant = FakeAccountant() if private else None
    self.evaluated = []
    self.workdir = str(workdir)
    os.makedirs(self.workdir, exist_ok=True)
    settings = loop_parts.LoopSettings(
      num_steps=num_steps,
      log_every=log,
      eval_every=evaluation,
      checkpoint_every=checkpoint,
      steps_per_call=size if steps_per_call is None else steps_per_call,
      max_batch_size=BATCH,
      clip_norm=1.0 if private else None,
      private=private,
      serial=serial,
    )
    self.loop = loop_lib.Loop(
      settings,
      self.steps,
      fake_chunks(size),
      self.evaluate,
      writer(self.workdir, restored_step),
      self.checkpoints,
      self.accountant,
      auditor,
      clock=self.clock,
      log=lambda *args: None,
    )

  def evaluate(self, state) -> dict:
    self.evaluated.append(state.step)
    self.clock.now += EVAL_SECONDS
    return {'eval_loss': float(state.params['w'][0]), 'eval_accuracy': 0.5}

  def train(self, state=None):
    return self.loop.run(
      state
      or loop_lib.TrainState(
        step=0, params={'w': np.zeros(2, np.float32)}, opt_state=(), num_truncated=0, ema=None
      )
    )

  def rows(self) -> list[dict]:
    with open(os.path.join(self.workdir, metrics_lib.METRICS_FILE)) as f:
      return [json.loads(line) for line in f]


def test_eval_checkpoint_and_log_fire_every_k_steps_and_at_the_last(tmp_path):
  run = Run(tmp_path, num_steps=10, log=3, evaluation=4, checkpoint=5)
  state = run.train()
  assert state.step == 10 and state.params['w'].tolist() == [10.0, 10.0]
  assert run.steps.calls == [(t, 1) for t in range(10)]  # Each step dispatched once.
  assert run.evaluated == [0, 4, 8, 10]
  assert sorted(run.checkpoints.saved) == [5, 10]
  assert run.checkpoints.saved[5][0].params['w'].tolist() == [5.0, 5.0]
  assert state.num_truncated == 3  # Steps 2, 5 and 8.
  rows = run.rows()
  assert [(r['step'], 'nonprivate_train_loss' in r, 'eval_loss' in r) for r in rows] == [
    (0, False, True),
    (3, True, False),
    (4, False, True),
    (6, True, False),
    (8, False, True),
    (9, True, False),
    (10, True, True),
  ]
  # A row's train loss is the mean over its window: steps t = 0..2 (loss t) → 1.0, ...
  trained = [r for r in rows if 'nonprivate_train_loss' in r]
  assert [(r['nonprivate_train_loss'], r['train_window_steps']) for r in trained] == [
    (1.0, 3),
    (4.0, 3),
    (7.0, 3),
    (9.0, 1),
  ]
  assert [r['eval_loss'] for r in rows if 'eval_loss' in r] == [0.0, 4.0, 8.0, 10.0]
  assert all(r['nonprivate_clip_fraction'] == 1.0 for r in trained)
  assert run.checkpoints.waited >= 1  # The save in flight finished before the loop returned.


def test_calls_of_s_steps_end_at_the_periodic_boundaries(tmp_path):
  """S = 4, logs every 5, checkpoints every 6, 13 steps: the first step alone (compilation is
  timed apart), then calls of at most 4 steps that end wherever the host needs θ."""
  run = Run(tmp_path, num_steps=13, log=5, checkpoint=6, size=4)
  run.train()
  assert run.steps.calls == [(0, 1), (1, 4), (5, 1), (6, 4), (10, 2), (12, 1)]
  assert sorted(run.checkpoints.saved) == [6, 12, 13]
  assert [r['step'] for r in run.rows() if 'nonprivate_train_loss' in r] == [5, 10, 13]
  assert run.checkpoints.saved[13][0].params['w'].tolist() == [13.0, 13.0]


def test_automatic_s_paces_calls_to_half_a_second_of_the_clock(tmp_path):
  """steps_per_call = 0 and S = 16: one step a call until a step after compilation is timed
  (0.25 s), then calls of 0.5 s / 0.25 s = 2 steps (`multi_step.CallPacer`); the call after
  the timed one was prepared while it ran, with the limit of then."""
  run = Run(tmp_path, num_steps=12, log=100, checkpoint=100, size=16, steps_per_call=0)
  run.train()
  assert run.steps.calls == [(0, 1), (1, 1), (2, 1), (3, 2), (5, 2), (7, 2), (9, 2), (11, 1)]


def test_rates_come_from_the_clock_with_compilation_evals_and_saves_apart(tmp_path):
  """Logs every 4, evals every 2 and saves every 3 of 9 steps: the windows (steps 2..4, 5..8
  and 9) hold evals and saves, whose seconds are left out of the rates."""
  run = Run(tmp_path, num_steps=9, log=4, evaluation=2, checkpoint=3)
  run.train()
  trained = [r for r in run.rows() if 'nonprivate_train_loss' in r]
  # The first call: COMPILE_SECONDS + one step, timed apart.
  assert trained[0]['nonprivate_compile_seconds'] == COMPILE_SECONDS + STEP_SECONDS
  assert [r['nonprivate_steps_per_second'] for r in trained] == [1 / STEP_SECONDS] * 3
  assert [r['nonprivate_examples_per_second'] for r in trained] == [BATCH / STEP_SECONDS] * 3
  assert [
    (r['step'], r['nonprivate_eval_seconds']) for r in run.rows() if 'eval_loss' in r and r['step']
  ] == [(s, EVAL_SECONDS) for s in (2, 4, 6, 8, 9)]
  assert [r['nonprivate_checkpoint_seconds'] for r in trained] == [SAVE_SECONDS] * 3


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_run_saves_the_step_reached_and_exits_128_plus_signal(tmp_path, signum):
  sent = lambda t: os.kill(os.getpid(), signum) if t == 6 else None
  before = signal.getsignal(signum)
  run = Run(tmp_path, num_steps=100, log=10, checkpoint=50, on_step=sent)
  with pytest.raises(loop_lib.RunInterrupted) as info:
    run.train()
  name = signal.Signals(signum).name
  assert info.value.exit_code == 128 + signum and not info.value.abandoned
  assert re.match(
    rf'stopped by {name} after step 7 of 100 \(1 steps dispatched after it arrived\); '
    r'checkpoint 7 saved',
    str(info.value),
  )
  assert run.steps.calls[-1] == (6, 1)  # Nothing dispatched after the step it arrived in.
  state, report, _ = run.checkpoints.saved[7]
  assert sorted(run.checkpoints.saved) == [7] and state.params['w'].tolist() == [7.0, 7.0]
  assert report.steps == 7 and report.epsilon == epsilon_of(7)
  assert [r['step'] for r in run.rows()] == [0]  # Closed: no row after the save.
  assert signal.getsignal(signum) is before  # The handler is given back.


def test_epsilon_of_each_row_and_checkpoint_is_the_accountants_for_that_step(tmp_path):
  run = Run(tmp_path, num_steps=12, log=2, checkpoint=6)
  run.train()
  rows = [r for r in run.rows() if 'nonprivate_train_loss' in r]
  assert [r['step'] for r in rows] == [2, 4, 6, 8, 10, 12]
  with_epsilon = [r for r in rows if 'epsilon' in r]
  assert {6, 12} <= {r['step'] for r in with_epsilon}  # A saved step waits for its ε.
  assert all(
    r['epsilon'] == epsilon_of(r['step']) and r['epsilon_bound'] == 'upper' for r in with_epsilon
  )
  reports = {step: saved[1] for step, saved in run.checkpoints.saved.items()}
  assert {step: (r.steps, r.epsilon) for step, r in reports.items()} == {
    6: (6, epsilon_of(6)),
    12: (12, epsilon_of(12)),
  }
  # Side estimates at the last step only; every query on the thread ahead, never the loop's.
  assert [(s, e) for s, e, _ in run.accountant.queries if e] == [(12, True)]
  assert all(thread.startswith('dpjax-epsilon') for _, _, thread in run.accountant.queries)
  assert max(s for s, _, _ in run.accountant.queries) == 12


def test_serial_dispatch_logs_epsilon_at_every_row_and_a_non_private_run_none(tmp_path):
  run = Run(tmp_path / 'serial', num_steps=6, log=2, checkpoint=6, serial=True)
  run.train()
  assert [(r['step'], r.get('epsilon')) for r in run.rows() if 'nonprivate_train_loss' in r] == [
    (s, epsilon_of(s)) for s in (2, 4, 6)
  ]
  plain = Run(tmp_path / 'plain', num_steps=4, log=2, checkpoint=2, private=False)
  plain.train()
  assert not [r for r in plain.rows() if 'epsilon' in r]
  assert [saved[1] for saved in plain.checkpoints.saved.values()] == [None, None]


def test_non_finite_parameters_stop_the_run_and_keep_the_last_finite_checkpoint(tmp_path):
  run = Run(tmp_path, num_steps=12, log=4, checkpoint=4, nan_at=5)
  with pytest.raises(
    loop_lib.TrainingDiverged,
    match=r'between steps 5 and 8; the last '
    r'checkpoint before step 5 is intact',
  ):
    run.train()
  assert sorted(run.checkpoints.saved) == [4]
  assert run.checkpoints.saved[4][0].params['w'].tolist() == [4.0, 4.0]
  assert [r['step'] for r in run.rows()] == [0, 4]  # Nothing logged from the diverged window.
  assert run.checkpoints.waited >= 1


def test_a_non_finite_loss_alone_does_not_change_what_is_released(tmp_path):
  """The attack: D, where one record's loss at step 5 is not finite, against D minus that
  record. Whether and which checkpoints are released may not depend on it
  (docs/threat_model.md): a loss is a statistic of the data without noise; only θ decides."""
  with_record = Run(tmp_path / 'with', num_steps=8, log=4, checkpoint=4, loss_nan_at=5)
  without = Run(tmp_path / 'without', num_steps=8, log=4, checkpoint=4)
  released = []
  for run in (with_record, without):
    assert run.train().step == 8
    released.append(
      {
        step: (saved[0].params['w'].tolist(), saved[1].epsilon)
        for step, saved in run.checkpoints.saved.items()
      }
    )
  assert (
    released[0] == released[1] == {4: ([4.0, 4.0], epsilon_of(4)), 8: ([8.0, 8.0], epsilon_of(8))}
  )
  counts = [
    [r.get('nonprivate_num_nonfinite_examples') for r in run.rows()]
    for run in (with_record, without)
  ]
  assert counts == [[None, 0, 1], [None, 0, 0]]  # The record was seen, and changed nothing.


def test_resume_continues_at_the_saved_step_and_ends_where_the_whole_run_ends(tmp_path):
  whole = Run(tmp_path / 'whole', num_steps=10, log=4, evaluation=4, checkpoint=3)
  final = whole.train()
  first = Run(
    tmp_path / 'resumed',
    num_steps=10,
    log=4,
    evaluation=4,
    checkpoint=3,
    on_step=lambda t: os.kill(os.getpid(), signal.SIGTERM) if t == 4 else None,
  )
  with pytest.raises(loop_lib.RunInterrupted):
    first.train()
  assert sorted(first.checkpoints.saved) == [3, 5]
  saved = first.checkpoints.saved[5][0]
  second = Run(
    tmp_path / 'resumed',
    num_steps=10,
    log=4,
    evaluation=4,
    checkpoint=3,
    restored_step=5,
    checkpoints=first.checkpoints,
  )
  resumed = second.train(saved)
  assert second.steps.calls[0] == (5, 1) and second.evaluated == [8, 10]  # No step-0 eval.
  assert resumed.step == final.step == 10
  assert resumed.params['w'].tolist() == final.params['w'].tolist()
  assert resumed.num_truncated == final.num_truncated == 3
  assert sorted(second.checkpoints.saved) == [3, 5, 6, 9, 10]
  key = lambda r: (r['step'], r.get('eval_loss'))  # Each step once, as in the whole run.
  assert [key(r) for r in second.rows()] == [key(r) for r in whole.rows()]
  assert second.checkpoints.saved[10][1].epsilon == whole.checkpoints.saved[10][1].epsilon
  # The first window after the resume covers steps 6..8 only, and says so.
  assert [r['train_window_steps'] for r in second.rows() if r['step'] == 8] == [3]


class FakeAuditor:
  """The one-run audit's interface: a bound read from θ, at every checkpoint or at the last."""

  def __init__(self, every_checkpoint: bool):
    self.every_checkpoint, self.at = every_checkpoint, []

  def __call__(self, params) -> dict:
    self.at.append(float(params['w'][0]))
    return {'audit_epsilon_lower': self.at[-1] / 100, 'audit_confidence': 0.95, 'canaries': 7}


@pytest.mark.parametrize('every_checkpoint,audited', [(False, [6.0]), (True, [3.0, 6.0])])
def test_the_audit_runs_at_the_checkpoints_it_is_asked_for(tmp_path, every_checkpoint, audited):
  auditor = FakeAuditor(every_checkpoint)
  run = Run(tmp_path, num_steps=6, log=2, checkpoint=3, auditor=auditor)
  run.train()
  assert auditor.at == audited
  assert {step: saved[2] is not None for step, saved in run.checkpoints.saved.items()} == {
    3: every_checkpoint,
    6: True,
  }
  # Beside ε: the bound and its confidence, in the step's row (its own row at step 3).
  assert [
    (r['step'], r['audit_epsilon_lower']) for r in run.rows() if 'audit_epsilon_lower' in r
  ] == [(s, s / 100) for s in audited]


class DiskFullAt6(metrics_lib.MetricWriter):
  def write(self, step, scalars):
    if step == 6:
      raise write_errors.WriteError('cannot write the metrics (metrics.jsonl): No space left.')
    super().write(step, scalars)


def test_a_failed_write_ends_the_run_after_the_save_in_flight(tmp_path):
  run = Run(tmp_path, num_steps=12, log=2, checkpoint=4, writer=DiskFullAt6)
  with pytest.raises(write_errors.WriteError, match='No space left'):
    run.train()
  assert run.steps.calls[-1] == (5, 1) and sorted(run.checkpoints.saved) == [4]
  assert run.checkpoints.waited >= 1  # The checkpoint in flight completed before the exit.
  assert [r['step'] for r in run.rows()] == [0, 2, 4]
