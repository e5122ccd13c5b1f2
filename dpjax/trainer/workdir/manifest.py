"""The integrity manifest of a checkpoint: size and SHA-256 of each of its files.

Each checkpoint holds `dpjax_manifest.json`, the size and SHA-256 of every
file in it, and `restore_latest` verifies it before restoring, so a
flipped byte anywhere in `state/` or `metadata/` takes the move-aside path
instead of being restored silently. The manifest is written by orbax's
post-finalisation callback, i.e. after every item (of every process) is
written and *before* the temporary directory is renamed into place, through
tmp + fsync + rename: a crash at any point leaves either a temporary
directory (not a checkpoint; removed at the next start) or a checkpoint with
its manifest. Orbax's own `_CHECKPOINT_METADATA` (commit timestamp) and
top-level `commit_success.txt` are written after the callback and are not
covered; they hold no state. A checkpoint without a manifest can only come
from a dpjax version before manifests: it is restored with an "unverified"
warning rather than discarded.
"""

import hashlib
import json
import os
from typing import Any

from dpjax.trainer.workdir.atomic_write import write_text_atomically

MANIFEST = 'dpjax_manifest.json'
# Written by orbax after the manifest (commit time, success marker); they hold no state.
UNHASHED = frozenset({MANIFEST, '_CHECKPOINT_METADATA', 'commit_success.txt'})


class CheckpointCorruptError(ValueError):
  """A checkpoint's files differ from its manifest (the message names the first file)."""


def _file_digests(step_dir: str) -> dict[str, dict[str, Any]]:
  """{relative path: {'size', 'sha256'}} of every file under `step_dir` (streamed)."""
  digests = {}
  for root, dirs, files in os.walk(step_dir):
    dirs.sort()
    for name in sorted(files):
      path = os.path.join(root, name)
      relative = os.path.relpath(path, step_dir)
      if relative in UNHASHED:
        continue
      with open(path, 'rb') as f:
        digest = hashlib.file_digest(f, 'sha256').hexdigest()
      digests[relative] = {'size': os.path.getsize(path), 'sha256': digest}
  return digests


def write_manifest(step_dir: str) -> None:
  """Writes `<step_dir>/dpjax_manifest.json`: size and SHA-256 of each file (see module doc)."""
  manifest = {'format': 1, 'algorithm': 'sha256', 'files': _file_digests(step_dir)}
  write_text_atomically(os.path.join(step_dir, MANIFEST), json.dumps(manifest, indent=1))


def verify_checkpoint(step_dir: str) -> bool:
  """True if every file matches the manifest, False if there is no manifest (unverified).

  Raises `CheckpointCorruptError` naming the first missing or differing file.
  """
  try:
    with open(os.path.join(step_dir, MANIFEST)) as f:
      expected = json.load(f)['files']
  except FileNotFoundError:
    return False
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointCorruptError(f'{MANIFEST} is unreadable ({e})') from None
  actual = _file_digests(step_dir)
  for relative, want in sorted(expected.items()):
    got = actual.get(relative)
    if got is None:
      raise CheckpointCorruptError(f'{relative} is missing')
    if got != want:
      raise CheckpointCorruptError(
        f'{relative} differs from the manifest (size {got["size"]} vs {want["size"]}, '
        f'sha256 {got["sha256"][:12]}… vs {want["sha256"][:12]}…)'
      )
  return True
