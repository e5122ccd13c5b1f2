"""Replace a file so that a crash leaves either the old or the new content, never a mix.

The text goes to a temporary file beside the target, is fsync'ed, renamed over
the target (`os.replace` is atomic on POSIX), and the directory is fsync'ed so
the rename itself survives a power loss. A failed write (a full disk) removes the
temporary file and raises `write_errors.WriteError` (one line); the target is untouched.
"""

from __future__ import annotations

import os

from dpjax.trainer.commands import interrupts
from dpjax.trainer.workdir import write_errors


def write_text_atomically(
  path: str, text: str, mode: int = 0o666, what: str = '', then: str = write_errors.RERUN
) -> None:
  """Atomically sets the content of `path` to `text` (tmp + fsync + rename + fsync of the dir).

  `mode` (before the umask) applies from the file's creation: 0o600 keeps a secret unreadable
  to others at every moment. `what` names the file in the error (default: its name), `then`
  says what to do (default: free space and rerun, which resumes a run).
  """
  # Removed on an error, or by a command's signal handler (`interrupts.exit_on_signals`).
  with write_errors.writing(what or os.path.basename(path), path, then):
    with interrupts.partial_output(f'{path}.tmp-{os.getpid()}') as tmp:
      with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), 'w') as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
