"""How much does the default run's accuracy vary with its seed? `make train`'s config, N seeds.

  python scripts/default_run_spread.py [--seeds 20] [--out F] [-- --config.f=v ...]
                                      # writes results/default_run_spread.json

Each seed is one `python -m dpjax.train --config configs/digits_mlp.py` in a fresh temporary
workdir, with `--config.seed=k` (k = 1..N; `make train` draws its seed in secret, so a given
seed stands for one draw). The last line of the run is its `Final:` line: the test accuracy
and ε are read from it. Prints one JSON object (mean, min, max accuracy; ε) as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINAL = re.compile(r'Final: step (\d+), test accuracy ([0-9.]+), ε = ([0-9.]+)')


def run(seed: int, state_dir: str, overrides: list[str] = ()) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    env = dict(os.environ, DPJAX_STATE_DIR=state_dir)
    start = time.perf_counter()
    out = subprocess.run(
      [
        sys.executable,
        '-m',
        'dpjax.train',
        '--config=configs/digits_mlp.py',
        f'--workdir={workdir}',
        f'--config.seed={seed}',
        *overrides,
      ],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      check=True,
    ).stdout
  steps, accuracy, epsilon = FINAL.search(out).groups()
  return {
    'seed': seed,
    'steps': int(steps),
    'accuracy': float(accuracy),
    'epsilon': float(epsilon),
    'seconds': time.perf_counter() - start,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', type=int, default=20)
  parser.add_argument('overrides', nargs='*', help='--config.<field>=<value> flags to try')
  parser.add_argument(
    '--out', default=os.path.join(REPO, 'scripts', 'results', 'default_run_spread.json')
  )
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as state_dir:
    runs = []
    for seed in range(1, args.seeds + 1):
      runs.append(run(seed, state_dir, args.overrides))
      print(json.dumps(runs[-1]), flush=True)
  accuracies = [r['accuracy'] for r in runs]
  summary = {
    'seeds': args.seeds,
    'overrides': args.overrides,
    'mean_accuracy': statistics.mean(accuracies),
    'min_accuracy': min(accuracies),
    'max_accuracy': max(accuracies),
    'epsilon': sorted({r['epsilon'] for r in runs}),
    'steps': runs[0]['steps'],
  }
  with open(args.out, 'w') as f:
    json.dump({'summary': summary, 'runs': runs}, f, indent=1)
  print(json.dumps(summary))


if __name__ == '__main__':
  main()
