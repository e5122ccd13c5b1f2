"""Restoring one checkpoint: verified against its manifest, compared with the run's state.

A checkpoint's files are first checked against its SHA-256 manifest (`dpjax.trainer.workdir.manifest`),
then its saved tree against the run's state (paths and shapes): a readable checkpoint of
another structure (the model or the optimizer changed) is not corrupt, and is refused with one
line, untouched (`CheckpointMismatchError`); a corrupt one is returned as its error, for
`checkpoints.restore_latest` to move aside and try the previous one.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp

from dpjax.trainer.workdir import manifest
from dpjax.trainer.workdir import write_errors


class CheckpointMismatchError(ValueError):
  """A readable checkpoint holds a state of another structure than the run's (model or
  optimizer changed): not corruption; refused with one line, the checkpoint untouched."""


def _key_name(key) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _shapes(tree) -> dict[tuple[str, ...], tuple[int, ...]]:
  """{path: shape} of the array leaves of a state or of a checkpoint's saved tree."""
  return {
    tuple(_key_name(k) for k in path): tuple(getattr(leaf, 'shape', ()))
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


_PARTS = {'params': 'model parameters', 'opt_state': 'optimizer state', 'ema': 'EMA parameters'}


def state_mismatch(saved_tree, target) -> str:
  """'' if the saved tree has the target's paths and shapes, else what differs, by part."""
  saved, want = _shapes(saved_tree), _shapes(target)
  if saved == want:
    return ''
  parts = {}
  for path in sorted(set(saved) | set(want)):
    if saved.get(path) == want.get(path):
      continue
    old = 'absent' if path not in saved else str(saved[path])
    new = 'absent' if path not in want else str(want[path])
    parts.setdefault(_PARTS.get(path[0], path[0]), []).append(
      f'{"/".join(path[1:]) or path[0]} {old} → {new}'
    )
  return '; '.join(
    f'{part} differ ({", ".join(items[:3])}'
    f'{f" and {len(items) - 3} more" if len(items) > 3 else ""})'
    for part, items in parts.items()
  )


def _saved_tree(path: str):
  return ocp.PyTreeCheckpointer().metadata(os.path.join(path, 'state')).item_metadata.tree


class CheckpointUnreadableError(ValueError):
  """Every checkpoint of the workdir is unreadable: a resume would silently start at step 0.
  One line saying what to do; nothing moved."""


def restore_step(manager: ocp.CheckpointManager, step: int, target: Any):
  """(state, metadata) of checkpoint `step`, or the error that makes it corrupt.

  CheckpointMismatchError (raised) for a readable checkpoint of another structure.
  """
  path = os.path.join(str(manager.directory), str(step))
  verified = False  # Its files match the manifest (a later failure is not corruption).
  try:
    verified = manifest.verify_checkpoint(path)
    if not verified:
      message = (
        f'checkpoint {step} has no {manifest.MANIFEST} (written before dpjax kept '
        'checksums); restoring it unverified.'
      )
      logging.warning(message)
      print(f'WARNING: {message}', file=sys.stderr)
    mismatch = state_mismatch(_saved_tree(path), target)
    if mismatch:
      raise CheckpointMismatchError(
        f'checkpoint {step} in {manager.directory} holds a state of another structure than '
        f'this config builds: {mismatch}. The model or the optimizer changed since the run '
        'started; restore them, or use a new --workdir to start fresh (the checkpoint is '
        'untouched).'
      )
    restored = manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), metadata=ocp.args.JsonRestore()
      ),
    )
  except CheckpointMismatchError:
    raise
  except Exception as e:  # Orbax raises many types for damaged files.
    if write_errors.is_full(e):  # Not the checkpoint's fault.
      raise write_errors.WriteError(
        f'cannot restore checkpoint {step} ({path}): no space left on device. {write_errors.RERUN}'
      ) from None
    if verified:
      raise CheckpointMismatchError(
        f'checkpoint {step} passed its checksums but could not be restored onto this '
        f"config's state ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
        'it is untouched. Restore the settings it was written with, or use a new '
        '--workdir.'
      ) from None
    return e
  return restored['state'], restored['metadata']
