"""ε of the coming logged steps, computed ahead on one background thread.

The trainer logs ε every `log_every_steps`; each value is a PLD composition
(0.1-0.5 s on a CPU), which in the training loop would stall the device
queue at every log. `EpsilonAhead` submits `accountant.epsilon_at(step)` for
the next few steps that will be asked for to a single worker thread while the
device trains, so the loop finds the report ready. The numbers are the
accountant's own (`epsilon_at` is memoised per step, a pure function of the
step): identical to calling it in the loop, only earlier. Every query goes
through the one worker, so the accountant is never used from two threads.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent import futures

from dpjax.accounting.accountant import Accountant
from dpjax.accounting.report import PrivacyReport


class EpsilonAhead:
  """`epsilon_at(step, estimates)` answered from reports computed ahead of time.

  Args:
    accountant: the run's accountant.
    steps: the steps that will be asked for without estimates, in order
      (e.g. every logged or checkpointed step of the rest of the run).
    depth: how many of them are computed ahead at once.
  """

  def __init__(self, accountant: Accountant, steps: Iterable[int], depth: int = 2):
    self._accountant = accountant
    self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix='dpjax-epsilon')
    self._upcoming = iter(steps)
    self._ahead: dict[int, futures.Future] = {}
    self._depth = depth
    self._passed = -1  # The last step asked for: the loop never asks for an earlier one.
    self._fill()

  def _fill(self) -> None:
    while len(self._ahead) < self._depth:
      step = next(self._upcoming, None)
      if step is None:
        return
      if step not in self._ahead and step > self._passed:
        self._ahead[step] = self._pool.submit(self._accountant.epsilon_at, step, estimates=False)

  def _drop_passed(self, step: int) -> None:
    """Forgets the steps before `step` (never asked for now; a running one finishes)."""
    self._passed = max(self._passed, step)
    for skipped in [s for s in self._ahead if s < step]:
      self._ahead.pop(skipped).cancel()

  def epsilon_if_ready(self, step: int) -> PrivacyReport | None:
    """The report for `step` if computed already, else None (and `step` is queued): never waits."""
    self._drop_passed(step)
    ahead = self._ahead.get(step)
    if ahead is None:
      self._ahead[step] = self._pool.submit(self._accountant.epsilon_at, step, estimates=False)
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
      ahead = self._pool.submit(self._accountant.epsilon_at, step, estimates=estimates)
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
