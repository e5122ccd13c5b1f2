"""Experiment 5: the batch size planner at fixed (ε, δ, epochs) (seed 003, accounting.md §8).

  python experiments/05_batch_size_planner/run.py           # N = 60000, ε ∈ {1, 3, 8}
  python experiments/05_batch_size_planner/run.py --quick   # ε = 3 only, 5 batch sizes

MNIST-sized run: N = 60000, δ = 1e-5, E = 10 epochs, Poisson sampling, C = 1,
physical batch P = 256 (it sets the automatic cap B). For each ε and each b
in 32, 64, …, 32768, 60000 the σ is what `dpjax.train` would calibrate:
`dpjax.trainer.planning.batch_size_plan.plan_batch_sizes`, i.e. `plan.make_accountant` on the
run's config with σ unset. Reported per b: σ, σ·C/b (noise std on the
averaged gradient), σ/(q·√S) (noise of the whole run), the attached ε.

Reference (dashed): the shuffle sampler, whose only provable ε is that of
the deterministic order (no amplification, accounting.md §3): σ is the same
for every b, so it is the "no subsampling amplification" line. Poisson at
b = N (q = 1) is the same mechanism, so the two meet there.

Writes results.json and noise_vs_batch_size.png next to this file; results
are saved after each ε, and --resume skips the ε already in results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dpjax import planner
from dpjax_bench import provenance
import plot_plans  # Beside this file: plotting stays out of the library.
from dpjax.trainer.planning import batch_size_plan

HERE = os.path.dirname(os.path.abspath(__file__))
NUM_EXAMPLES = 60_000
DELTA = 1e-5
NUM_EPOCHS = 10
PHYSICAL_BATCH_SIZE = 256
EPSILONS = (1.0, 3.0, 8.0)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--quick', action='store_true', help='ε = 3 only, 5 batch sizes')
  p.add_argument('--resume', action='store_true', help='keep the ε already in results.json')
  p.add_argument('--out', default=HERE, help='output directory')
  args = p.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  epsilons = (3.0,) if args.quick else EPSILONS
  sizes = (
    [64, 512, 4096, 32768, NUM_EXAMPLES]
    if args.quick
    else batch_size_plan.default_batch_sizes(NUM_EXAMPLES)
  )
  path = os.path.join(args.out, 'results.json')
  results = {
    'setting': dict(
      num_examples=NUM_EXAMPLES,
      delta=DELTA,
      num_epochs=NUM_EPOCHS,
      physical_batch_size=PHYSICAL_BATCH_SIZE,
      clip_norm=1.0,
      batch_sizes=sizes,
      epsilons=list(epsilons),
    ),
    'machine': dict(provenance.machine(), git=provenance.git_state()),  # Load: at the start.
    'poisson': [],
    'shuffle_reference': [],
  }
  if args.resume and os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if old['setting'] == results['setting']:
      results['poisson'], results['shuffle_reference'] = old['poisson'], old['shuffle_reference']
      results['machine'] = old['machine']
  done = {d['target_epsilon'] for d in results['poisson']}
  for eps in epsilons:
    if eps in done:
      continue
    for name, key in (('poisson', 'poisson'), ('shuffle', 'shuffle_reference')):
      config = batch_size_plan.base_config(sampler=name, physical_batch_size=PHYSICAL_BATCH_SIZE)
      plan = batch_size_plan.plan_batch_sizes(
        NUM_EXAMPLES,
        eps,
        DELTA,
        NUM_EPOCHS,
        sizes,
        config=config,
        progress=lambda r, name=name, eps=eps: print(
          f'{name} ε={eps:g} b={r.batch_size}: σ={r.noise_multiplier:.4f} '
          f'ε_att={r.epsilon:.4f} ({r.seconds:.1f} s wall, {r.cpu_seconds:.1f} s CPU)',
          file=sys.stderr,
          flush=True,
        ),
      )
      results[key].append(plan.to_dict())
      with open(path, 'w') as f:
        json.dump(results, f, indent=2)
  plans = [batch_size_plan.Plan.from_dict(d) for d in results['poisson']]
  reference = [batch_size_plan.Plan.from_dict(d) for d in results['shuffle_reference']]
  # Derived fields (best b, message) from the current planner, also for resumed results.
  results['poisson'] = [plan.to_dict() for plan in plans]
  results['shuffle_reference'] = [plan.to_dict() for plan in reference]
  if len(done) < len(epsilons):
    results['machine']['load_average_at_end'] = os.getloadavg()
  with open(path, 'w') as f:
    json.dump(results, f, indent=2)
  for plan in plans:
    print(batch_size_plan.format_table(plan), end='\n\n')
  png = os.path.join(args.out, 'noise_vs_batch_size.png')
  plot_plans.plot_plans(
    plans, png, reference=reference, reference_note=' (provable bound: no amplification)'
  )
  print(f'wrote {path} and {png}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
