"""Checkpoints that carry their privacy guarantee, and exact resume.

Each checkpoint under `<workdir>/checkpoints/<step>/` holds two items written
by one `orbax.checkpoint.CheckpointManager`:

* `state`: the training state (params, optimiser state, step, truncation
  count): everything the loop needs, since the sampler and the noise are pure
  functions of (seed, step);
* `metadata`: JSON with the privacy claim for exactly this state: step, ε, δ,
  the accountant and its kind of bound (`upper`, `high_probability_upper`,
  `lower`), the sampler and its parameters, σ, C, N, the truncation count,
  the seed, and the resolved config.

Orbax writes each step into a temporary directory and renames it when it is
complete, so an interrupted save never looks like a checkpoint. A checkpoint
that is complete but unreadable (corrupt files) is reported (`checkpoint_restore`), moved aside to
`<step>.unreadable-<time>`, and the previous one is used; when no checkpoint
is readable the resume is refused (one line), never restarted from step 0.

Integrity: every checkpoint holds a SHA-256 manifest of its files, written
before the checkpoint is committed and verified before it is restored
(`dpjax.trainer.workdir.manifest`).

A failed save (e.g. disk full) raises `CheckpointSaveError` with one line
(which step, why, which checkpoint is still intact), after removing the
failed save's temporary directory; earlier checkpoints are untouched because
orbax deletes old steps only after a save completes.

Data-parallel runs (`dpjax.privacy.sharding`) save the state replicated over the
device mesh; every process of a multi-host job takes part in a save (orbax
writes each replicated array once), so the workdir must be on a file system
all hosts share. `restore_latest` restores onto the shardings of its
`target`, so a run resumes on any device count: the restored values are the
saved ones bit for bit, and later steps match the original device count up to
float reduction order (exactly, on the same count). Restoring without a target
(`StandardRestore()`) only works on the devices that saved it.

The command line that lists a workdir's checkpoints is `dpjax.checkpoints`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.futures import future as orbax_future

from dpjax.trainer.workdir import checkpoint_restore
from dpjax.trainer.workdir import manifest
from dpjax.trainer.workdir import write_errors

CHECKPOINT_DIR = 'checkpoints'
ITEMS = ('state', 'metadata')
TMP_MARKER = '.orbax-checkpoint-tmp'
# The threads orbax 0.12.x writes a save's items with (a private class: pinned in constraints.txt).
_ORBAX_WRITER = orbax_future._SignalingThread  # pylint: disable=protected-access


class CheckpointSaveError(write_errors.WriteError):
  """A checkpoint could not be written; the message is one line (step, cause, what is intact)."""


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)


def temporary_checkpoints(workdir: str) -> list[str]:
  """Paths of unfinished (temporary) checkpoint directories left under `workdir`."""
  directory = checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    return []
  return sorted(
    os.path.join(directory, name) for name in os.listdir(directory) if TMP_MARKER in name
  )


def remove_temporary_checkpoints(workdir: str) -> list[str]:
  """Deletes unfinished checkpoint directories (a failed or interrupted save); returns them.

  Call with no save in flight (after `wait_until_finished`), on process 0 only.
  """
  removed = temporary_checkpoints(workdir)
  for path in removed:
    shutil.rmtree(path, ignore_errors=True)
  return removed


def remove_temporary_checkpoints_until_gone(workdir: str, deadline: float) -> None:
  """`remove_temporary_checkpoints` until none is left for 0.2 s (or `deadline`, a time.time()).

  After a failed save, writes already queued in tensorstore's own (C++) threads may recreate
  files in the temporary directory after it was removed (seen under load: the full-disk test
  found `2.orbax-checkpoint-tmp` after the error)."""
  while True:
    remove_temporary_checkpoints(workdir)
    time.sleep(0.2)
    if not temporary_checkpoints(workdir) or time.time() > deadline:
      return


def _disk_full(error: BaseException) -> bool:
  """A full disk, as an OSError or as tensorstore's RESOURCE_EXHAUSTED message."""
  return write_errors.is_full(error) or (
    'No space left on device' in str(error) or "os_error_code='28'" in str(error)
  )


class _QuietOrbaxErrors(logging.Filter):
  """Drops orbax's tracebacks of background save failures, and asyncio's reports of a failed
  save's writes ('Task exception was never retrieved': a full disk): `save` and
  `wait_until_finished` raise them as one `CheckpointSaveError` line."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR or record.exc_info is None:
      return True
    if record.name == 'asyncio':
      return not _disk_full(record.exc_info[1])
    return f'{os.sep}orbax{os.sep}' not in record.pathname


_QUIET_ORBAX_ERRORS = _QuietOrbaxErrors()


class _QuietClosedLoop:
  """`sys.unraisablehook` that drops 'Event loop is closed': when a save fails (a full disk),
  orbax closes its event loop while tensorstore still completes the save's other writes, and
  their callbacks print that traceback; the failure itself is one `CheckpointSaveError` line."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, unraisable) -> None:
    if not (
      issubclass(unraisable.exc_type, RuntimeError)
      and str(unraisable.exc_value) == 'Event loop is closed'
    ):
      self.previous(unraisable)


class Manager(ocp.CheckpointManager):
  """orbax's CheckpointManager that writes each step's manifest before the step is committed.

  Orbax runs one save at a time; `save` waits for the previous one before
  recording `pending_step`, so the post-finalisation callback (which takes no
  arguments) knows which temporary directory to hash.
  """

  def __init__(self, workdir: str, options: ocp.CheckpointManagerOptions):
    self.pending_step: int | None = None
    self._directory_path = checkpoint_dir(workdir)
    if not options.read_only:
      options = dataclasses.replace(
        options, async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest)
      )
    super().__init__(self._directory_path, options=options, item_names=ITEMS)

  def save(self, step: int, *args, **kwargs) -> bool:
    self.wait_until_finished()  # Its callback must not see the new step (orbax waits anyway).
    self.pending_step = step
    return super().save(step, *args, **kwargs)

  def _write_manifest(self) -> None:
    """Runs on process 0 after all processes wrote the step, before the rename into place."""
    step = self.pending_step
    candidates = [
      path
      for path in temporary_checkpoints(os.path.dirname(self._directory_path))
      if re.fullmatch(rf'{step}{re.escape(TMP_MARKER)}.*', os.path.basename(path))
    ]
    final = os.path.join(self._directory_path, str(step))
    if len(candidates) != 1 and not os.path.isdir(final):  # Commit-file storage: written in place.
      raise RuntimeError(f'cannot find the directory of checkpoint {step} to hash: {candidates}')
    manifest.write_manifest(candidates[0] if len(candidates) == 1 else final)


def make_manager(workdir: str, keep: int, *, read_only: bool = False) -> ocp.CheckpointManager:
  """A manager that keeps the last `keep` checkpoints and saves asynchronously.

  Unfinished temporary checkpoints of an earlier run are removed when it starts.
  """
  if not read_only and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
    raise ValueError(f'keep_checkpoints must be an integer >= 1, got {keep!r}.')
  options = ocp.CheckpointManagerOptions(
    max_to_keep=None if read_only else keep,
    create=not read_only,
    enable_async_checkpointing=not read_only,
    read_only=read_only,
  )
  if not read_only and jax.process_index() == 0:  # Before any save of this run can be in flight.
    remove_temporary_checkpoints(workdir)
  if _QUIET_ORBAX_ERRORS not in logging.getLogger('absl').filters:
    logging.getLogger('absl').addFilter(_QUIET_ORBAX_ERRORS)
    logging.getLogger('asyncio').addFilter(_QUIET_ORBAX_ERRORS)
  if not isinstance(sys.unraisablehook, _QuietClosedLoop):
    sys.unraisablehook = _QuietClosedLoop(sys.unraisablehook)
  with write_errors.writing('the checkpoints directory', checkpoint_dir(workdir)):
    return Manager(workdir, options)


def _save_error(
  manager: ocp.CheckpointManager, step: int | None, error: Exception
) -> CheckpointSaveError:
  """Removes the failed save's temporary directory; one line: what failed, what is intact."""
  # One failed write fails the save at once while orbax's other writer threads of the same
  # save may still be writing (and recreating directories): let them end first.
  deadline = time.time() + 60
  for thread in threading.enumerate():
    if isinstance(thread, _ORBAX_WRITER) and thread is not threading.current_thread():
      try:
        thread.join(max(0.0, deadline - time.time()))
      except Exception:  # pylint: disable=broad-except  # Its own failure: the same full disk.
        pass
  if jax.process_index() == 0:
    remove_temporary_checkpoints_until_gone(os.path.dirname(str(manager.directory)), deadline)
  text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  disk_full = _disk_full(error)
  manager.reload()
  intact = sorted(other for other in manager.all_steps() if other != step)
  cause = (
    f'no space left on device under {manager.directory}'
    if disk_full
    else f'{type(error).__name__}: {text}'
  )
  action = 'free space and ' if disk_full else ''
  kept = (
    f'the checkpoint at step {intact[-1]} is intact: {action}rerun the same command to '
    'resume from it'
    if intact
    else f'there is no earlier checkpoint: {action}rerun'
  )
  return CheckpointSaveError(f'checkpoint at step {step} could not be written ({cause}); {kept}.')


def wait_until_finished(manager: ocp.CheckpointManager) -> None:
  """Waits for the save in flight; a failure becomes one `CheckpointSaveError` line."""
  try:
    manager.wait_until_finished()
  except Exception as e:  # Orbax and tensorstore raise many types (ValueError for ENOSPC).
    raise _save_error(manager, getattr(manager, 'pending_step', None), e) from e


def save(manager: ocp.CheckpointManager, step: int, state: Any, metadata: dict) -> None:
  """Starts an asynchronous save of `state` with its privacy `metadata`.

  First waits for the previous save (orbax would anyway); a failure of either
  raises `CheckpointSaveError` (one line) with no temporary directory left.
  """
  wait_until_finished(manager)
  try:
    manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), metadata=ocp.args.JsonSave(metadata)
      ),
      force=True,
    )
  except Exception as e:
    raise _save_error(manager, step, e) from e


def restore_latest(manager: ocp.CheckpointManager, target: Any) -> tuple[int, Any, dict] | None:
  """(step, state, metadata) of the newest readable checkpoint, or None when there is none.

  `target` is a state with the right structure and the shardings to restore onto (e.g.
  the freshly initialised, replicated one). Each checkpoint is first checked against its
  manifest: a checkpoint whose files fail it (or, without a manifest, cannot be read) is
  corrupt, and the previous one is tried; once one restores, the corrupt newer ones are
  logged and moved aside by process 0 (`<step>.unreadable-<time>`). When none restores,
  `CheckpointUnreadableError` (one line, nothing moved): falling back to step 0 would
  silently train the run again from scratch. A readable checkpoint whose state has another
  structure than `target` (the model or the optimizer changed) is not corrupt:
  `CheckpointMismatchError` (one line), nothing moved.
  """
  unreadable = []  # (step, error), newest first.
  for step in sorted(manager.all_steps(), reverse=True):
    restored = checkpoint_restore.restore_step(manager, step, target)
    if isinstance(restored, Exception):
      unreadable.append((step, restored))
      continue
    for bad, error in unreadable:  # Kept for inspection, out of the way of a new save.
      path = os.path.join(str(manager.directory), str(bad))
      aside = f'{path}.unreadable-{int(time.time())}'
      if jax.process_index() == 0:  # One host renames the shared directory.
        os.rename(path, aside)
      message = (
        f'checkpoint {bad} is unreadable ({type(error).__name__}: {error}); moved it '
        f'to {aside} and resuming from checkpoint {step}, the newest readable one.'
      )
      logging.warning(message)
      print(f'WARNING: {message}', file=sys.stderr)
    if unreadable:
      manager.reload()
    return step, restored[0], restored[1]
  if unreadable:
    newest, error = unreadable[0]
    first_line = str(error).splitlines()[0] if str(error) else ''
    raise checkpoint_restore.CheckpointUnreadableError(
      f'checkpoint {newest} in {manager.directory} is unreadable ({type(error).__name__}: '
      f'{first_line}) and no earlier checkpoint is readable'
      f'{f" (steps {sorted(s for s, _ in unreadable)})" if len(unreadable) > 1 else ""}, so '
      'the run cannot resume. To train it again from step 0, move the checkpoints directory '
      'away (or use a new --workdir) and rerun; nothing was changed.'
    )
  return None


def read_state(workdir: str, step: int) -> dict:
  """The state saved at `step` as host numpy arrays, whatever devices and hosts saved it.

  For inspection and export; no target structure or device mesh is needed.
  Raises `manifest.CheckpointCorruptError` if the files differ from the manifest.
  """
  path = os.path.join(checkpoint_dir(workdir), str(step), 'state')
  if not os.path.isdir(path):
    raise ValueError(f'No checkpoint at step {step} in {checkpoint_dir(workdir)}.')
  manifest.verify_checkpoint(os.path.dirname(path))
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(path).item_metadata.tree
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))


def read_metadata(workdir: str) -> list[dict]:
  """The privacy metadata of every checkpoint in `workdir`, oldest first."""
  directory = checkpoint_dir(workdir)
  rows = []
  if not os.path.isdir(directory):
    return rows
  steps = sorted(int(name) for name in os.listdir(directory) if name.isdigit())
  for step in steps:
    path = os.path.join(directory, str(step), 'metadata', 'metadata')
    try:
      with open(path) as f:
        rows.append(json.load(f))
    except (OSError, ValueError) as e:
      rows.append({'step': step, 'error': f'unreadable metadata: {e}'})
  return rows
