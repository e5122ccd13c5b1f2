"""Accounting limits benchmark (issue 12 §2): time and peak memory of the cases that used to
exhaust memory or hang, each in a fresh subprocess (peak RSS is the child's own), as JSON.

  python scripts/bench_accounting_limits.py   # writes scripts/results/accounting_limits.json

Cases:
  * fixed_size_with_replacement, b = 256, N = 50,000, T = 2000, σ = 1, δ = 1e-5: ε (independent
    value 12.61 ± 3%), seconds (target < 30) and peak RSS (target < 2 GB); 05e2da3 tried to
    allocate ~24 GB (a ~1.3e8-point grid);
  * group_size k = 1024 > b = 256 for poisson, fixed_size and fixed_size_with_replacement: the
    seconds until the refusal (05e2da3: no output for minutes);
  * calibration with a too-small cap B = 300 (Poisson, N = 60,000, b = 256, one epoch, ε = 2):
    the seconds until the error that names the B needed.
Medians of --repeats runs (default 3).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

from dpjax.utils.child_env import child_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, resource, sys, time
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant, calibration
case = json.loads(sys.argv[1])
sampler = samplers.sampler_class(case['sampler'])(num_examples=case['n'], batch_size=case['b'])
start = time.perf_counter()
out = {}
try:
  if 'target_epsilon' in case:
    calibration.calibrate_noise_multiplier(sampler, case['target_epsilon'], case['delta'],
                                           case['steps'], max_batch_size=case['max_batch_size'])
  else:
    out['epsilon'] = accountant.Accountant(sampler, case['sigma'], case['delta'],
                                           group_size=case.get('k', 1),
                                           max_batch_size=None).epsilon(case['steps'])
except ValueError as e:
  out['error'] = str(e)
out['seconds'] = time.perf_counter() - start
out['peak_rss_mb'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""

CASES = {
  'fixed_size_with_replacement_b256': dict(
    sampler='fixed_size_with_replacement',
    n=50_000,
    b=256,
    steps=2000,
    sigma=1.0,
    delta=1e-5,
    reference_epsilon=12.61,
    target_seconds=30,
    target_peak_rss_mb=2048,
  ),
  **{
    f'group_size_1024_above_b256_{name}': dict(
      sampler=name, n=50_000, b=256, k=1024, steps=100, sigma=1.0, delta=1e-5
    )
    for name in ('poisson', 'fixed_size', 'fixed_size_with_replacement')
  },
  'calibration_cap_too_small': dict(
    sampler='poisson',
    n=60_000,
    b=256,
    steps=235,
    target_epsilon=2.0,
    delta=1e-5,
    max_batch_size=300,
  ),
}


def run_case(case: dict) -> dict:
  out = subprocess.run(
    [sys.executable, '-c', _CHILD, json.dumps(case)],
    capture_output=True,
    text=True,
    env=child_env(),
    cwd=REPO,
    timeout=600,
    check=True,
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument(
    '--out', default=os.path.join(REPO, 'scripts', 'results', 'accounting_limits.json')
  )
  args = parser.parse_args()
  results = {
    'machine': f'{platform.node()} ({os.cpu_count()} CPUs, shared), '
    f'load average {os.getloadavg()[0]:.1f} at start',
    'repeats': args.repeats,
    'cases': {},
  }
  for name, case in CASES.items():
    runs = [run_case(case) for _ in range(args.repeats)]
    summary = dict(
      case,
      runs=runs,
      median_seconds=statistics.median(r['seconds'] for r in runs),
      median_peak_rss_mb=statistics.median(r['peak_rss_mb'] for r in runs),
    )
    for key in ('epsilon', 'error'):
      if key in runs[0]:
        summary[key] = runs[0][key]
    results['cases'][name] = summary
    print(
      name,
      {k: summary.get(k) for k in ('epsilon', 'median_seconds', 'median_peak_rss_mb', 'error')},
      file=sys.stderr,
      flush=True,
    )
  with open(args.out, 'w') as f:
    json.dump(results, f, indent=2)
  print(f'wrote {args.out}', file=sys.stderr)


if __name__ == '__main__':
  main()
