"""Every write of a run fails in one line: which file, why, and what to do.

A full disk used to end a run in orbax, TensorBoard or lock tracebacks (one run printed 177
lines). Each write path of the trainer and the export (checkpoints, `metrics.jsonl`,
TensorBoard events, `config.json`, `private/seed.json`, `audit.json`, the lock file, the
export's files) raises `WriteError` instead, and leaves nothing partial: files are replaced
atomically (`atomic_write`), appended files are cut back to their last durable size, a failed
checkpoint's temporary directory is removed (the previous checkpoint stays valid), and an
export is staged in a temporary directory that is removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import Iterator

FULL = (errno.ENOSPC, errno.EDQUOT)
RERUN = (
  'Free space (or fix the file system), then rerun the same command: it resumes from '
  'the latest checkpoint if there is one (a failed write leaves them intact).'
)


class WriteError(RuntimeError):
  """A write under the workdir (or an export) failed; the message is one line."""


def is_full(error: BaseException) -> bool:
  """Whether `error` (or what it was raised from) is a full disk or quota."""
  while error is not None:
    if isinstance(error, OSError) and error.errno in FULL:
      return True
    error = error.__cause__ or error.__context__
  return False


def reason(error: OSError) -> str:
  """'no space left on device' for a full disk or quota, else the OS's words."""
  return 'no space left on device' if is_full(error) else (error.strerror or str(error))


@contextlib.contextmanager
def writing(what: str, path: str, then: str = RERUN) -> Iterator[None]:
  """OSError inside becomes `WriteError`: 'cannot write <what> (<path>): <reason>. <then>'."""
  try:
    yield
  except OSError as e:
    raise WriteError(f'cannot write {what} ({path}): {reason(e)}. {then}') from e


def truncate_quietly(path: str, size: int) -> None:
  """Cuts `path` back to `size` bytes (no space needed), ignoring a file that is gone."""
  with contextlib.suppress(OSError):
    os.truncate(path, size)
