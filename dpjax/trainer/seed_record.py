"""This user's record of given seeds: a second run with one seed is named, its export refused.

Two runs that share a seed share their sampling and their noise, so releasing both reveals the
noise-free difference of what they computed (e.g. two learning rates of a sweep). Runs with a
seed given in the config (`config.seed`; drawn seeds are 63 secret bits and are not recorded)
are recorded here by the seed's digest (`privacy_plan.seed_digest`, never the seed itself),
with the workdir, when a fresh run starts and when it is exported:

* a fresh run whose seed another workdir already used starts with one warning line naming that
  workdir (resuming the same workdir is not a reuse);
* `dpjax.export` refuses a run whose seed another workdir already exported, wherever either
  export went (`--allow_shared_seed` overrides).

The record is `$DPJAX_STATE_DIR/seeds.jsonl`, else `${XDG_STATE_HOME:-~/.local/state}/dpjax/
seeds.jsonl` (mode 0600): one JSON object per line, appended under an exclusive lock. Rows of
the export registry that preceded it (`exports.jsonl` beside it) are read as exports. A record
that cannot be read or written (a read-only or missing home) costs one warning line, never the
run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time

STATE_ENV = 'DPJAX_STATE_DIR'
RECORD = 'seeds.jsonl'
# The export registry before this record (rows {seed_sha256, workdir, out}), read as exports.
LEGACY_EXPORTS = 'exports.jsonl'
TRAIN, EXPORT = 'train', 'export'


def state_dir() -> str:
  """Where this user's private dpjax state lives."""
  return os.environ.get(STATE_ENV) or os.path.join(
      os.environ.get('XDG_STATE_HOME') or os.path.join(os.path.expanduser('~'), '.local',
                                                       'state'), 'dpjax')


def record_path() -> str:
  return os.path.join(state_dir(), RECORD)


def uses(digest: str) -> list[dict]:
  """Every recorded use of the seed with this digest, oldest first. OSError if unreadable."""
  rows = []
  for name, event in ((LEGACY_EXPORTS, EXPORT), (RECORD, None)):
    path = os.path.join(state_dir(), name)
    if not os.path.exists(path):
      continue
    with open(path) as f:
      for line in f:
        with contextlib.suppress(ValueError, AttributeError):
          row = json.loads(line)
          if row.get('seed_sha256') == digest:
            rows.append(dict(row, event=row.get('event') or event))
  return rows


def append(digest: str, event: str, workdir: str, out: str | None = None) -> None:
  """Appends one use under an exclusive lock (other processes append whole lines). OSError if
  the record cannot be written."""
  os.makedirs(state_dir(), mode=0o700, exist_ok=True)
  fd = os.open(record_path(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
  with os.fdopen(fd, 'a') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.write(json.dumps({'seed_sha256': digest, 'event': event, 'workdir': workdir, 'out': out,
                        'time': time.time()}) + '\n')
    f.flush()


def unusable(error: OSError) -> str:
  """The one warning line for a record that cannot be read or written."""
  return (f'the seed record {record_path()} cannot be read or written '
          f'({type(error).__name__}: {error.strerror or error}): another run with this seed will '
          f'not be detected (set ${STATE_ENV} to a writable directory).')


def start_warnings(digest: str, workdir: str) -> list[str]:
  """Lines for the start of a fresh run with a given seed; records this workdir's use."""
  workdir = os.path.realpath(workdir)
  try:
    rows = uses(digest)
    others = [r for r in rows if r.get('workdir') != workdir]
    if not any(r.get('workdir') == workdir for r in rows):
      append(digest, TRAIN, workdir)
  except OSError as e:
    return [unusable(e)]
  if not others:
    return []
  more = len({r.get('workdir') for r in others}) - 1
  return [f'seed: the run in {others[-1].get("workdir")}' + (f' (and {more} more)' if more else '')
          + ' used this same given seed: two runs that share a seed share their sampling and '
          'noise, and releasing both reveals the noise-free difference of their gradients. Give '
          'each run its own seed, or unset seed to draw one.']


def exported_elsewhere(digest: str, workdir: str) -> dict | None:
  """An export of the same seed from another workdir (OSError if the record is unreadable)."""
  workdir = os.path.realpath(workdir)
  others = [r for r in uses(digest) if r['event'] == EXPORT and r.get('workdir') != workdir]
  return others[-1] if others else None
