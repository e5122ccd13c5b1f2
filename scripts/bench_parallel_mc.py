"""Speed-up of the balls-and-bins Monte-Carlo UCB with worker processes (issue 7).

  python scripts/bench_parallel_mc.py                    # 1e5 samples, workers 1 and 2, 3 repeats
  python scripts/bench_parallel_mc.py --samples 100000,200000 --workers 1,2 --repeats 3
  python scripts/bench_parallel_mc.py --plot-only        # redraw the PNG from the JSON

Setting (the Monte-Carlo case of scripts/bench_accounting.py): σ = 0.7, T = 1e4 steps, one
epoch, δ = 1e-4, importance sampling + order statistics, seed 0, confidence 1 − 1e-3:
`monte_carlo.balls_and_bins_epsilon(..., workers=n)`. Each (samples, workers) case is timed
`--repeats` times with the worker counts interleaved (1, 2, 1, 2, ...) so that load changes hit
every count alike; each call starts its own processes inside the timed region (startup
included). The ε must be the same for every worker count (checked: the chunks, their streams
and the order of their sums do not depend on it). Recorded per run: wall seconds, the calling
process's CPU seconds (wall well above CPU with one worker means the core was shared), the
workers' CPU seconds (their imports included), and the 1-minute load average before and after
(the machine is shared). `cpu_bound_seconds` = max(caller CPU, workers' CPU per worker) is the
wall time the run would take if every process had a core to itself: a model, not a measurement,
reported beside the measured speed-up for when the cores are busy with other work. With Linux
autogroup scheduling (recorded), the processes of one session share one session's CPU share,
so on a saturated machine extra workers cannot get more CPU: the measured speed-up is then
below 1 (the workers' imports), and only the model says what free cores would give.

Writes scripts/results/parallel_mc.json and scripts/results/parallel_mc.png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import sys
import time

from dpjax.privacy.accounting import monte_carlo
from dpjax_bench import provenance

SIGMA, NUM_STEPS, DELTA, BETA = 0.7, 10_000, 1e-4, 1e-3
METHOD = 'importance_order_statistics'
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')


def _log(*args):
  print(*args, file=sys.stderr, flush=True)


def _autogroup() -> str:
  """Linux `sched_autogroup_enabled`: if '1', the processes of one session share one CPU share."""
  try:
    with open('/proc/sys/kernel/sched_autogroup_enabled') as f:
      return f.read().strip()
  except OSError:
    return 'unknown'


def _children_cpu() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def _one_run(num_samples: int, workers: int) -> dict:
  load_before = os.getloadavg()[0]
  children = _children_cpu()
  wall, cpu = time.perf_counter(), time.process_time()
  result = monte_carlo.balls_and_bins_epsilon(
    SIGMA,
    NUM_STEPS,
    DELTA,
    num_samples=num_samples,
    beta=BETA,
    method=METHOD,
    seed=0,
    workers=workers,
  )
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  load_after = os.getloadavg()[0]
  while multiprocessing.active_children():  # reap the workers (untimed) to read their CPU
    time.sleep(0.1)
  workers_cpu = _children_cpu() - children
  return dict(
    seconds=wall,
    caller_cpu_seconds=cpu,
    workers_cpu_seconds=workers_cpu,
    cpu_bound_seconds=max(cpu, workers_cpu / max(1, workers - 1)),
    load_average_before=load_before,
    load_average_after=load_after,
    epsilon=result.epsilon,
    epsilon_point=result.epsilon_point,
  )


def bench(samples: list[int], workers: list[int], repeats: int) -> dict:
  cases = []
  for num_samples in samples:
    runs = {w: [] for w in workers}
    for repeat in range(repeats):
      for w in workers:
        run = _one_run(num_samples, w)
        runs[w].append(run)
        _log(
          f'samples={num_samples} workers={w} repeat={repeat}: {run["seconds"]:.1f} s, '
          f'ε = {run["epsilon"]:.6f}, load {run["load_average_before"]:.1f}'
        )
    epsilons = {run['epsilon'] for w in workers for run in runs[w]}
    if len(epsilons) != 1:
      raise RuntimeError(f'ε depends on the number of workers: {sorted(epsilons)}')
    medians = {w: statistics.median(run['seconds'] for run in runs[w]) for w in workers}
    bound = {w: statistics.median(run['cpu_bound_seconds'] for run in runs[w]) for w in workers}
    cases.append(
      dict(
        num_samples=num_samples,
        epsilon=epsilons.pop(),
        median_seconds={str(w): medians[w] for w in workers},
        speed_up={str(w): medians[workers[0]] / medians[w] for w in workers},
        median_cpu_bound_seconds={str(w): bound[w] for w in workers},
        cpu_bound_speed_up={str(w): bound[workers[0]] / bound[w] for w in workers},
        runs={str(w): runs[w] for w in workers},
      )
    )
  return dict(
    setting=dict(
      noise_multiplier=SIGMA,
      num_steps=NUM_STEPS,
      num_epochs=1,
      delta=DELTA,
      beta=BETA,
      method=METHOD,
      seed=0,
      repeats=repeats,
      samples_per_chunk=monte_carlo.SAMPLES_PER_CHUNK,
    ),
    machine=dict(
      provenance.machine(),
      git=provenance.git_state(),
      usable_cpus=len(os.sched_getaffinity(0)),
      sched_autogroup_enabled=_autogroup(),
      load_average_at_start=None,
      load_average_at_end=os.getloadavg(),
      time=time.strftime('%Y-%m-%d %H:%M:%S %Z'),
    ),
    cases=cases,
  )


def plot(results: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  cases = results['cases']
  fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 3.6), squeeze=False)
  for ax, case in zip(axes[0], cases):
    labels = list(case['median_seconds'])
    ax.bar(
      labels, [case['median_seconds'][w] for w in labels], color='#8fb3d9', label='median wall'
    )
    ax.bar(
      labels,
      [case['median_cpu_bound_seconds'][w] for w in labels],
      width=0.4,
      color='none',
      edgecolor='#c0392b',
      hatch='//',
      label='CPU-bound model (a core per process)',
    )
    for i, w in enumerate(labels):
      ax.scatter(
        [i] * len(case['runs'][w]),
        [r['seconds'] for r in case['runs'][w]],
        color='k',
        s=12,
        zorder=3,
        label='runs' if i == 0 else None,
      )
      ax.annotate(
        f'×{case["speed_up"][w]:.2f}',
        (i, case['median_seconds'][w]),
        ha='center',
        va='bottom',
        xytext=(0, 3),
        textcoords='offset points',
      )
      ax.annotate(
        f'model ×{case["cpu_bound_speed_up"][w]:.2f}',
        (i, case['median_cpu_bound_seconds'][w]),
        ha='center',
        va='bottom',
        xytext=(0, 3),
        textcoords='offset points',
        color='#c0392b',
        fontsize=8,
      )
    loads = [r['load_average_before'] for w in labels for r in case['runs'][w]]
    ax.set_title(
      f'm = {case["num_samples"]:.0e} samples/direction\n'
      f'load avg {min(loads):.1f}–{max(loads):.1f} on '
      f'{results["machine"]["cpu_count"]} CPUs (autogroup '
      f'{results["machine"].get("sched_autogroup_enabled")})',
      fontsize=9,
    )
    ax.set_xlabel('worker processes')
    ax.set_ylabel('seconds (ε search, wall)')
    ax.set_ylim(0, 1.15 * max(r['seconds'] for w in labels for r in case['runs'][w]))
  s = results['setting']
  fig.suptitle(
    f'balls-and-bins Monte-Carlo UCB: T = {s["num_steps"]:.0e}, σ = '
    f'{s["noise_multiplier"]}, δ = {s["delta"]}, {s["method"]}',
    fontsize=10,
  )
  handles, names = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, names, loc='lower center', ncol=3, fontsize=8)
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--samples', default='100000', help='comma-separated sample counts')
  parser.add_argument('--workers', default='1,2', help='comma-separated worker counts')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'parallel_mc.json'))
  parser.add_argument('--plot-only', action='store_true')
  args = parser.parse_args()
  png = os.path.splitext(args.out)[0] + '.png'
  if args.plot_only:
    with open(args.out) as f:
      plot(json.load(f), png)
    return
  start_load = os.getloadavg()
  results = bench(
    [int(x) for x in args.samples.split(',')],
    [int(x) for x in args.workers.split(',')],
    args.repeats,
  )
  results['machine']['load_average_at_start'] = start_load
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(results, f, indent=1)
  plot(results, png)
  print(
    json.dumps(
      {
        c['num_samples']: dict(median_seconds=c['median_seconds'], speed_up=c['speed_up'])
        for c in results['cases']
      },
      indent=1,
    )
  )


if __name__ == '__main__':
  main()
