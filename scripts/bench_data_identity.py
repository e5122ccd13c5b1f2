"""What `data_identity.content_identity` costs at N = 1e6 and 1e8 (issue 24, item 2), as JSON.

Question: how long does identifying a training split's content take at the
start of every run (fresh or resumed), for in-memory arrays and for memory-
mapped `.npy` splits, by the full method (SHA-256 of every byte) and the
sampled method (sizes, mtimes, a keyed sample of rows, the labels in full),
with the files in the page cache (warm) and evicted from it (cold)? And so:
up to how many bytes can the full method be the default?

Rows are 64 uint8 features and a uint8 label (N = 1e8 is 6.4 GB; the files
are written with `arrays.write_memmap_split` into a temporary directory and
deleted afterwards). Methods:

  in_memory     an ArraySource over numpy arrays in RAM (always 'full'); 1e8
                only when MemAvailable leaves room for 6.4 GB.
  full          the memmap split hashed in full (full_read_bytes above its size).
  sampled       the sampled method with the labels hashed in full
                (full_read_bytes = the labels' size): what the default does above it.
  sample_only   the keyed sample alone (full_read_bytes = 0).

Cold: each file's pages are dropped with posix_fadvise(DONTNEED) before every
repeat (only these files; not /proc/sys/vm/drop_caches, which would flush the
page cache of everyone on this shared machine), and `fincore` records how much
of each file was still cached. Every repeat opens a fresh source (np.load with
mmap_mode='r'), so no mapping keeps pages alive. The disk is a virtual disk:
"cold" means out of this VM's page cache, maybe not the host's.

Run:
  python scripts/bench_data_identity.py                      # ~5 min, 6.5 GB in a temp dir
  python scripts/bench_data_identity.py --sizes 1e6 --repeats 3 --out /tmp/i.json
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dpjax.data import arrays  # pylint: disable=g-import-not-at-top,wrong-import-position
from dpjax.data import preprocess  # pylint: disable=g-import-not-at-top,wrong-import-position
from dpjax.data import identity as data_identity  # pylint: disable=g-import-not-at-top,wrong-import-position
from dpjax_bench import provenance  # pylint: disable=g-import-not-at-top,wrong-import-position

CHUNK_ROWS = 1 << 20  # Rows per chunk when writing or generating.
KEY = b'bench-data-identity'
PREPROCESS = preprocess.Preprocessor(255.0, (0.0,), (1.0,), 'int', 10)


def chunks(num_examples: int, features: int, seed: int):
  for first in range(0, num_examples, CHUNK_ROWS):
    rng = np.random.default_rng([seed, first])
    count = min(CHUNK_ROWS, num_examples - first)
    x = np.frombuffer(rng.bytes(count * features), np.uint8).reshape(count, features)
    yield x, rng.integers(0, 10, count, dtype=np.uint8)


def mem_available_bytes() -> int:
  with open('/proc/meminfo') as f:
    for line in f:
      if line.startswith('MemAvailable:'):
        return int(line.split()[1]) * 1024
  return 0


def split_files(root: str) -> list[str]:
  return [os.path.join(root, name) for name in arrays.MEMMAP_FILES]


def evict(root: str) -> None:
  for path in split_files(root):
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)  # Dirty pages cannot be dropped.
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def warm(root: str) -> None:
  for path in split_files(root):
    with open(path, 'rb', buffering=0) as f:
      while f.read(64 << 20):
        pass


def cached_fraction(root: str) -> float | None:
  """Fraction of the split's bytes in the page cache (util-linux fincore), None if unavailable."""
  try:
    out = subprocess.run(
      ['fincore', '--bytes', '--noheadings', '--output', 'RES,SIZE', *split_files(root)],
      capture_output=True,
      text=True,
      check=True,
    ).stdout
  except (OSError, subprocess.CalledProcessError):
    return None
  resident = size = 0
  for line in out.split('\n'):
    if line.strip():
      res, total = line.split()
      resident, size = resident + int(res), size + int(total)
  return resident / size if size else None


def open_source(root: str) -> arrays.ArraySource:
  """A memmap ArraySource without `make_sources`' label scan (which would warm y.npy)."""
  x, y = (np.load(path, mmap_mode='r') for path in split_files(root))
  return arrays.ArraySource(x, y, PREPROCESS)


def measure(name, num_examples, make_source, full_read_bytes, repeats, root=None, cold=False):
  times, cached, identity = [], [], None
  for _ in range(repeats):
    if cold:
      evict(root)
      cached.append(cached_fraction(root))
    elif root is not None:
      warm(root)
    source = make_source()
    start = time.perf_counter()
    identity = data_identity.content_identity(source, key=KEY, full_read_bytes=full_read_bytes)
    times.append(time.perf_counter() - start)
    del source
    gc.collect()
  row = dict(
    source=name,
    num_examples=num_examples,
    cache='cold' if cold else 'warm',
    method=identity['method'],
    sample_size=identity['sample_size'],
    labels_hashed=identity.get('labels_sha256') is not None,
    bytes=identity['bytes'],
    full_read_bytes=full_read_bytes,
    median_seconds=statistics.median(times),
    seconds=times,
    load_average=provenance.load_average(),
  )
  if identity['method'] == 'full':
    row['gib_per_second'] = identity['bytes'] / 2**30 / row['median_seconds']
  if cold:
    row['cached_fraction_before'] = cached
  print(
    f'{name:12s} N={num_examples:>11,d} {row["cache"]:4s} {row["method"]:8s} '
    f'{row["median_seconds"] * 1e3:10.1f} ms  (load {row["load_average"][0]})',
    flush=True,
  )
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--sizes', type=float, nargs='+', default=[1e6, 1e8])
  parser.add_argument('--features', type=int, default=64, help='uint8 features per row')
  parser.add_argument('--repeats', type=int, default=5, help='at N <= 1e7; 3 above')
  parser.add_argument('--workdir', default='', help='where the memmap files go (default /tmp)')
  parser.add_argument(
    '--out',
    default=os.path.join(
      os.path.dirname(os.path.abspath(__file__)), 'results', 'data_identity.json'
    ),
  )
  args = parser.parse_args()

  rows, skipped = [], []
  workdir = tempfile.mkdtemp(prefix='dpjax_data_identity_', dir=args.workdir or None)
  try:
    for size in args.sizes:
      n = int(size)
      repeats = args.repeats if n <= 10**7 else 3
      nbytes = n * (args.features + 1)
      # In memory: needs the arrays in RAM with 4 GB to spare.
      if mem_available_bytes() > nbytes + (4 << 30):
        x = np.empty((n, args.features), np.uint8)
        y = np.empty(n, np.uint8)
        for i, (cx, cy) in enumerate(chunks(n, args.features, 0)):
          part = slice(i * CHUNK_ROWS, i * CHUNK_ROWS + len(cx))
          x[part], y[part] = cx, cy
        rows.append(
          measure(
            'in_memory',
            n,
            lambda: arrays.ArraySource(x, y, PREPROCESS),
            data_identity.DEFAULT_FULL_READ_BYTES,
            repeats,
          )
        )
        del x, y
        gc.collect()
      else:
        skipped.append(
          f'in_memory N={n}: MemAvailable {mem_available_bytes() / 2**30:.1f} GiB '
          f'< {nbytes / 2**30:.1f} GiB + 4 GiB'
        )
        print(skipped[-1], flush=True)
      # Memory-mapped.
      root = os.path.join(workdir, f'n{n}')
      start = time.perf_counter()
      arrays.write_memmap_split(root, n, chunks(n, args.features, 0))
      write_seconds = time.perf_counter() - start
      label_bytes = os.path.getsize(split_files(root)[1])
      print(f'wrote {nbytes / 1e9:.2f} GB in {write_seconds:.1f} s', flush=True)
      for cold in (False, True):
        for name, limit in (('full', 1 << 62), ('sampled', label_bytes), ('sample_only', 0)):
          rows.append(
            measure(
              f'memmap_{name}', n, lambda: open_source(root), limit, repeats, root=root, cold=cold
            )
          )
          rows[-1]['write_seconds'] = write_seconds
      shutil.rmtree(root)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)

  provenance.write_json(
    args.out,
    dict(
      machine=dict(
        provenance.machine(),
        time=time.strftime('%Y-%m-%d %H:%M:%S'),
        mem_total_gib=os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30,
      ),
      git=provenance.git_state(),
      args=vars(args),
      key_bytes=len(KEY),
      default_full_read_bytes=data_identity.DEFAULT_FULL_READ_BYTES,
      default_sample_rows=data_identity.DEFAULT_SAMPLE_ROWS,
      skipped=skipped,
      results=rows,
    ),
  )
  print('wrote', args.out)


if __name__ == '__main__':
  main()
