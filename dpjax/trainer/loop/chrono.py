"""Wall-clock bookkeeping of a training run (since its start or resume).

The first call (compilation included) is timed apart. After it, time runs in
windows from one log to the next: a window's rates count its steps and
examples over its seconds, less the seconds paused in it for evals and
checkpoints. Every value here is a timing, reported under `nonprivate_*`.
"""

from __future__ import annotations

import time
from typing import Callable


class Chrono:
  """Compilation time, the current window's step and example rates, and pauses, read from
  `now` (seconds; a test's clock in place of time.time)."""

  def __init__(self, now: Callable[[], float] = time.time):
    self.now = now
    self.start = now()
    self.compile_seconds: float | None = None  # The first call, compilation included.
    self.checkpoint_seconds: float | None = None  # The latest save.
    self.window_steps = 0
    self.window_examples = 0
    self._window_start: float | None = None
    self._paused = 0.0
    self._dispatched = self.start

  def dispatch(self) -> None:
    """Marks the dispatch of a call."""
    self._dispatched = self.now()

  def since_dispatch(self) -> float:
    """Seconds since the latest call was dispatched."""
    return self.now() - self._dispatched

  def compiled(self) -> None:
    """Ends the first call: its seconds are the compile time; the first window starts."""
    self._window_start = self.now()
    self.compile_seconds = self._window_start - self.start

  def count(self, steps: int, examples: int) -> None:
    """Adds a call's steps and examples to the window."""
    self.window_steps += steps
    self.window_examples += examples

  def pause(self, start: float) -> float:
    """The seconds since `start` (an eval, a save), left out of the window's rates."""
    seconds = self.now() - start
    self._paused += seconds
    return seconds

  def window_rate(self) -> tuple[float | None, float]:
    """(steps per second, seconds) of the window so far; the rate is None without a step."""
    elapsed = self.now() - self._window_start - self._paused
    return (self.window_steps / elapsed if self.window_steps and elapsed > 0 else None), elapsed

  def wall_seconds(self) -> float:
    """Seconds since the start."""
    return self.now() - self.start

  def next_window(self) -> None:
    """Starts a new window (after a log)."""
    self._window_start, self._paused = self.now(), 0.0
    self.window_steps = self.window_examples = 0
