"""How fast the command lines answer --help, against `import jax`, in one run (issue 35, item 7).

  python scripts/bench_cli_start.py              # writes scripts/results/cli_start.json
  python scripts/bench_cli_start.py --repeats 3

Each command is a fresh `python` process, timed from start to exit; the commands are
interleaved (each round in a rotated order, so that a load spike on a shared machine falls on
all of them alike) and each one's median over the rounds is reported, with the ratio to the
median of `python -c "import jax"` and of a bare `python -c pass` (the interpreter's own start).
Target: `python -m dpjax.account --help` <= 0.5x `import jax`. That no --help imports jax at
all is tests/e2e/test_cli_start.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from dpjax.utils.child_env import child_env
from dpjax_bench import provenance

COMMANDS = {
  'account --help': ['-m', 'dpjax.account', '--help'],
  'train --help': ['-m', 'dpjax.train', '--help'],
  'export --help': ['-m', 'dpjax.export', '--help'],
  'planner --help': ['-m', 'dpjax.planner', '--help'],
  'import jax': ['-c', 'import jax'],
  'python (no import)': ['-c', 'pass'],
}
TARGET = 0.5  # account --help / import jax.


def _seconds(args: list[str]) -> float:
  start = time.perf_counter()
  subprocess.run(
    [sys.executable, *args],
    cwd=provenance.REPO,
    env=child_env(),
    check=True,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  return time.perf_counter() - start


def measure(repeats: int) -> dict[str, list[float]]:
  """name -> wall seconds of each round; round r starts at the r-th command."""
  names, times = list(COMMANDS), {name: [] for name in COMMANDS}
  _seconds(COMMANDS['import jax'])  # Warm the file cache once, for every command alike.
  for r in range(repeats):
    for name in names[r % len(names) :] + names[: r % len(names)]:
      times[name].append(_seconds(COMMANDS[name]))
  return times


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument(
    '--out', default=os.path.join(provenance.REPO, 'scripts', 'results', 'cli_start.json')
  )
  args = parser.parse_args()
  load_before = provenance.load_average()
  times = measure(args.repeats)
  median = {name: statistics.median(t) for name, t in times.items()}
  jax_s = median['import jax']
  record = {
    'median_seconds': {name: round(s, 4) for name, s in median.items()},
    'ratio_to_import_jax': {name: round(s / jax_s, 3) for name, s in median.items()},
    'target': f'account --help <= {TARGET} x import jax',
    'target_met': median['account --help'] <= TARGET * jax_s,
    'repeats': args.repeats,
    'seconds': {name: [round(s, 4) for s in t] for name, t in times.items()},
    'machine': dict(provenance.machine(), load_average_before=load_before),
    'git': provenance.git_state(),
    'time': time.strftime('%Y-%m-%d %H:%M:%S'),
  }
  provenance.write_json(args.out, record)
  for name, s in median.items():
    print(f'{name:<20} {s:7.3f} s  ({s / jax_s:.2f}x import jax)')
  met = 'met' if record['target_met'] else 'NOT met'
  print(f'target account --help <= {TARGET}x import jax: {met} ({args.out})')
  return 0


if __name__ == '__main__':
  sys.exit(main())
