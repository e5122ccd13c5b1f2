"""Which run a workdir holds: a random run id, drawn each time a run starts from scratch.

The seed record (`dpjax.trainer.workdir.seed_record`) tells runs apart by this id, never by their
workdir's path. A workdir deleted and trained again in the same path with the same given seed
holds another run: its noise is the first run's, so releasing both reveals the noise-free
difference of their gradients. A resume, a copy or a move of the workdir is the same run.

* A fresh start (no checkpoint to resume) draws 128 bits (`secrets.token_hex(16)`) and keeps
  them in `<workdir>/private/run.json` (mode 0600, beside the seed), with the ids this workdir
  held before (runs started here from scratch again: their checkpoints are not here).
* A resume or an export reads the id back; a workdir written before run ids existed gets one
  at its first resume or export.

The id is not secret but stays in the workdir: no checkpoint, log or export carries it (a
copy of the workdir keeps it with `private/`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets

from dpjax.trainer.workdir import run_seed
from dpjax.trainer.workdir import write_errors
from dpjax.trainer.workdir.atomic_write import write_text_atomically

RUN_FILE = 'run.json'
_HEX_ID = re.compile(r'[0-9a-f]{32}')


@dataclasses.dataclass(frozen=True)
class RunIdentity:
  """This run's id and those of the runs this workdir held before it (newest first)."""

  run_id: str
  earlier: tuple[str, ...] = ()


def run_path(workdir: str) -> str:
  return os.path.join(workdir, run_seed.PRIVATE_DIR, RUN_FILE)


def stored(workdir: str) -> RunIdentity | None:
  """The identity kept in `workdir`, or None. ValueError (one line) if the file is damaged."""
  return run_seed.read_private_record(
    run_path(workdir),
    _parse,
    'run id',
    'remove it and retry (the run then gets a new id: '
    'exporting it again after an export needs --allow_shared_seed).',
  )


def _parse(record: dict) -> RunIdentity:
  identity = RunIdentity(record['run_id'], tuple(record.get('earlier', ())))
  if not all(
    isinstance(i, str) and _HEX_ID.fullmatch(i) for i in (identity.run_id,) + identity.earlier
  ):
    raise ValueError(record)
  return identity


def fresh(workdir: str) -> RunIdentity:
  """A run starting from scratch in `workdir`: a new id, kept; an id already there (an earlier
  run of this workdir, whose checkpoints are gone) is remembered in `earlier`."""
  try:
    before = stored(workdir)
  except ValueError:  # Damaged: replaced, the earlier ids are lost (at worst, one more warning).
    before = None
  earlier = (before.run_id,) + before.earlier if before else ()
  identity = RunIdentity(secrets.token_hex(16), earlier)
  _store(workdir, identity)
  return identity


def kept(workdir: str) -> RunIdentity:
  """The identity of the run in `workdir` (a resume, an export), drawn and kept if the workdir
  predates run ids. ValueError if damaged, `write_errors.WriteError` if it cannot be kept."""
  identity = stored(workdir)
  if identity is None:
    identity = RunIdentity(secrets.token_hex(16))
    _store(workdir, identity)
  return identity


def _store(workdir: str, identity: RunIdentity) -> None:
  directory = os.path.join(workdir, run_seed.PRIVATE_DIR)
  with write_errors.writing('the run id', directory):
    os.makedirs(directory, mode=0o700, exist_ok=True)
  write_text_atomically(
    run_path(workdir),
    json.dumps(
      {
        'run_id': identity.run_id,
        'earlier': list(identity.earlier),
        'note': 'Tells this run apart from others with the same seed (dpjax seed record).',
      }
    )
    + '\n',
    mode=0o600,
    what='the run id',
  )
