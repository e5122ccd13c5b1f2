"""The run's secret seed: drawn from OS entropy by default, kept private in the workdir.

DP is a statement about randomness the adversary does not know. Sampling,
truncation, noise and initialisation all derive from one seed, so a seed the
adversary knows (the config's, a default) makes the released parameters a
deterministic function of the data: rerunning on D and on D minus one record
tells them apart. So, with `config.seed = None` (the default):

* a fresh run draws 63 bits from `secrets` (the OS's CSPRNG) and stores them in
  `<workdir>/private/seed.json` (mode 0600) before any compute;
* a resumed run reads that file back, so resume stays exact.

A seed given in the config is used as is, but the guarantee then requires that
seed to be secret (the trainer says so at start and on the `Final:` line), and
runs of a sweep must use different seeds (two runs sharing a seed share their
noise, so their difference is noise-free; `dpjax.trainer.workdir.seed_record` names a second
run with one given seed at its start and refuses its export). The seed is never written to
`config.json`, checkpoint metadata or an export; fingerprints hold its SHA-256.
On several hosts process 0 draws it and broadcasts it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, TypeVar

from dpjax.privacy import prng
from dpjax.trainer.workdir import write_errors
from dpjax.trainer.workdir.atomic_write import write_text_atomically

PRIVATE_DIR = 'private'
SEED_FILE = 'seed.json'
SOURCES = ('drawn', 'workdir', 'config')
T = TypeVar('T')


@dataclasses.dataclass(frozen=True)
class RunSeed:
  """The resolved seed and where it came from ('drawn', 'workdir' or 'config')."""

  value: int
  source: str

  @property
  def is_secret(self) -> bool:
    """Drawn from OS entropy (now or by the run being resumed), not read from a config."""
    return self.source != 'config'

  def describe(self, workdir: str) -> str:
    """One line for the start of a run."""
    if self.is_secret:
      return (
        f'Seed: drawn from OS entropy, kept in {seed_path(workdir)} (keep the workdir '
        'private; publish only `python -m dpjax.export`).'
      )
    return (
      f'Seed: {self.value}, given by the config: the privacy guarantee holds only if this '
      'seed is secret, and every run of a sweep needs its own seed (unset `seed` to '
      'draw one).'
    )


def seed_path(workdir: str) -> str:
  return os.path.join(workdir, PRIVATE_DIR, SEED_FILE)


def read_private_record(path: str, parse: Callable[[Any], T], what: str, then: str) -> T | None:
  """`parse` of the JSON in `path` (a file under private/), or None if there is none.

  ValueError ('<path>: unreadable <what> (<error>); <then>') if it cannot be read or parsed
  (`parse` raises ValueError, KeyError or TypeError on a damaged record).
  """
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return parse(json.load(f))
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f'{path}: unreadable {what} ({type(e).__name__}); {then}') from None


def _parse_seed(record: dict) -> RunSeed:
  value, source = int(record['seed']), record['source']
  if source not in SOURCES or not 0 <= value < 2**63:
    raise ValueError(record)
  return RunSeed(value, 'workdir' if source != 'config' else 'config')


def stored_seed(workdir: str) -> RunSeed | None:
  """The seed a run in `workdir` stored, or None. ValueError if the file is damaged."""
  return read_private_record(
    seed_path(workdir),
    _parse_seed,
    'seed record',
    'it is needed to resume this run exactly. Restore it, or use a new --workdir.',
  )


def resolve_seed(config_seed: int | None, workdir: str) -> RunSeed:
  """The config's seed, else the workdir's stored one, else a freshly drawn one.

  A given seed that differs from the stored one is not an error here: the privacy
  fingerprint (which holds the seed's SHA-256) refuses the resume.
  """
  if config_seed is not None:
    return RunSeed(int(config_seed), 'config')
  stored = stored_seed(workdir)
  if stored is not None:
    return stored
  return RunSeed(prng.draw_seed(), 'drawn')


def store_seed(workdir: str, seed: RunSeed) -> None:
  """Writes private/seed.json (0600) unless it already holds this seed."""
  existing = stored_seed(workdir)
  if existing is not None and existing.value == seed.value:
    return
  directory = os.path.join(workdir, PRIVATE_DIR)
  with write_errors.writing('the run seed', directory):
    os.makedirs(directory, mode=0o700, exist_ok=True)
  source = 'config' if seed.source == 'config' else 'drawn'
  write_text_atomically(
    seed_path(workdir),
    json.dumps(
      {
        'seed': seed.value,
        'source': source,
        'note': 'Secret: the privacy guarantee of this run needs it. Never publish it.',
      }
    )
    + '\n',
    mode=0o600,
    what='the run seed',
  )


def broadcast_seed(seed: RunSeed) -> RunSeed:
  """Process 0's seed on every process of a multi-host run (each would draw its own)."""
  import jax  # pylint: disable=import-outside-toplevel

  if jax.process_count() == 1:
    return seed
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  words = np.asarray([seed.value >> 32, seed.value & 0xFFFFFFFF], np.uint32)
  words = np.asarray(multihost_utils.broadcast_one_to_all(words))
  return RunSeed((int(words[0]) << 32) | int(words[1]), seed.source)
