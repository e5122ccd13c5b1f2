"""What checkpoint manifests cost: save and restore with and without SHA-256, as JSON.

  python scripts/bench_checkpoint_integrity.py   # writes scripts/results/checkpoint_integrity.json
  python scripts/bench_checkpoint_integrity.py --megabytes 64 --repeats 3

For a float32 state of the given size, the median over repeats of
  * a complete save (save + wait until committed) with dpjax's manager (which
    hashes every file before orbax renames the step into place) and with a
    plain orbax CheckpointManager of the same options;
  * a restore preceded by `verify_checkpoint`, and `verify_checkpoint` alone;
and the ratios dpjax / plain orbax and verify / restore.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from dpjax.trainer.workdir import checkpoints
from dpjax_bench import provenance
from dpjax.trainer.workdir import manifest


def _median_seconds(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), times


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--megabytes', type=int, default=128)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument(
    '--out', default=os.path.join(os.path.dirname(__file__), 'results', 'checkpoint_integrity.json')
  )
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  leaves = 8
  size = args.megabytes * 2**20 // 4 // leaves
  state = {f'w{i}': rng.standard_normal(size, dtype=np.float32) for i in range(leaves)}
  target = jax.tree.map(np.zeros_like, state)
  args_for = lambda: ocp.args.Composite(
    state=ocp.args.StandardSave(state), metadata=ocp.args.JsonSave({'step': 0})
  )
  with tempfile.TemporaryDirectory() as root:
    dpjax_manager = checkpoints.make_manager(os.path.join(root, 'dpjax'), 1)
    plain_manager = ocp.CheckpointManager(
      os.path.join(root, 'plain', 'checkpoints'),
      item_names=checkpoints.ITEMS,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=1, create=True, enable_async_checkpointing=True
      ),
    )
    step = iter(range(1, 10**6))

    def save_dpjax():
      checkpoints.save(dpjax_manager, next(step), state, {'step': 0})
      checkpoints.wait_until_finished(dpjax_manager)

    def save_plain():
      plain_manager.save(next(step), args=args_for(), force=True)
      plain_manager.wait_until_finished()

    save_plain(), save_dpjax()  # Warm-up (first save creates directories, compiles nothing).
    results = {'save_plain_orbax_samples': [], 'save_dpjax_samples': []}
    for _ in range(args.repeats):  # Round-robin: load from other jobs falls on both alike.
      for name, fn in (('save_plain_orbax', save_plain), ('save_dpjax', save_dpjax)):
        results[name + '_samples'].append(_median_seconds(fn, 1)[0])
    for name in ('save_plain_orbax', 'save_dpjax'):
      results[name + '_seconds'] = statistics.median(results[name + '_samples'])
    latest = dpjax_manager.latest_step()
    step_dir = os.path.join(str(dpjax_manager.directory), str(latest))
    restore = lambda: dpjax_manager.restore(
      latest, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
    )
    results['restore_seconds'], results['restore_samples'] = _median_seconds(restore, args.repeats)
    results['verify_seconds'], results['verify_samples'] = _median_seconds(
      lambda: manifest.verify_checkpoint(step_dir), args.repeats
    )
  results.update(
    megabytes=args.megabytes,
    repeats=args.repeats,
    save_ratio_dpjax_over_plain=(
      results['save_dpjax_seconds'] / results['save_plain_orbax_seconds']
    ),
    verify_over_restore=results['verify_seconds'] / results['restore_seconds'],
    machine=provenance.machine(),
    git=provenance.git_state(),
  )
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(results, f, indent=2)
  print(json.dumps({k: v for k, v in results.items() if not k.endswith('_samples')}, indent=2))


if __name__ == '__main__':
  sys.exit(main())
