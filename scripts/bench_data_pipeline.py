"""Per-step sampling + batching + gather time versus the dataset size N.

Question: does one step of the data pipeline cost O(b), independent of N?
For each sampler and N, times `Batcher.logical_batch(step)` plus
`source.gather` of every physical batch over consecutive steps on the
synthetic source (O(1) memory in N), and reports the median per-step time
over repeats. Epoch samplers (balls-and-bins, shuffle) pay one O(N)
permutation per epoch; their figure is the amortised per-step cost over whole
epochs when the epoch is short enough, and the steady-state (within-epoch)
median otherwise, both reported.

Writes the JSON and a PNG plot next to it (same name, .png); `--plot-only`
redraws the plot from an existing JSON.

Run:
  python scripts/bench_data_pipeline.py                 # N = 1e4, 1e5, 1e6, 1e7 (~5 min)
  python scripts/bench_data_pipeline.py --sizes 1e4 1e6 1e7 1e8 --out /tmp/data_pipeline_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time

import ml_collections
import numpy as np

from dpjax.privacy import batching
from dpjax.data import synthetic
from dpjax.trainer.planning import plan as plan_lib
from dpjax.privacy import samplers


def make(name: str, num_examples: int, batch_size: int, physical: int):
  config = ml_collections.ConfigDict(
    {'seed': 0, 'sampler': {'name': name, 'batch_size': batch_size}}
  )
  sampler = plan_lib.make_sampler(config, num_examples)
  cap = batching.resolve_max_batch_size(sampler, physical, num_steps=10**6, delta=1e-6)
  return batching.Batcher(sampler, physical, cap)


def time_steps(batcher, source, steps: list[int]) -> list[float]:
  """Seconds per step of sampling + batching (+ gathering, unless source is None)."""
  times = []
  for step in steps:
    start = time.perf_counter()
    logical = batcher.logical_batch(step)
    if source is not None:
      for indices, _ in logical.physical_batches():
        source.gather(indices)
    times.append(time.perf_counter() - start)
  return times


def load_note(results: list[dict]) -> str:
  """The shared machine's load during the runs: times are only comparable within a figure."""
  loads = [r['load_average_1min'] for r in results if 'load_average_1min' in r]
  if not loads:
    return ''
  return (
    f'\n1-min load average {min(loads):.0f}-{max(loads):.0f} on {os.cpu_count()} CPUs '
    'during the runs'
  )


def plot(results: list[dict], path: str) -> None:
  """Per-step time and sampling-only time vs N, one line per sampler (log axes)."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  names = [n for n in samplers.SAMPLER_NAMES if any(r['sampler'] == n for r in results)]
  colors = dict(zip(names, plt.cm.tab10.colors))
  fig, axes = plt.subplots(1, 2, figsize=(13, 6.2))
  panels = [
    (axes[0], 'median_step_seconds', 'sampling + batching + gather (synthetic source)'),
    (axes[1], 'median_sampling_seconds', 'sampling + batching alone'),
  ]
  for ax, key, title in panels:
    for name in names:
      rows = sorted((r for r in results if r['sampler'] == name), key=lambda r: r['num_examples'])
      sizes = [r['num_examples'] for r in rows]
      ax.plot(sizes, [1e3 * r[key] for r in rows], '-o', color=colors[name], label=name)
      amortised = [
        (r['num_examples'], r['amortised_step_seconds'])
        for r in rows
        if r['amortised_step_seconds'] is not None
      ]
      if key == 'median_step_seconds' and amortised:
        ax.plot(
          *zip(*[(n, 1e3 * t) for n, t in amortised]),
          ':x',
          color=colors[name],
          label=f'{name}, amortised over whole epochs (incl. building each epoch)',
        )
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xlabel('N, training examples')
    ax.set_ylabel('median time per step (ms)')
    ax.set_title(title, fontsize=10)
    ax.grid(True, which='both', alpha=0.3)
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc='lower center', ncol=3, fontsize=8, frameon=False)
  first = results[0]
  fig.suptitle(
    f'Data pipeline per-step cost vs N: b = {first["batch_size"]}, '
    f'P = {first["physical_batch_size"]}, medians over repeats' + load_note(results),
    fontsize=11,
  )
  fig.tight_layout(rect=(0, 0.14, 1, 1))
  fig.savefig(path, dpi=110)
  print('wrote', path)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--sizes', type=float, nargs='+', default=[1e4, 1e5, 1e6, 1e7])
  parser.add_argument('--batch-size', type=int, default=256)
  parser.add_argument('--physical-batch-size', type=int, default=128)
  parser.add_argument('--input-dim', type=int, default=784)
  parser.add_argument('--steps', type=int, default=60, help='timed steps per repeat')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--samplers', nargs='+', default=list(samplers.SAMPLER_NAMES))
  parser.add_argument('--out', default='scripts/results/data_pipeline.json')
  parser.add_argument('--plot-only', action='store_true', help='redraw the PNG from --out')
  args = parser.parse_args()
  png = os.path.splitext(args.out)[0] + '.png'
  if args.plot_only:
    with open(args.out) as f:
      plot(json.load(f)['results'], png)
    return

  results = []
  for name in args.samplers:
    for n_float in args.sizes:
      n = int(n_float)
      batcher = make(name, n, args.batch_size, args.physical_batch_size)
      source = synthetic.SyntheticSource(n, (args.input_dim,), 10)
      per_epoch = batcher.sampler.steps_per_epoch
      medians, sampling, amortised, num_physical = [], [], [], []
      for r in range(args.repeats):
        start_step = r * 7919 + 1  # Different steps (and epochs) per repeat.
        time_steps(batcher, source, [start_step])  # Warm the epoch cache / allocator.
        times = time_steps(
          batcher, source, list(range(start_step + 1, start_step + 1 + args.steps))
        )
        medians.append(statistics.median(times))
        num_physical += [
          batcher.logical_batch(t).num_physical_batches
          for t in range(start_step + 1, start_step + 1 + args.steps)
        ]
        sampling.append(
          statistics.median(
            time_steps(batcher, None, list(range(start_step + 1, start_step + 1 + args.steps)))
          )
        )
        if batcher.sampler.is_epoch_based and per_epoch <= 2000:
          first = (r + 10) * per_epoch  # An epoch not touched before: includes its assignment.
          amortised.append(
            sum(time_steps(batcher, source, list(range(first, first + per_epoch)))) / per_epoch
          )
      row = dict(
        sampler=name,
        num_examples=n,
        batch_size=args.batch_size,
        physical_batch_size=args.physical_batch_size,
        steps_per_epoch=per_epoch,
        median_step_seconds=statistics.median(medians),
        median_sampling_seconds=statistics.median(sampling),
        amortised_step_seconds=statistics.median(amortised) if amortised else None,
        # K = ceil(min(n, B)/P) gathers per step: Binomial n (Poisson, balls-and-bins)
        # straddles K = 2 and 3 at b = 256, P = 128, which moves the median.
        mean_physical_batches=statistics.mean(num_physical),
        # Peak of this one process over all runs so far (see bench_data_scale.py).
        max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        load_average_1min=os.getloadavg()[0],
      )  # Shared machine: context for the times.
      results.append(row)
      print(
        f'{name:28s} N={n:>11,d}  median {row["median_step_seconds"] * 1e3:7.3f} ms/step'
        f'  (sampling+batching alone {row["median_sampling_seconds"] * 1e3:6.3f} ms)'
        + (f'  amortised {row["amortised_step_seconds"] * 1e3:7.3f} ms/step' if amortised else '')
      )

  ratios, sampling_ratios = {}, {}
  lo, hi = int(min(args.sizes)), int(max(args.sizes))
  for name in args.samplers:
    rows = {r['num_examples']: r for r in results if r['sampler'] == name}
    ratios[name] = rows[hi]['median_step_seconds'] / rows[lo]['median_step_seconds']
    sampling_ratios[name] = (
      rows[hi]['median_sampling_seconds'] / rows[lo]['median_sampling_seconds']
    )
  print('ratio per-step time N=%d / N=%d:' % (hi, lo), {k: round(v, 3) for k, v in ratios.items()})
  print('  sampling+batching alone:', {k: round(v, 3) for k, v in sampling_ratios.items()})
  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(
      dict(
        machine=dict(cpus=os.cpu_count(), python=platform.python_version()),
        args=vars(args),
        results=results,
        ratio_large_over_small=ratios,
        sampling_ratio_large_over_small=sampling_ratios,
      ),
      f,
      indent=2,
    )
  print('wrote', args.out)
  plot(results, png)


if __name__ == '__main__':
  main()
