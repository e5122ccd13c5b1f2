"""This user's record of given seeds: a second run with one seed is named, its export refused.

Two runs that share a seed share their sampling and their noise, so releasing both reveals the
noise-free difference of what they computed (e.g. two learning rates of a sweep). A run is
told apart from another by its run id (`dpjax.trainer.workdir.run_identity`, drawn at each start from
scratch), never by its workdir's path: a workdir deleted and trained again in the same path is
another run. Runs with a seed given in the config (`config.seed`; drawn seeds are 63 secret
bits and are not recorded at start) are recorded by the seed's digest
(`privacy_plan.seed_digest`, never the seed itself), with the run id and the workdir, when they
start from scratch; every export is recorded the same way:

* a fresh run whose seed another run already used starts with one warning line naming that
  run's workdir as recorded (a resume is not a reuse, nor is a start from scratch again of a
  run this workdir held that never exported);
* `dpjax.export` refuses a run whose seed another run already exported, wherever either
  export went (`--allow_shared_seed` overrides).

Rows written before run ids existed have none: each counts as another run, whatever its
path (refused in one line rather than passed in silence: an export of the same run made by an
older dpjax then needs `--allow_shared_seed`).

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
    os.environ.get('XDG_STATE_HOME') or os.path.join(os.path.expanduser('~'), '.local', 'state'),
    'dpjax',
  )


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


def append(
  digest: str, event: str, workdir: str, run_id: str | None, out: str | None = None
) -> None:
  """Appends one use under an exclusive lock (other processes append whole lines). OSError if
  the record cannot be written."""
  os.makedirs(state_dir(), mode=0o700, exist_ok=True)
  fd = os.open(record_path(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
  with os.fdopen(fd, 'a') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.write(
      json.dumps(
        {
          'seed_sha256': digest,
          'event': event,
          'run_id': run_id,
          'workdir': workdir,
          'out': out,
          'time': time.time(),
        }
      )
      + '\n'
    )
    f.flush()


def unusable(error: OSError) -> str:
  """The one warning line for a record that cannot be read or written."""
  return (
    f'the seed record {record_path()} cannot be read or written '
    f'({type(error).__name__}: {error.strerror or error}): another run with this seed will '
    f'not be detected (set ${STATE_ENV} to a writable directory).'
  )


def run_named(row: dict, workdir: str) -> str:
  """The run of a recorded use, in words, for a run in `workdir` (a real path)."""
  path = row.get('workdir')
  if not row.get('run_id'):
    return f'the run in {path} (recorded by an older dpjax, without a run id)'
  if path == workdir:
    return f'an earlier run in this same workdir {path} (deleted, or started again from scratch)'
  return f'the run in {path}'


def start_warnings(
  digest: str, workdir: str, run_id: str, earlier: tuple[str, ...] = ()
) -> list[str]:
  """Lines for a run with a given seed starting from scratch as `run_id`; records its use.

  Uses by other runs count, but not the starts of the runs this workdir held before (`earlier`,
  from `run_identity`) that were never exported: their checkpoints are gone."""
  workdir = os.path.realpath(workdir)
  try:
    rows = uses(digest)
    append(digest, TRAIN, workdir, run_id)
  except OSError as e:
    return [unusable(e)]
  others = [
    r
    for r in rows
    if r.get('run_id') != run_id and not (r['event'] == TRAIN and r.get('run_id') in earlier)
  ]
  if not others:
    return []
  more = len({r.get('run_id') or r.get('workdir') for r in others}) - 1
  return [
    f'seed: {run_named(others[-1], workdir)}'
    + (f' (and {more} more)' if more else '')
    + ' used this same given seed: two runs that share a seed share their sampling and '
    'noise, and releasing both reveals the noise-free difference of their gradients. Give '
    'each run its own seed, or unset seed to draw one.'
  ]


def exported_by_another_run(digest: str, run_id: str | None) -> dict | None:
  """The latest export of the same seed by another run (a row without a run id is another
  run; so is every row for `run_id` None). OSError if the record is unreadable."""
  others = [
    r
    for r in uses(digest)
    if r['event'] == EXPORT and (run_id is None or r.get('run_id') != run_id)
  ]
  return others[-1] if others else None
