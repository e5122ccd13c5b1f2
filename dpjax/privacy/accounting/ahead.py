"""ε of the coming logged steps, computed ahead on one background thread.

The trainer logs ε every `log_every_steps`; each value is a PLD composition,
which in the training loop would stall the device queue at every log.
`EpsilonAhead` submits `accountant.epsilon_at(step)` for the next few steps
that will be asked for to a single worker thread while the device trains, so
the loop finds the report ready. The numbers are the accountant's own
(`epsilon_at` is memoised per step, a pure function of the step): identical
to calling it in the loop, only earlier. Every query goes through the one
worker, so the accountant is never used from two threads.

The thread shares the host with the loop (on a small CPU machine, with the
device's own threads): computations ahead of time keep it busy at most
`busy_fraction` of the wall time — after a query of d seconds the next one
ahead starts no sooner than d·(1 − f)/f later; a log row finds ε ready less
often, never wrong. A step asked for with `epsilon_at` (checkpoints, the last
step) is computed at once whatever the budget.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent import futures
import time

from dpjax.privacy.accounting.accountant import Accountant
from dpjax.privacy.accounting.report import PrivacyReport


class EpsilonAhead:
  """`epsilon_at(step, estimates)` answered from reports computed ahead of time.

  Args:
    accountant: the run's accountant.
    steps: the steps that will be asked for without estimates, in order
      (e.g. every logged or checkpointed step of the rest of the run).
    depth: how many reports ahead are kept at once (one is computed at a time).
    busy_fraction: f in (0, 1], the most of the wall time the thread spends on
      queries ahead of time.
  """

  def __init__(
    self, accountant: Accountant, steps: Iterable[int], depth: int = 2, busy_fraction: float = 0.1
  ):
    if not 0 < busy_fraction <= 1:
      raise ValueError(f'busy_fraction must be in (0, 1], got {busy_fraction!r}.')
    self._busy_fraction = busy_fraction
    self._next_start = 0.0  # time.monotonic() before which no query ahead is started.
    self._accountant = accountant
    self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix='dpjax-epsilon')
    self._upcoming = iter(steps)
    self._held = None  # The next upcoming step, held back by the busy budget.
    self._last = futures.Future()  # The latest query ahead (done: none is running).
    self._last.set_result(None)
    self._ahead: dict[int, futures.Future] = {}
    self._depth = depth
    self._passed = -1  # The last step asked for: the loop never asks for an earlier one.
    self._seconds = []  # Durations of the queries so far (for the trainer's ETA).
    self._fill()

  @property
  def mean_query_seconds(self) -> float:
    """The mean duration of a query so far (0 before the first)."""
    return sum(self._seconds) / len(self._seconds) if self._seconds else 0.0

  def _query(self, step: int, estimates: bool = False) -> PrivacyReport:
    """The accountant's report, on the worker; sets when the next query ahead may start."""
    start = time.monotonic()
    report = self._accountant.epsilon_at(step, estimates=estimates)
    end = time.monotonic()
    self._seconds.append(end - start)
    self._next_start = end + (end - start) * (1 - self._busy_fraction) / self._busy_fraction
    return report

  def _submit_ahead(self, step: int) -> bool:
    """Queues `step` ahead of time unless the busy budget says wait (then False)."""
    if time.monotonic() < self._next_start or not self._last.done():
      return False  # One query ahead at a time (a dropped one may still run), budget allowing.
    self._ahead[step] = self._last = self._pool.submit(self._query, step)
    return True

  def _fill(self) -> None:
    while len(self._ahead) < self._depth:
      step, self._held = (
        (self._held if self._held is not None else next(self._upcoming, None)),
        None,
      )
      if step is None:
        return
      if step not in self._ahead and step > self._passed and not self._submit_ahead(step):
        self._held = step  # Submitted at a later call, when the budget allows.
        return

  def _drop_passed(self, step: int) -> None:
    """Forgets the steps before `step` (never asked for now; a running one finishes)."""
    self._passed = max(self._passed, step)
    for skipped in [s for s in self._ahead if s < step]:
      self._ahead.pop(skipped).cancel()

  def epsilon_if_ready(self, step: int) -> PrivacyReport | None:
    """The report for `step` if computed already, else None (and `step` is queued when the busy
    budget allows): never waits."""
    self._drop_passed(step)
    ahead = self._ahead.get(step)
    if ahead is None:
      self._submit_ahead(step)
    elif ahead.done():
      self._ahead.pop(step)
      self._fill()
      return ahead.result()
    self._fill()
    return None

  def epsilon_at(self, step: int, *, estimates: bool = False) -> PrivacyReport:
    """The accountant's report for `step` (waits for it if it is not ready yet)."""
    self._drop_passed(step)
    ahead = self._ahead.pop(step, None)
    if estimates or ahead is None:
      if ahead is not None:
        ahead.result()  # Keep one query at a time; the memo now holds the attached ε.
      ahead = self._pool.submit(self._query, step, estimates)
    report = ahead.result()
    self._fill()
    return report

  def close(self) -> None:
    """Drops what was computed ahead and stops the thread (waits for a running query)."""
    self._pool.shutdown(wait=True, cancel_futures=True)
    self._ahead.clear()

  def __enter__(self) -> EpsilonAhead:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
