"""The training loop: compiled calls of S logical steps, then the periodic actions that are due.

`Loop` runs calls of S logical steps (`dpjax.privacy.multi_step`) over chunks of
logical batches (`chunks`) and after each call fires the periodic actions that
are due by `is_time`: log, eval, audit and checkpoint (all at the last step; a
signal saves at once). Every checkpoint stores the ε of its step and the plan's
privacy fingerprint (`privacy_metadata`). The loop receives what computes and writes
(the step, the chunks, the evaluation, the writer, the checkpointer, the accountant and
the clock: `loop_parts`), so its logic runs with fakes in tests/trainer/test_loop_logic.py;
`dpjax.trainer.loop.training.run` builds the real ones from a plan and runs it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import flax
import jax
import numpy as np

from dpjax.privacy import ema as ema_lib
from dpjax.privacy import multi_step
from dpjax.privacy.accounting import ahead as ahead_lib
from dpjax.trainer.loop import build
from dpjax.trainer.loop import chrono as chrono_lib
from dpjax.trainer.loop import progress as progress_lib
from dpjax.trainer.commands import interrupts
from dpjax.trainer.loop import loop_parts
from dpjax.trainer.planning import run_warnings
from dpjax.trainer.workdir import write_errors
from dpjax.trainer.loop.stops import RunInterrupted
from dpjax.trainer.loop.stops import TrainingDiverged


@flax.struct.dataclass
class TrainState:
  """Everything a resume needs: sampler and noise are pure functions of (seed, step).

  In the loop `step` and `num_truncated` are host ints; a checkpoint holds them
  as replicated int32 arrays (`loop_parts.PlanCheckpointer.stored`).
  """

  step: Any
  params: Any  # The trainable parameters (all of them unless fine-tuning freezes some).
  opt_state: Any
  num_truncated: Any  # Steps whose logical batch exceeded B (the accountant pays).
  ema: ema_lib.EmaState  # EMA of params (= params when ema_decay = 0): post-processing.


def is_time(step: int, every: int, last_step: int) -> bool:
  """Whether a periodic action fires after `step` (1-based count); always at the last."""
  return step == last_step or (every > 0 and step % every == 0)


class Loop:
  """The loop of one run: compiled calls, then the periodic actions that are due.

  Given its collaborators (`loop_parts`: the step, the chunks, the evaluation, the writer,
  the checkpointer, the accountant and the clock), it owns the progress bar, the `Chrono`,
  the signal handler and ε computed ahead on a thread. Each action is one method: `_log`
  (training statistics of the window and ε), `_eval`, `_audit` and `_save`; `_due` says
  when it fires. A logged step writes one row with all of them; an eval or audit without a
  log writes its own row.
  """

  def __init__(
    self,
    settings: loop_parts.LoopSettings,
    steps: loop_parts.StepRunner,
    chunks: loop_parts.ChunkStream,
    evaluate: loop_parts.Evaluate,
    writer: loop_parts.Writer,
    checkpointer: loop_parts.Checkpointer,
    accountant: loop_parts.Epsilons | None,
    auditor: build.Auditor | None = None,
    *,
    clock: Callable[[], float] = time.time,
    log=print,
  ):
    self.settings, self.steps, self.chunks, self.evaluate = settings, steps, chunks, evaluate
    self.writer, self.checkpointer, self.accountant = writer, checkpointer, accountant
    self.auditor, self.clock, self.log = auditor, clock, log
    self.primary, self.serial = settings.primary, settings.serial
    self.ema_decay = settings.ema_decay
    self.every = {
      'log': settings.log_every,
      'eval': settings.eval_every,
      'checkpoint': settings.checkpoint_every,
    }
    self.warnings = run_warnings.RunWarnings()
    self.progress = self.chrono = self.pacer = self.signals = self.ahead = None
    self.last: dict[str, Any] = {}  # The latest log row (or the step-0 evaluation).
    self._pending = []  # Metrics of the calls since the latest log, on the device.
    self._window_start = 0  # The first step of the current log window.
    self._saved_step = 0  # The step of the latest checkpoint (or the restart).

  def _due(self, action: str, step: int) -> bool:
    """Whether `action` ('log', 'eval' or 'checkpoint') fires after `step`."""
    return is_time(step, self.every[action], self.settings.num_steps)

  def run(self, state: TrainState) -> TrainState:
    """Trains from `state` to the plan's last step; returns the final state."""
    self._saved_step = state.step
    with interrupts.GracefulStop() as self.signals:
      try:
        if state.step == 0:  # Compiles the evaluation: a signal is handled at once.
          self.last = self._interruptible(lambda: self.evaluate(state), state)
          self.writer.write(0, self.last)
        return self._train(state)
      except write_errors.WriteError:  # A full disk: the save in flight ends, one line.
        self._close(after_failed_write=True)
        raise

  def _train(self, state: TrainState) -> TrainState:
    start, last_step = state.step, self.settings.num_steps
    self.progress = progress_lib.Progress(last_step, start, self.primary)
    self.chrono = chrono_lib.Chrono(self.clock)
    self._window_start = start + 1
    size = self.steps.size  # S logical steps a call; calls end where the host needs θ.
    # Automatic S: a call lasts ~0.5 s at most, so a signal stops a slow run within ~2 steps.
    self.pacer = multi_step.CallPacer(size, adaptive=self.settings.steps_per_call == 0 and size > 1)
    calls = multi_step.schedule(
      start, last_step, size, tuple(self.every.values()), limit=self.pacer.limit
    )
    stream = self.chunks(calls)
    # ε of the logged and saved steps, computed ahead while the device trains.
    self.ahead = (
      None
      if self.accountant is None
      else ahead_lib.EpsilonAhead(
        self.accountant,
        ()
        if self.serial
        else (
          s
          for s in range(start + 1, last_step + 1)
          if self._due('log', s) or self._due('checkpoint', s)
        ),
      )
    )
    with stream as prepared, contextlib.nullcontext() if self.ahead is None else self.ahead:
      chunks = iter(prepared)
      upcoming = next(chunks, None)
      while upcoming is not None:
        chunk = upcoming[1]
        state = self._dispatch(state, chunk)
        upcoming = next(chunks, None)  # The next call's buffers, made while this one runs.
        self._count(state, chunk)
        self._periodic(state)
    self._close()
    return state

  def _interruptible(self, fn: Callable[[], Any], state: TrainState) -> Any:
    """fn() (it may compile for minutes) with signals handled at once: RunInterrupted
    (`abandoned`) if a signal leaves it unfinished; `state` saved if it holds unsaved steps."""
    try:
      return self.signals.run(fn)
    except interrupts.StillRunning:
      saved = state.step > self._saved_step
      if saved:
        self._save(state, None)
      kept = (
        f'checkpoint {state.step} saved'
        if saved
        else f'nothing was trained since {f"checkpoint {state.step}" if state.step else "the start"}'
      )
      raise self._stop(
        RunInterrupted(
          f'stopped by {self.signals.signal_name} at step {state.step} of '
          f'{self.settings.num_steps} while XLA compiled or ran a call (it cannot be '
          f'interrupted); {kept}. Rerun the same command to resume.',
          self.signals.exit_code,
          abandoned=True,
        )
      ) from None

  def _dispatch(self, state: TrainState, chunk: multi_step.Chunk) -> TrainState:
    """One compiled call: S logical steps (K physical batches each, noise keyed by
    (seed, step), the update and the EMA). The first call of a (re)start compiles."""
    self.chrono.dispatch()
    call = lambda: self.steps(
      state.params, state.opt_state, state.ema if self.ema_decay else None, chunk
    )
    params, opt_state, ema, metrics = (
      self._interruptible(call, state) if self.chrono.compile_seconds is None else call()
    )
    self.signals.progress = chunk.last_step + 1  # Read by the signal handler.
    self.pacer.dispatched(metrics)  # At most two calls in flight: a signal waits for few steps.
    if self.serial:
      jax.block_until_ready(params)
    self._pending.append((metrics, chunk.count))
    return state.replace(
      step=chunk.last_step + 1,
      params=params,
      opt_state=opt_state,
      ema=ema if self.ema_decay else state.ema,
      num_truncated=state.num_truncated + sum(int(b.truncated) for b in chunk.logicals),
    )

  def _count(self, state: TrainState, chunk: multi_step.Chunk) -> None:
    """Progress and timing of a call: compilation apart, then the window's steps and rows."""
    self.progress.update(int(chunk.count))
    if self.chrono.compile_seconds is None:  # One sync: the first call, compilation included.
      jax.block_until_ready(state.params)
      self.chrono.compiled()
      if self.steps.clipping_choice:  # Known once the step is traced: one line per layer.
        self.log('Clipping: ' + '\n  '.join(self.steps.clipping_choice))
      return
    if not self.pacer.observed:  # One more sync: how long a step takes, after compilation.
      jax.block_until_ready(state.params)
      self.pacer.observe(int(chunk.count), self.chrono.since_dispatch())
    self.chrono.count(
      int(chunk.count), sum(min(b.size, self.settings.max_batch_size) for b in chunk.logicals)
    )

  def _periodic(self, state: TrainState) -> None:
    """The actions due after the call that ended at `state.step`, in order."""
    done, last_step = state.step, self.settings.num_steps
    stopping = self.signals.requested  # A signal: save this step, then exit 128 + signal.
    logging_now = self._due('log', done)
    saving_now = stopping or self._due('checkpoint', done)
    # One host sync per logged or saved step.
    fetched = self._fetch(state) if logging_now or saving_now else None
    audit = self._audit(state) if saving_now else None
    row = self._log(state, *fetched, wait=saving_now) if logging_now else None
    evaluated = self._eval(state) if self._due('eval', done) else None
    audit_row = (
      None if audit is None else {k: audit[k] for k in ('audit_epsilon_lower', 'audit_confidence')}
    )
    if row is not None:
      row.update(evaluated or {})
      if self.chrono.checkpoint_seconds is not None:  # The latest save's (outside the rates).
        row['nonprivate_checkpoint_seconds'] = self.chrono.checkpoint_seconds
      row.update(audit_row or {})  # Beside ε: an empirical lower bound, with its confidence.
      self.writer.write(done, row)
      query_seconds = 0.0 if self.ahead is None else self.ahead.mean_query_seconds
      self.progress.show(done, row, self.every['checkpoint'], query_seconds)
      self.last = row
    else:
      for part in (audit_row, evaluated):
        if part is not None:
          self.writer.write(done, part)
    if saving_now:
      self._save(state, audit)
    if logging_now:
      self.chrono.next_window()
    if stopping and done < last_step:
      raise self._stop(
        RunInterrupted(
          f'stopped by {self.signals.signal_name} after step {done} of {last_step} '
          f'({done - self.signals.progress_at_signal} steps dispatched after it arrived); '
          f'checkpoint {done} saved. Rerun the same command to resume.',
          self.signals.exit_code,
        )
      )

  def _fetch(self, state: TrainState) -> tuple[list[dict], float]:
    """(per-step metrics since the latest log, their mean loss), in one host sync;
    TrainingDiverged if the parameters diverged: post-processing of what DP-SGD releases.
    Never on a statistic of the data (the loss, the count of non-finite examples): that
    would make whether anything is released depend on one record (docs/threat_model.md)."""
    fetched, diverged = jax.device_get((self._pending, self.steps.diverged(state.params)))
    fetched = [row for m, count in fetched for row in multi_step.rows_of(m, count)]
    loss = float(np.mean([m['loss'] for m in fetched])) if fetched else 0.0
    if bool(diverged):
      raise self._stop(
        TrainingDiverged(
          f"non-finite parameters (or ‖θ‖ beyond float32's range) between steps "
          f'{self._window_start} and {state.step}; the '
          f'last checkpoint before step {self._window_start} is intact. Try a smaller '
          'optimizer.learning_rate or privacy.clip_norm.'
        )
      )
    return fetched, loss

  def _log(self, state: TrainState, fetched: list[dict], loss: float, wait: bool) -> dict:
    """The log row of the window: rates, statistics of the private data that ε does not
    cover (`nonprivate_*`, never exported) and ε (`wait`: even if not computed yet)."""
    done = state.step
    rate, elapsed = self.chrono.window_rate()
    if rate:
      self.pacer.observe(self.chrono.window_steps, elapsed)  # The steady-state step time.
    total = lambda name: sum(int(m[name]) for m in fetched)
    examples = sum(float(m['num_examples']) for m in fetched)
    row = {
      'nonprivate_train_loss': loss,
      'nonprivate_train_accuracy': float(np.mean([m['accuracy'] for m in fetched])),
      'nonprivate_num_nonfinite_examples': total('num_nonfinite'),
      'nonprivate_num_truncated': state.num_truncated,
      'nonprivate_compile_seconds': self.chrono.compile_seconds,
      'nonprivate_steps_per_second': rate,
      'nonprivate_wall_seconds': self.chrono.wall_seconds(),
      'nonprivate_examples_per_second': self.chrono.window_examples / elapsed if rate else None,
      'nonprivate_clip_fraction': total('num_clipped') / max(1.0, examples),
      'nonprivate_mean_grad_norm': float(np.mean([m['example_grad_norm'] for m in fetched]))
      if self.settings.private
      else None,
    }
    for line in self.warnings.check(row, self._window_start, done, self.settings.clip_norm):
      self.log(f'WARNING: {line}')
    self._pending, self._window_start = [], done + 1
    report = self._epsilon(done, wait=wait or self.serial)
    if report is not None:
      row.update(epsilon=report.epsilon, epsilon_bound=report.bound)
    return row

  def _epsilon(self, step: int, *, wait: bool, estimates: bool = False):
    """The accountant's report for `step`; without `wait`, only if already computed (else
    None, as for a non-private run). `estimates`: with the side estimates."""
    if self.ahead is None:
      return None
    return (
      self.ahead.epsilon_at(step, estimates=estimates)
      if wait
      else self.ahead.epsilon_if_ready(step)
    )

  def _eval(self, state: TrainState) -> dict:
    """The evaluation of `state` and its seconds (queued steps finish before the clock)."""
    jax.block_until_ready(state.params)
    clock = self.clock()
    evaluated = self._interruptible(lambda: self.evaluate(state), state)  # May compile.
    evaluated['nonprivate_eval_seconds'] = self.chrono.pause(clock)
    return evaluated

  def _audit(self, state: TrainState) -> dict | None:
    """The audit at a saved `state` when due: at every checkpoint with
    `audit.every_checkpoint`, else at the last step; None without canaries."""
    if self.auditor is None or not (
      self.auditor.every_checkpoint or state.step == self.settings.num_steps
    ):
      return None
    return self.auditor(state.params)

  def _save(self, state: TrainState, audit: dict | None) -> None:
    """A checkpoint of `state` with the ε of its step (side estimates at the last step
    only) and the audit; metrics and events made durable with it."""
    jax.block_until_ready(state.params)
    clock = self.clock()
    done = state.step
    report = self._epsilon(done, wait=True, estimates=done == self.settings.num_steps)
    self.checkpointer.save(state, report, audit)
    self._saved_step = done
    self.writer.flush()
    self.chrono.checkpoint_seconds = self.chrono.pause(clock)

  def _close(self, after_failed_write: bool = False) -> None:
    """Leaves the workdir consistent: earlier saves complete, metrics and events flushed
    (`after_failed_write`: a write failed already; later failures are not raised again)."""
    if self.progress is not None:
      self.progress.close()
    for finish in (self.checkpointer.wait_until_finished, self.writer.close):
      with (
        contextlib.suppress(write_errors.WriteError)
        if after_failed_write
        else contextlib.nullcontext()
      ):
        finish()

  def _stop(self, error: Exception) -> Exception:
    """Closes (`_close`) and returns `error`, to be raised."""
    self._close()
    return error

  def compilations(self) -> dict[str, int]:
    """The programs the loop compiled, by name (those compiled at least once)."""
    return self.steps.compilations()
