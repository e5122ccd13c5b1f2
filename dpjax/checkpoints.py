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
that is complete but unreadable (corrupt files) is reported, moved aside to
`<step>.unreadable-<time>`, and the previous one is used.

Data-parallel runs (`dpjax.sharding`) save the state replicated over the
device mesh; every process of a multi-host job takes part in a save (orbax
writes each replicated array once), so the workdir must be on a file system
all hosts share. `restore_latest` restores onto the shardings of its
`target`, so a run resumes on any device count: the restored values are the
saved ones bit for bit, and later steps match the original device count up to
float reduction order (exactly, on the same count). Restoring without a target
(`StandardRestore()`) only works on the devices that saved it.

List a workdir's checkpoints:
  python -m dpjax.checkpoints <workdir>
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

CHECKPOINT_DIR = 'checkpoints'
ITEMS = ('state', 'metadata')


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)


def make_manager(workdir: str, keep: int, *, read_only: bool = False) -> ocp.CheckpointManager:
  """A manager that keeps the last `keep` checkpoints and saves asynchronously."""
  if not read_only and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
    raise ValueError(f'keep_checkpoints must be an integer >= 1, got {keep!r}.')
  options = ocp.CheckpointManagerOptions(
      max_to_keep=None if read_only else keep, create=not read_only,
      enable_async_checkpointing=not read_only, read_only=read_only)
  return ocp.CheckpointManager(checkpoint_dir(workdir), options=options, item_names=ITEMS)


def save(manager: ocp.CheckpointManager, step: int, state: Any, metadata: dict) -> None:
  """Starts an asynchronous save of `state` with its privacy `metadata`."""
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), metadata=ocp.args.JsonSave(metadata)), force=True)


def restore_latest(manager: ocp.CheckpointManager, target: Any) -> tuple[int, Any, dict] | None:
  """(step, state, metadata) of the newest readable checkpoint, or None.

  `target` is a state with the right structure and the shardings to restore
  onto (e.g. the freshly initialised, replicated one). Unreadable checkpoints
  are logged with the reason and skipped; process 0 moves them aside.
  """
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      restored = manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), metadata=ocp.args.JsonRestore()))
    except Exception as e:  # Orbax raises many types for damaged files.
      # Keep the damaged files for inspection, out of the way of a new save at this step.
      path = os.path.join(str(manager.directory), str(step))
      aside = f'{path}.unreadable-{int(time.time())}'
      if jax.process_index() == 0:  # One host renames the shared directory.
        os.rename(path, aside)
      message = (f'checkpoint {step} is unreadable ({type(e).__name__}: {e}); moved it to '
                 f'{aside} and falling back to the previous one.')
      logging.warning(message)
      print(f'WARNING: {message}', file=sys.stderr)
      manager.reload()
      continue
    return step, restored['state'], restored['metadata']
  return None


def read_state(workdir: str, step: int) -> dict:
  """The state saved at `step` as host numpy arrays, whatever devices and hosts saved it.

  For inspection and export; no target structure or device mesh is needed.
  """
  path = os.path.join(checkpoint_dir(workdir), str(step), 'state')
  if not os.path.isdir(path):
    raise ValueError(f'No checkpoint at step {step} in {checkpoint_dir(workdir)}.')
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


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog='python -m dpjax.checkpoints',
      description="List a workdir's checkpoints with their step, ε and kind of bound.")
  parser.add_argument('workdir')
  parser.add_argument('--json', action='store_true', help='print the metadata as JSON lines')
  args = parser.parse_args(argv)
  rows = read_metadata(args.workdir)
  if not rows:
    print(f'No checkpoints in {checkpoint_dir(args.workdir)}.', file=sys.stderr)
    return 1
  if args.json:
    for row in rows:
      print(json.dumps(row))
    return 0
  print(f"{'step':>8}  {'epsilon':>10}  {'delta':>8}  {'bound':<24}  {'accountant':<28}  sampler")
  for row in rows:
    if 'error' in row:
      print(f"{row['step']:>8}  {row['error']}")
      continue
    privacy = row.get('privacy', {})
    eps = privacy.get('epsilon')
    eps_text = 'n/a' if eps is None else f'{eps:.4f}'
    print(f"{row['step']:>8}  {eps_text:>10}  {privacy.get('delta', float('nan')):>8.1e}  "
          f"{str(privacy.get('bound')):<24}  {str(privacy.get('accountant')):<28}  "
          f"{row.get('sampler', {}).get('name')}")
  return 0


if __name__ == '__main__':
  sys.exit(main())
