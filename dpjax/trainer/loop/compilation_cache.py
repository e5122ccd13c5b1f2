"""jax's persistent compilation cache under a user cache directory (`config.compilation_cache_dir`).

A rerun or a resume of the same config finds the compiled step on disk and
skips XLA compilation (seconds instead of tens of seconds for a WRN step on a
GPU). The cache is keyed by jax on the program, the jax/XLA version and the
device, so a stale entry is never used for another program. Values of
`config.compilation_cache_dir`:

  ''      the default: $DPJAX_CACHE_DIR, else ~/.cache/dpjax/xla
  'none'  off (every run compiles)
  a path  that directory
"""

from __future__ import annotations

import os
import sys
import tempfile

import jax

ENV_VAR = 'DPJAX_CACHE_DIR'
DEFAULT_DIR = os.path.join('~', '.cache', 'dpjax', 'xla')
# Programs that compile faster than this are not worth a disk entry (jax's default is 1 s,
# which would skip the small eval / init programs a rerun also pays for).
MIN_COMPILE_SECONDS = 0.1


def resolve_cache_dir(setting: str = '') -> str | None:
  """The directory `setting` names ('' = default, 'none' = None); ValueError if not a string."""
  if not isinstance(setting, str):
    raise ValueError(
      f"compilation_cache_dir must be a string ('' = default, 'none' = off, or a "
      f'directory), got {setting!r}.'
    )
  if setting.strip().lower() == 'none':
    return None
  path = setting or os.environ.get(ENV_VAR) or DEFAULT_DIR
  return os.path.abspath(os.path.expanduser(path))


def enable_compilation_cache(
  setting: str = '', min_compile_seconds: float = MIN_COMPILE_SECONDS
) -> str | None:
  """Points jax's persistent compilation cache at `setting` (see module doc); returns the dir.

  Call before the first compilation. 'none' disables the cache for this process.
  """
  path = resolve_cache_dir(setting)
  if path is not None and not _writable_dir(path):
    if setting:  # Named by the user: say so, as for any other bad field.
      raise ValueError(
        f'compilation_cache_dir = {setting!r}: {path} cannot be created or written; '
        "name a writable directory, or 'none' to compile every run."
      )
    print(
      f'WARNING: the compilation cache {path} is not writable (HOME or $DPJAX_CACHE_DIR); '
      'compiling without a persistent cache.',
      file=sys.stderr,
      flush=True,
    )
    path = None
  if path is None:
    jax.config.update('jax_enable_compilation_cache', False)
    return None
  jax.config.update('jax_enable_compilation_cache', True)
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', min_compile_seconds)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  return path


def _writable_dir(path: str) -> bool:
  """Whether `path` exists (or can be created) as a directory files can be written in."""
  try:
    os.makedirs(path, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=path, prefix='.dpjax-probe-')
    os.close(fd)
    os.remove(probe)
  except OSError:
    return False
  return True
