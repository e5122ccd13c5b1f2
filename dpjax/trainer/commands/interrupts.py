"""Graceful stop on SIGTERM / SIGINT: finish the step, checkpoint, flush, exit 128 + signal.

Schedulers preempt with SIGTERM (then SIGKILL after a grace period); a user
presses Ctrl-C (SIGINT). Either way the run should lose nothing. Inside
`GracefulStop` the first SIGTERM or SIGINT only sets a flag; the loop polls
`stop.requested` after each step (a Python attribute read: no host sync),
saves a checkpoint, flushes metrics and TensorBoard, and exits with
`stop.exit_code` = 128 + signal number (143 for SIGTERM, 130 for SIGINT), the
status a shell reports for a process killed by that signal.

A second Ctrl-C means "now": it raises `KeyboardInterrupt` in the main thread
and gives SIGINT back its default action, so a third one kills the process
even while it is blocked inside a long native call. Further SIGTERMs only
repeat the notice (the stop is already under way).

Handlers can only be installed from the main thread (a Python rule); from any
other thread `GracefulStop` installs nothing and `requested` stays False.
The previous handlers are restored on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable, Iterator, NoReturn

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_BEFORE_THE_LOOP = {'interrupted': False}
_REDELIVERY: dict[str, Any] = {'timer': None, 'handled': False}  # `deliver_sigint_again`.
_REDELIVERY_LOCK = threading.Lock()
_PARTIAL: list[str] = []  # Output being written (`partial_output`): removed by `exit_on_signals`.


def interrupt_before_the_loop(signum: int, frame: FrameType | None) -> None:
  """The SIGINT handler until the loop starts: KeyboardInterrupt, remembered.

  Python drops an exception raised while it runs a gc callback or a `__del__` (it prints
  "Exception ignored in ..."): a Ctrl-C that landed in XLA's gc callback during σ
  calibration was lost, and the run trained to the end and exited 0. Remembered, it is
  raised again where the loop takes the signals over (`GracefulStop.__enter__`), and
  `drop_lost_interrupts` keeps the lost copy off stderr.
  """
  del signum, frame
  _BEFORE_THE_LOOP['interrupted'] = True
  raise KeyboardInterrupt


def drop_lost_interrupts(unraisable) -> None:
  """`sys.unraisablehook`: a KeyboardInterrupt that Python had to drop after
  `interrupt_before_the_loop` is silent and delivered again (SIGINT to this process 50 ms
  later, from a timer thread, so its handler runs outside the gc callback or `__del__` that
  dropped it): start-up stops within moments, not minutes of σ calibration later at the loop's
  start. Anything else is reported as by default."""
  if _BEFORE_THE_LOOP['interrupted'] and issubclass(unraisable.exc_type, KeyboardInterrupt):
    deliver_sigint_again()
    return
  sys.__unraisablehook__(unraisable)


def deliver_sigint_again(delay: float = 0.05) -> None:
  """SIGINT to this process after `delay` seconds, from a daemon timer thread; one at a time
  (a Ctrl-C dropped twice is delivered once), and none once `interrupt_handled`."""
  with _REDELIVERY_LOCK:
    pending = _REDELIVERY['timer']
    if _REDELIVERY['handled'] or (pending is not None and pending.is_alive()):
      return
    timer = threading.Timer(delay, _redeliver)
    timer.daemon = True
    _REDELIVERY['timer'] = timer
    timer.start()


def _redeliver() -> None:
  with _REDELIVERY_LOCK:  # Never after `interrupt_handled`: the exit would die by the signal.
    if not _REDELIVERY['handled']:
      os.kill(os.getpid(), signal.SIGINT)


def interrupt_handled() -> None:
  """The Ctrl-C before the loop is being acted on: from here on SIGINT is ignored and no copy
  from `deliver_sigint_again` is sent."""
  with _REDELIVERY_LOCK:
    _REDELIVERY['handled'] = True
    if _REDELIVERY['timer'] is not None:
      _REDELIVERY['timer'].cancel()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def exit_interrupted(message: str) -> NoReturn:
  """A Ctrl-C before the loop: `message` on stderr, exit 130, no interpreter teardown.

  Nothing is open that teardown would finish (no checkpoint exists yet; a `partial_output`
  block already removed its output as the KeyboardInterrupt left it). Teardown itself could
  turn the exit into death by the signal: 1 in ~15 Ctrl-Cs 3 s into `dpjax.train` (an import
  interrupted) printed this line and then exited -2, not 130."""
  interrupt_handled()
  with contextlib.suppress(OSError, ValueError):
    sys.stdout.flush()
  say_and_exit(message, 130)


def say_and_exit(line: str, code: int) -> NoReturn:
  """`line` on stderr, then exit `code` at once (no interpreter teardown). os.write, not print:
  a signal handler may run while stderr is in the middle of a write."""
  with contextlib.suppress(OSError):
    os.write(2, f'{line}\n'.encode())
  os._exit(code)  # pylint: disable=protected-access


class StillRunning(Exception):
  """A signal arrived while `GracefulStop.run` waited for a call that did not finish within
  the grace period; the call goes on in a daemon thread (exit with os._exit)."""


class GracefulStop:
  """Context manager: `requested`, `signal_name` and `exit_code` of the first SIGTERM/SIGINT."""

  def __init__(self, *, log=None):
    self.signum: int | None = None
    self.progress = 0  # Steps dispatched so far (the loop sets it after each call).
    self.progress_at_signal = 0  # ... when the first signal arrived.
    self._log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    self._previous: dict[int, object] = {}

  @property
  def requested(self) -> bool:
    return self.signum is not None

  @property
  def signal_name(self) -> str | None:
    return None if self.signum is None else signal.Signals(self.signum).name

  @property
  def exit_code(self) -> int:
    """128 + the signal's number (0 if none was received)."""
    return 0 if self.signum is None else 128 + self.signum

  def _handle(self, signum: int, frame: FrameType | None) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.signum is None:
      self.signum = signum
      self.progress_at_signal = self.progress
      self._log(
        f'{name} received: finishing this step, saving a checkpoint, then exiting with '
        f'code {128 + signum}'
        + (' (Ctrl-C again to abort at once).' if signum == signal.SIGINT else '.')
      )
    elif signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.SIG_DFL)  # A third Ctrl-C kills the process.
      raise KeyboardInterrupt(f'second {name}: aborting without a checkpoint')
    else:
      self._log(f'{name} received again: already stopping after this step.')

  def run(self, fn: Callable[[], Any], grace: float = 1.0) -> Any:
    """fn() on a daemon thread while the main thread waits in Python (signals handled at once).

    Returns fn's result or raises its exception; `StillRunning` if a signal arrived and fn
    had not returned `grace` seconds after it. Off the main thread (no handlers): fn().
    """
    if not self._previous:
      return fn()
    done, box = threading.Event(), {}

    def work():
      try:
        box['result'] = fn()
      except BaseException as e:  # pylint: disable=broad-except  # Re-raised by the waiter.
        box['error'] = e
      finally:
        done.set()

    threading.Thread(target=work, name='dpjax-call', daemon=True).start()
    deadline = None
    while not done.wait(0.05):  # Interrupted by a signal: the handler runs, then it waits on.
      if self.requested:
        deadline = deadline or time.monotonic() + grace
        if time.monotonic() > deadline:
          raise StillRunning(f'a call still running {grace:g} s after {self.signal_name}')
    if 'error' in box:
      raise box['error']
    return box['result']

  def __enter__(self) -> GracefulStop:
    if threading.current_thread() is threading.main_thread():
      if _BEFORE_THE_LOOP['interrupted']:  # A Ctrl-C before the loop that Python dropped.
        raise KeyboardInterrupt('Ctrl-C before the loop')
      for signum in SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    self._previous.clear()


def exit_on_signals(prog: str, detail: str = '') -> None:
  """SIGINT and SIGTERM end this process at once: the partial outputs removed, one line on stderr,
  exit 128 + signal (130 for Ctrl-C, 143 for SIGTERM). The line is `<prog>: interrupted
  (Ctrl-C)<detail>.` (or `stopped by SIGTERM`). Call it from the main thread, first thing in a
  command's `if __name__ == '__main__'` block, before its heavy imports."""

  def handle(signum: int, frame: FrameType | None) -> None:
    del frame
    for pid in _child_processes():  # Monte-Carlo workers, a PLD builder: they would outlive us.
      with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGTERM)
    for path in reversed(_PARTIAL):
      _remove(path)
    what = (
      'interrupted (Ctrl-C)'
      if signum == signal.SIGINT
      else (f'stopped by {signal.Signals(signum).name}')
    )
    say_and_exit(f'{prog}: {what}{detail}.', 128 + signum)

  for signum in SIGNALS:
    signal.signal(signum, handle)


@contextlib.contextmanager
def partial_output(path: str) -> Iterator[str]:
  """Marks `path` (a file or a directory) as output being written: removed if the block raises,
  or if `exit_on_signals`' handler ends the process while inside it. Rename it into place as the
  block's last step to publish it whole or not at all."""
  _PARTIAL.append(path)
  try:
    yield path
  except BaseException:
    _remove(path)
    raise
  finally:
    _PARTIAL.remove(path)


def _child_processes() -> set[int]:
  """This process's children: from /proc (Linux), and multiprocessing's where it is in use."""
  pids = set()
  if 'multiprocessing' in sys.modules:
    pids.update(p.pid for p in sys.modules['multiprocessing'].active_children() if p.pid)
  with contextlib.suppress(OSError):
    for name in os.listdir('/proc'):
      try:
        with open(f'/proc/{name}/stat', 'rb') as f:  # "pid (comm) state ppid ...".
          if int(f.read().rsplit(b')', 1)[1].split()[1]) == os.getpid():
            pids.add(int(name))
      except (OSError, ValueError, IndexError):
        continue
  return pids


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    with contextlib.suppress(OSError):
      os.remove(path)
