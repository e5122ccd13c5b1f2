"""Per-step sampling + gather time and peak memory at N = 1e6, 1e7, 1e8 (issue 7).

Question: at 10^8 examples, does one step of the data pipeline (sampler →
`Batcher.logical_batch` → `source.gather` of every physical batch) stay O(b)
in time, and does memory grow with N only by the samplers' documented index
structures (4 bytes per example for `shuffle` and `balls_and_bins`, nothing
for the others)?

Each (source, sampler, N) runs in a fresh subprocess so peaks do not mix. It
reports the median over repeats of the median per-step time (steps inside
one epoch, after the first), the first step's time (for epoch samplers it
builds the epoch's permutation), the peak RSS (VmHWM) and, separately, the
peak anonymous RSS (the process's own memory, sampled after every step) and
the file-backed RSS at the end (pages of the memory-mapped file that the
kernel mapped in; they are page cache, shared and reclaimable, and grow with
the number of steps run, not with N).

Sources:
  synthetic  examples computed from their index (64 float32 features).
  memmap     `arrays.write_memmap_split` files: 64 uint8 features + a uint8
             label per row, so N = 1e8 is 6.4 GB (28x28 images would be 78 GB,
             more than this disk has free). Files are written to a temporary
             directory, one N at a time, and deleted at the end. Timed "warm":
             the files are read once before each run so they sit in the page
             cache (this measures the code, not the disk).
  memmap_cold  the Poisson sampler on the memmap files evicted from the page
             cache (posix_fadvise DONTNEED) just before the run: the median of
             the first steps, bound by the disk's random-read latency.

Run:
  python scripts/bench_data_scale.py                                 # ~10 min
  python scripts/bench_data_scale.py --sizes 1e6 1e7 --samplers poisson shuffle --out /tmp/d.json
  python scripts/bench_data_scale.py --plot-only                     # redraw the PNG from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

PAGE_CACHE_CHUNK = 64 << 20  # Bytes per read when warming or writing files.
STATUS_FIELDS = ('VmHWM', 'VmRSS', 'RssAnon', 'RssFile')
EPOCH_SAMPLERS = ('balls_and_bins', 'shuffle')


def proc_status_mib() -> dict[str, float]:
  """VmHWM (peak RSS), VmRSS, RssAnon, RssFile of this process, in MiB."""
  values = {}
  with open('/proc/self/status') as f:
    for line in f:
      key, _, rest = line.partition(':')
      if key in STATUS_FIELDS:
        values[key] = int(rest.split()[0]) / 1024  # kB -> MiB
  return values


# ---------------------------------------------------------------------------
# Worker: one (source, sampler, N) in a fresh process.
# ---------------------------------------------------------------------------


def run_worker(spec: dict) -> dict:
  import ml_collections  # pylint: disable=g-import-not-at-top
  from dpjax.privacy import batching
  from dpjax.data import sources as data
  from dpjax.data import synthetic
  from dpjax.trainer.planning import plan as plan_lib  # pylint: disable=g-import-not-at-top

  baseline = proc_status_mib()
  start = time.perf_counter()
  if spec['source'] == 'synthetic':
    source = synthetic.SyntheticSource(spec['num_examples'], (spec['features'],), 10)
  else:
    config = ml_collections.ConfigDict(
      dict(
        source='memmap',
        path=spec['path'],
        train_split='train',
        test_split='test',
        scale=255.0,
        mean=(0.0,),
        std=(1.0,),
        label_format='int',
        num_classes=10,
      )
    )
    source, _ = data.make_sources(config)
  open_seconds = time.perf_counter() - start
  n = len(source)
  assert n == spec['num_examples'], (n, spec)
  config = ml_collections.ConfigDict(
    {'seed': 0, 'sampler': {'name': spec['sampler'], 'batch_size': spec['batch_size']}}
  )
  sampler = plan_lib.make_sampler(config, n)
  physical = spec['physical_batch_size']
  cap = batching.resolve_max_batch_size(sampler, physical, num_steps=10**6, delta=1e-8)
  batcher = batching.Batcher(sampler, physical, cap)
  peak_anon = proc_status_mib()['RssAnon']

  def step_seconds(step: int, gather: bool = True) -> float:
    nonlocal peak_anon
    begin = time.perf_counter()
    logical = batcher.logical_batch(step)
    if gather:
      for indices, _ in logical.physical_batches():
        source.gather(indices)
    elapsed = time.perf_counter() - begin
    peak_anon = max(peak_anon, proc_status_mib()['RssAnon'])
    return elapsed

  if spec['cold']:  # The first steps on an evicted file: no warm-up.
    times = [step_seconds(t) for t in range(spec['steps'])]
    medians, sampling, first = [statistics.median(times)], [float('nan')], times[0]
  else:
    first = step_seconds(0)  # Epoch samplers build epoch 0's permutation here.
    per_epoch = sampler.steps_per_epoch
    stride = max(1, min(1000, (per_epoch - 1 - spec['steps']) // spec['repeats']))
    medians, sampling = [], []
    for r in range(spec['repeats']):
      steps = range(1 + r * stride, 1 + r * stride + spec['steps'])  # Inside epoch 0.
      medians.append(statistics.median(step_seconds(t) for t in steps))
      sampling.append(statistics.median(step_seconds(t, gather=False) for t in steps))
  end = proc_status_mib()
  epoch_structure = (4 if n < 2**31 else 8) * n + 8 * (sampler.steps_per_epoch + 1)
  return dict(
    source='memmap_cold' if spec['cold'] else spec['source'],
    sampler=spec['sampler'],
    num_examples=n,
    batch_size=spec['batch_size'],
    physical_batch_size=physical,
    max_batch_size=cap,
    steps_per_epoch=sampler.steps_per_epoch,
    open_seconds=open_seconds,
    first_step_seconds=first,
    median_step_ms=1e3 * statistics.median(medians),
    median_sampling_ms=1e3 * statistics.median(sampling),
    baseline_rss_mib=baseline['VmRSS'],
    baseline_anon_rss_mib=baseline['RssAnon'],
    peak_rss_mib=end['VmHWM'],
    peak_anon_rss_mib=peak_anon,
    end_file_rss_mib=end['RssFile'],
    documented_index_mib=(epoch_structure / 2**20 if spec['sampler'] in EPOCH_SAMPLERS else 0.0),
    load_average_1min=os.getloadavg()[0],
  )  # The machine is shared: context for the times.


# ---------------------------------------------------------------------------
# Parent: files, page cache, one subprocess per run, JSON and plot.
# ---------------------------------------------------------------------------


def write_memmap_files(root: str, num_examples: int, features: int) -> float:
  """Writes train (N rows) and test (1000 rows) splits of random bytes; returns seconds."""
  from dpjax.data import arrays  # pylint: disable=g-import-not-at-top

  rows = max(1, PAGE_CACHE_CHUNK // features)

  def chunks(total, seed):
    for first in range(0, total, rows):
      rng = np.random.default_rng([seed, first])
      count = min(rows, total - first)
      x = np.frombuffer(rng.bytes(count * features), np.uint8).reshape(count, features)
      yield x, rng.integers(0, 10, count, dtype=np.uint8)

  start = time.perf_counter()
  arrays.write_memmap_split(os.path.join(root, 'train'), num_examples, chunks(num_examples, 0))
  arrays.write_memmap_split(os.path.join(root, 'test'), 1000, chunks(1000, 1))
  return time.perf_counter() - start


def memmap_files(root: str) -> list[str]:
  return [
    os.path.join(root, split, name) for split in ('train', 'test') for name in ('x.npy', 'y.npy')
  ]


def warm_page_cache(root: str) -> float:
  """Reads the files once (plain reads, not mapped in this process); returns seconds."""
  start = time.perf_counter()
  for path in memmap_files(root):
    with open(path, 'rb', buffering=0) as f:
      while f.read(PAGE_CACHE_CHUNK):
        pass
  return time.perf_counter() - start


def evict_page_cache(root: str) -> None:
  """Drops this directory's file pages from the page cache (these files only)."""
  for path in memmap_files(root):
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)  # Dirty pages cannot be dropped.
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def run_subprocess(spec: dict) -> dict:
  out = subprocess.run(
    [sys.executable, __file__, '--worker', json.dumps(spec)],
    capture_output=True,
    text=True,
    check=False,
  )
  if out.returncode:
    raise RuntimeError(f'worker {spec} failed:\n{out.stderr}')
  return json.loads(out.stdout.strip().splitlines()[-1])


def print_row(row: dict) -> None:
  print(
    f'{row["source"]:12s} {row["sampler"]:28s} N={row["num_examples"]:>11,d} '
    f'{row["median_step_ms"]:8.3f} ms/step (sampling {row["median_sampling_ms"]:6.3f} ms) '
    f'first step {row["first_step_seconds"]:7.3f} s  peak RSS {row["peak_rss_mib"]:7.1f} MiB '
    f'(anon {row["peak_anon_rss_mib"]:7.1f}, file {row["end_file_rss_mib"]:7.1f}; '
    f'baseline {row["baseline_rss_mib"]:5.1f}; '
    f'documented index {row["documented_index_mib"]:6.1f})',
    flush=True,
  )


def plot(results: list[dict], files: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  # Imported here, not at the top: the measuring workers' RSS baseline stays as it was.
  import bench_data_pipeline  # pylint: disable=g-import-not-at-top

  names = sorted(
    {r['sampler'] for r in results},
    key=[
      'poisson',
      'balls_and_bins',
      'shuffle',
      'deterministic',
      'fixed_size',
      'fixed_size_with_replacement',
    ].index,
  )
  colors = dict(zip(names, plt.cm.tab10.colors))
  styles = {'synthetic': ('-', 'o'), 'memmap': ('--', 's'), 'memmap_cold': (':', 'x')}
  fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
  panels = [
    (axes[0, 0], 'median_step_ms', 'per-step time (ms): sample + batch + gather'),
    (axes[0, 1], 'peak_anon_rss_mib', 'peak anonymous RSS (MiB): process memory'),
    (axes[1, 0], 'peak_rss_mib', 'peak RSS, VmHWM (MiB): incl. mapped file pages'),
    (axes[1, 1], 'first_step_seconds', 'first step (s): builds the epoch for epoch samplers'),
  ]
  for ax, key, title in panels:
    for source, (line, marker) in styles.items():
      for name in names:
        rows = sorted(
          (r for r in results if r['source'] == source and r['sampler'] == name),
          key=lambda r: r['num_examples'],
        )
        if rows:
          ax.plot(
            [r['num_examples'] for r in rows],
            [r[key] for r in rows],
            line,
            marker=marker,
            color=colors[name],
            label=f'{name} · {source}',
          )
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xlabel('N, training examples')
    ax.set_title(title, fontsize=10)
    ax.grid(True, which='both', alpha=0.3)
  sizes = sorted({r['num_examples'] for r in results})
  for ax, key in ((axes[0, 1], 'baseline_anon_rss_mib'), (axes[1, 0], 'baseline_rss_mib')):
    baseline = statistics.median(r[key] for r in results)
    ax.plot(
      sizes,
      [baseline + 4 * n / 2**20 for n in sizes],
      color='grey',
      lw=3,
      alpha=0.4,
      label='after imports + 4 bytes × N (documented epoch structure)',
    )
  if files:
    baseline = statistics.median(r['baseline_rss_mib'] for r in results)
    axes[1, 0].plot(
      [f['num_examples'] for f in files],
      [baseline + f['bytes'] / 2**20 for f in files],
      color='grey',
      ls='--',
      lw=3,
      alpha=0.4,
      label='after imports + memmap file size (bound on mapped pages)',
    )
  axes[0, 0].set_ylabel('ms per step')
  axes[0, 1].set_ylabel('MiB')
  axes[1, 0].set_ylabel('MiB')
  axes[1, 1].set_ylabel('seconds')
  handles, labels = axes[0, 1].get_legend_handles_labels()
  handles.append(axes[1, 0].get_legend_handles_labels()[0][-1])
  labels.append(axes[1, 0].get_legend_handles_labels()[1][-1])
  fig.legend(handles, labels, loc='lower center', ncol=3, fontsize=8, frameon=False)
  b = results[0]['batch_size']
  fig.suptitle(
    f'Data pipeline at scale: b = {b}, P = {results[0]["physical_batch_size"]}; '
    'synthetic (solid), memmap warm page cache (dashed), memmap evicted (dotted)'
    + bench_data_pipeline.load_note(results),
    fontsize=11,
  )
  fig.tight_layout(rect=(0, 0.12, 1, 0.97))
  fig.savefig(path, dpi=110)
  print('wrote', path)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--worker', help=argparse.SUPPRESS)
  parser.add_argument('--sizes', type=float, nargs='+', default=[1e6, 1e7, 1e8])
  parser.add_argument(
    '--samplers',
    nargs='+',
    default=[
      'poisson',
      'balls_and_bins',
      'shuffle',
      'deterministic',
      'fixed_size',
      'fixed_size_with_replacement',
    ],
  )
  parser.add_argument(
    '--sources',
    nargs='+',
    default=['synthetic', 'memmap', 'memmap_cold'],
    choices=['synthetic', 'memmap', 'memmap_cold'],
  )
  parser.add_argument('--batch-size', type=int, default=256)
  parser.add_argument('--physical-batch-size', type=int, default=128)
  parser.add_argument('--features', type=int, default=64, help='row width (uint8 on disk)')
  parser.add_argument('--steps', type=int, default=40, help='timed steps per repeat')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--cold-steps', type=int, default=20)
  parser.add_argument(
    '--workdir', default='', help='where memmap files go (default: a new directory in /tmp)'
  )
  parser.add_argument('--out', default='scripts/results/data_scale.json')
  parser.add_argument('--plot-only', action='store_true', help='redraw the PNG from --out')
  args = parser.parse_args()
  if args.worker:
    print(json.dumps(run_worker(json.loads(args.worker))))
    return
  png = os.path.splitext(args.out)[0] + '.png'
  if args.plot_only:
    with open(args.out) as f:
      saved = json.load(f)
    plot(saved['results'], saved['memmap_files'], png)
    return

  base = dict(
    batch_size=args.batch_size,
    physical_batch_size=args.physical_batch_size,
    features=args.features,
    steps=args.steps,
    repeats=args.repeats,
    cold=False,
  )
  results, files = [], []
  workdir = tempfile.mkdtemp(prefix='dpjax_data_scale_', dir=args.workdir or None)
  try:
    for n_float in args.sizes:
      n = int(n_float)
      if 'synthetic' in args.sources:
        for name in args.samplers:
          results.append(
            run_subprocess(dict(base, source='synthetic', sampler=name, num_examples=n))
          )
          print_row(results[-1])
      if not {'memmap', 'memmap_cold'} & set(args.sources):
        continue
      root = os.path.join(workdir, f'n{n}')
      write_seconds = write_memmap_files(root, n, args.features)
      size_bytes = sum(os.path.getsize(p) for p in memmap_files(root))
      record = dict(num_examples=n, bytes=size_bytes, write_seconds=write_seconds)
      print(f'wrote {size_bytes / 1e9:.2f} GB for N={n:,d} in {write_seconds:.1f} s', flush=True)
      if 'memmap' in args.sources:
        for name in args.samplers:
          record.setdefault('warm_read_seconds', []).append(warm_page_cache(root))
          results.append(
            run_subprocess(dict(base, source='memmap', sampler=name, num_examples=n, path=root))
          )
          print_row(results[-1])
      if 'memmap_cold' in args.sources:
        evict_page_cache(root)
        results.append(
          run_subprocess(
            dict(
              base,
              source='memmap',
              sampler='poisson',
              num_examples=n,
              path=root,
              cold=True,
              steps=args.cold_steps,
            )
          )
        )
        print_row(results[-1])
      files.append(record)
      shutil.rmtree(root)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)

  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(
      dict(
        machine=dict(cpus=os.cpu_count(), python=platform.python_version(), numpy=np.__version__),
        args=vars(args),
        memmap_files=files,
        results=results,
      ),
      f,
      indent=2,
    )
  print('wrote', args.out)
  plot(results, files, png)


if __name__ == '__main__':
  main()
