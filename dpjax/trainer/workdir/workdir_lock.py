"""One run per workdir: an exclusive lock on `<workdir>/lock.json`.

Two trainers on one workdir interleave metrics and race inside orbax, so the
second one must refuse before any compute. The lock is `fcntl.flock(LOCK_EX |
LOCK_NB)` on `<workdir>/lock.json`, held open for the whole run, and the file
says who holds it: `{"host", "pid", "start_time"}` (written after the lock is
taken, emptied at release).

* Held by a live process: refused at once with `WorkdirInUseError` (a
  `ValueError`: one line naming host, PID and start time).
* Free but not empty: the previous holder ended without releasing it
  (SIGKILL, a crash). The kernel drops a dead process's flock, so on this
  host a free lock proves the holder is gone: it is taken over with a warning
  naming the old PID. A body written by *another* host is refused instead:
  some shared file systems do not propagate flock between hosts, and a run
  there cannot be checked from here; the message says which file to delete
  once that run is known to be over.
* Multi-process runs share one workdir: only process 0 (`primary=True`) locks.

The file is kept (emptied) at release rather than deleted: unlinking a
flock'ed file lets a waiter lock the old inode while a newcomer locks a new one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from typing import Any

from dpjax.trainer.workdir import write_errors

LOCK_FILE = 'lock.json'


class WorkdirInUseError(ValueError):
  """The workdir is locked by another run (the message names its host and PID)."""


def _describe(holder: dict[str, Any]) -> str:
  started = holder.get('start_time')
  since = (
    time.strftime(' since %Y-%m-%d %H:%M:%S UTC', time.gmtime(started))
    if isinstance(started, (int, float))
    else ''
  )
  return f'PID {holder.get("pid")} on host {holder.get("host")}{since}'


def _read_holder(fd: int) -> dict[str, Any] | None:
  """The JSON body of the open lock file, or None when it is empty or unreadable."""
  os.lseek(fd, 0, os.SEEK_SET)
  raw = b''
  while chunk := os.read(fd, 65536):
    raw += chunk
  if not raw.strip():
    return None
  try:
    holder = json.loads(raw)
  except ValueError:
    return {'host': '?', 'pid': '?', 'unparsed': raw[:200].decode(errors='replace')}
  return holder if isinstance(holder, dict) else {'host': '?', 'pid': '?'}


class WorkdirLock:
  """Context manager holding the exclusive lock of `workdir` (a no-op unless `primary`).

  `acquire()` creates `workdir` if needed and raises `ValueError` (one line) if
  it cannot be used, `WorkdirInUseError` if another run holds it.
  """

  def __init__(self, workdir: str, *, primary: bool = True):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, LOCK_FILE)
    self.primary = primary
    self._fd: int | None = None

  def acquire(self) -> None:
    if not self.primary or self._fd is not None:
      return
    try:
      os.makedirs(self.workdir, exist_ok=True)
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except (FileExistsError, NotADirectoryError):
      raise ValueError(
        f'--workdir {self.workdir} is not a directory (a file is in the way).'
      ) from None
    except OSError as e:
      raise ValueError(
        f'--workdir {self.workdir} cannot be used: {e.strerror} ({e.filename or self.path}).'
      ) from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = _read_holder(fd) or {}
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
        raise WorkdirInUseError(
          f'--workdir {self.workdir} is in use by another run ({_describe(holder)}); wait '
          f'for it to finish or stop it, or use another --workdir.'
        ) from None
      raise ValueError(
        f'--workdir {self.workdir}: cannot lock {self.path} ({e.strerror}).'
      ) from None
    host = socket.gethostname()
    previous = _read_holder(fd)
    if previous is not None:
      if previous.get('host') != host:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        raise WorkdirInUseError(
          f'--workdir {self.workdir} is locked by {_describe(previous)}, which cannot be '
          f'checked from host {host}; if that run has ended, delete {self.path} and rerun.'
        )
      message = (
        f'taking over the stale lock of {self.workdir} left by {_describe(previous)}, '
        'which ended without releasing it.'
      )
      logging.warning(message)
      print(f'WARNING: {message}', file=sys.stderr)
    body = json.dumps({'host': host, 'pid': os.getpid(), 'start_time': time.time()})
    try:
      with write_errors.writing(
        'the lock file',
        self.path,
        then='Free space (or fix the file system), then rerun the same command.',
      ):
        os.ftruncate(fd, 0)
        os.pwrite(fd, body.encode(), 0)
        os.fsync(fd)
    except write_errors.WriteError:
      os.ftruncate(fd, 0)  # Empty, as a released lock: nothing partial (needs no space).
      fcntl.flock(fd, fcntl.LOCK_UN)
      os.close(fd)
      raise
    self._fd = fd

  def release(self) -> None:
    """Empties the file (a clean exit leaves no stale holder) and drops the lock."""
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)
    finally:
      fcntl.flock(fd, fcntl.LOCK_UN)
      os.close(fd)

  def __enter__(self) -> WorkdirLock:
    self.acquire()
    return self

  def __exit__(self, *exc_info) -> None:
    self.release()
