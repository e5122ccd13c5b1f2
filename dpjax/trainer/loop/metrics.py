"""Metrics of a run: `metrics.jsonl` (one JSON object per logged step) and TensorBoard events.

A run can be killed at any moment (SIGKILL, preemption) and resumed from its
latest checkpoint at step s; the loop then recomputes every step after s. So
that each logged step appears exactly once:

* on resume from step s, rows with step > s are dropped (they are logged
  again); with no checkpoint at all (`resume_step=None`) every row is dropped,
  since the run restarts at step 0. The file is rewritten atomically (tmp +
  fsync + rename), so a kill during the rewrite loses nothing;
* a torn line (a partial JSON object cut by the kill) is dropped with a warning;
* TensorBoard events are purged from step s + 1 on (`purge_step`), and
  `flush()`, which the loop calls at every checkpoint, makes the JSON lines
  and the events durable (fsync), so what a checkpoint covers is on disk
  with it. Events are written in the caller's thread (`event_file`).

`nonprivate_train_loss` is a mean over the steps since the previous logged
train row. After a resume from step s the first one covers only steps s+1..t,
since the losses of the steps between the last logged row and s were never
fetched: every such row states its window as `train_window_steps`.

Privacy: the values ε covers are listed in `COVERED` (evaluations of the
released parameters on the test split, ε itself, the audit); every other value
(training loss and accuracy, counts of non-finite or truncated examples,
rates and timings) is computed from the private data without noise and is
named `nonprivate_*` (TensorBoard section `nonprivate/`). `write` refuses any
other name. Publish the export (`dpjax.export`), not this file.

Only process 0 of a multi-host job writes (`enabled=False` elsewhere).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys

from dpjax.trainer.loop import event_file
from dpjax.trainer.workdir import write_errors
from dpjax.trainer.workdir.atomic_write import write_text_atomically

METRICS_FILE = 'metrics.jsonl'
TENSORBOARD_DIR = 'tensorboard'
# What ε covers: functions of the released parameters (evaluations on the test split, the
# audit), the privacy claim itself, and public counts. Every other value a run logs is a
# statistic of the private training data or of the run's timing and is named nonprivate_*
# (TensorBoard section nonprivate/). README "Metrics" has the table.
COVERED = (
  'step',
  'epsilon',
  'epsilon_bound',
  'eval_loss',
  'eval_accuracy',
  'eval_loss_ema',
  'eval_accuracy_ema',
  'audit_epsilon_lower',
  'audit_confidence',
  'train_window_steps',
)
NONPRIVATE = 'nonprivate_'
TRAIN_LOSS = NONPRIVATE + 'train_loss'


def check_names(scalars: dict) -> None:
  """ValueError for a name neither covered by ε nor labelled nonprivate_ (a programming error)."""
  bad = [k for k in scalars if k not in COVERED and not k.startswith(NONPRIVATE)]
  if bad:
    raise ValueError(
      f'metric names {bad} are neither covered by ε ({COVERED}) nor labelled {NONPRIVATE}*.'
    )


def tensorboard_tag(name: str) -> str:
  """nonprivate_x -> 'nonprivate/x' (its own section); covered names unchanged."""
  return 'nonprivate/' + name[len(NONPRIVATE) :] if name.startswith(NONPRIVATE) else name


def _warn(message: str) -> None:
  logging.warning(message)
  print(f'WARNING: {message}', file=sys.stderr)


def read_rows(path: str) -> list[dict]:
  """The rows of a `metrics.jsonl`; unparseable lines (a torn last line) dropped with a warning."""
  rows, torn = [], []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get('step'), int):
          raise ValueError('not an object with an integer "step"')
      except ValueError:
        torn.append(number)
        continue
      rows.append(row)
  if torn:
    _warn(
      f'{path}: dropped {len(torn)} unreadable line(s) (line {", ".join(map(str, torn))}; '
      'a torn write from a killed run); those steps are logged again if they are recomputed.'
    )
  return rows


class MetricWriter:
  """Scalars to TensorBoard event files and to `metrics.jsonl`, consistent across resumes.

  A failed write (a full disk) raises `write_errors.WriteError` (one line) and cuts both
  files back to what the latest `flush` made durable: nothing partial is left, and what is
  cut is logged again by the resume from the latest checkpoint.

  Args:
    workdir: the run's directory.
    resume_step: the step of the checkpoint the run resumes from, or None
      when it starts from scratch (rows and events after it are dropped).
    enabled: False on every process but the first of a multi-host job.
  """

  def __init__(self, workdir: str, resume_step: int | None, enabled: bool = True):
    self.enabled = enabled
    self.resume_step = resume_step
    self._closed = not enabled
    if not enabled:
      return
    if resume_step is not None and (
      isinstance(resume_step, bool) or not isinstance(resume_step, int) or resume_step < 0
    ):
      raise ValueError(f'resume_step must be None or an integer >= 0, got {resume_step!r}.')
    keep_until = -1 if resume_step is None else resume_step
    self._path = os.path.join(workdir, METRICS_FILE)
    kept = []
    if os.path.exists(self._path):
      kept = [row for row in read_rows(self._path) if row['step'] <= keep_until]
      write_text_atomically(
        self._path, ''.join(json.dumps(row) + '\n' for row in kept), what='the metrics'
      )
    # The window of the next train_loss starts after the last logged one or the resume step.
    self._last_train_step = max(
      [0, keep_until] + [row['step'] for row in kept if TRAIN_LOSS in row]
    )
    self._jsonl = self._tb = None
    self._durable: dict[str, int] = {}  # Path -> its size at the latest flush.
    tb_dir = os.path.join(workdir, TENSORBOARD_DIR)
    with self._writing(tb_dir):
      self._jsonl = open(self._path, 'a')
      self._durable[self._path] = self._jsonl.tell()
      self._tb = event_file.EventFile(tb_dir, purge_step=keep_until + 1)
      self._durable[self._tb.path] = 0  # A new file: removed if even its header fails.
      self._tb.flush()
      self._durable[self._tb.path] = os.path.getsize(self._tb.path)

  @contextlib.contextmanager
  def _writing(self, path: str):
    """A write of the metrics: on OSError, both files are cut back to their durable size and
    closed, and `WriteError` is raised (one line)."""
    try:
      with write_errors.writing('the metrics', path):
        yield
    except write_errors.WriteError:
      self._closed = True
      for handle in (self._jsonl, self._tb):
        with contextlib.suppress(OSError):  # Closing flushes what cannot be written.
          if handle is not None:
            handle.close()
      for written, size in self._durable.items():
        write_errors.truncate_quietly(written, size)
        if not size:
          with contextlib.suppress(OSError):
            os.remove(written)
      raise

  def train_window(self, step: int) -> dict[str, int]:
    """What a `train_loss` logged at `step` averages: steps `step - n + 1 .. step`, n returned."""
    return {'train_window_steps': step - self._last_train_step}

  def write(self, step: int, scalars: dict[str, float]) -> None:
    """One row; rows with `nonprivate_train_loss` get `train_window_steps` unless set."""
    if self._closed:
      return
    scalars = dict(scalars)
    check_names(scalars)
    if TRAIN_LOSS in scalars:
      scalars.setdefault('train_window_steps', self.train_window(step)['train_window_steps'])
      self._last_train_step = step
    with self._writing(self._path):
      for name, value in scalars.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # Labels: jsonl only.
          self._tb.scalar(tensorboard_tag(name), value, step)
      self._jsonl.write(json.dumps({'step': step, **scalars}) + '\n')
      self._jsonl.flush()

  def flush(self) -> None:
    """Makes every row and event written so far durable (call at each checkpoint)."""
    if self._closed:
      return
    with self._writing(self._path):
      self._jsonl.flush()
      os.fsync(self._jsonl.fileno())
      self._tb.flush()
    self._durable = {path: os.path.getsize(path) for path in self._durable}

  def close(self) -> None:
    """Flushes, then closes both files (a no-op once closed or after a failed write)."""
    if self._closed:
      return
    self.flush()
    self._closed = True
    self._jsonl.close()
    self._tb.close()
