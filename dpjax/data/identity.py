"""The content identity of a training split: a digest that changes when its data does.

`content_identity(source, key=...)` returns JSON-ready fields (`sha256` covers
all of them) for the privacy fingerprint, so that a resume on other data is
refused. It identifies features AND labels in index order, by one of:

- 'full' (in-memory arrays always; memory-mapped `.npy` splits and TFDS
  ArrayRecord files up to `full_read_bytes` in total): a SHA-256 of every byte
  (arrays: dtype, shape and C-order bytes of x, then of y; TFDS: every file of
  the split). ANY change of content, order, dtype or shape is detected, up to
  SHA-256 collisions. Paths and modification times do not enter: a copy of the
  same data elsewhere has the same identity.
- 'sampled' (files above `full_read_bytes`; sources that only offer `gather`):
  any change of N, dtype, shape, a file's size or modification time, and
  (memory-mapped labels up to `full_read_bytes`) of any label, is detected. A
  content change in k of the N rows that keeps sizes and mtimes is detected
  only with probability 1 − (1 − k/N)^s: s = 4096 rows drawn with replacement
  from `key` are hashed (≥ 98% for k/N ≥ 0.1%, but ≈ 2s/N for two swapped
  rows). Whoever can write the files can also reset their mtime, and whoever
  knows `key` knows which rows are checked; a generic source (only
  `__len__`/`gather`) has no file facts at all, so only N and the sample.
  TFDS splits above the limit have no label digest (it would decode every
  record): their labels are checked only in the sample.
- 'parameters' (`SyntheticSource`): its defining parameters (any change is
  detected), and a keyed sample of rows (a change of the generating code).
  `CanarySource`: the base source's identity and the number of canary rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import numpy as np

from dpjax.data import arrays as arrays_lib
from dpjax.data import byte_digest
from dpjax.data import synthetic
from dpjax.data import tfds_source

IDENTITY_VERSION = 1
# Files up to this many bytes in total are hashed in full (a few seconds on 2 busy cores; measured
# in scripts/README.md, bench_data_identity.py), larger ones sampled.
DEFAULT_FULL_READ_BYTES = 2 << 30
DEFAULT_SAMPLE_ROWS = 4096  # Rows hashed by the sampled method (drawn with replacement).
# A synthetic split is a function of its parameters; these rows only check the generating code.
SYNTHETIC_SAMPLE_ROWS = 64
_SAMPLE_DOMAIN = b'dpjax.data.identity.sample.v1\0'


def content_identity(
  source: Any,
  *,
  key: bytes,
  full_read_bytes: int = DEFAULT_FULL_READ_BYTES,
  sample_rows: int = DEFAULT_SAMPLE_ROWS,
) -> dict[str, Any]:
  """The content identity of `source` (see the module docstring).

  Args:
    source: an `ArraySource` (in memory or memory-mapped), `TfdsSource`,
      `SyntheticSource`, `CanarySource`, or any object with `__len__` and `gather`.
    key: secret bytes that choose the sampled rows (derive them from the run's
      seed); the same key gives the same identity for the same data.
    full_read_bytes: files (memmap, TFDS) up to this many bytes in total are
      hashed in full; above it, sampled.
    sample_rows: s, the rows drawn for the sampled method.

  Returns:
    JSON round-trip-stable fields: `identity_version`, `kind` ('arrays',
    'memmap', 'tfds', 'synthetic', 'canary', 'gather'), `method` ('full',
    'sampled', 'parameters'), `num_examples`, `sample_size` (rows drawn, 0 for
    'full'), kind-specific facts (`arrays`, `bytes`, `files`, `labels_sha256`,
    `parameters`, `base`, `num_canaries`) and `sha256`, a digest of all of
    them and of the content: compare `sha256`.
  """
  if not isinstance(key, (bytes, bytearray)):
    raise TypeError(f'key must be bytes, got {type(key).__name__}.')
  for name, value, low in (
    ('full_read_bytes', full_read_bytes, 0),
    ('sample_rows', sample_rows, 1),
  ):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
      raise ValueError(f'{name} must be an integer >= {low}, got {value!r}.')
  options = dict(key=bytes(key), full_read_bytes=int(full_read_bytes), sample_rows=int(sample_rows))
  # Not imported: if the module is not loaded, no CanarySource exists.
  canaries = sys.modules.get('dpjax.privacy.auditing.canaries')
  if canaries is not None and isinstance(source, canaries.CanarySource):
    base = content_identity(source.base, **options)
    fields = dict(
      kind='canary',
      method=base['method'],
      num_examples=len(source),
      sample_size=base['sample_size'],
      num_canaries=source.num_canaries,
      base=base,
    )
    return _finish(fields, hashlib.sha256())
  if isinstance(source, arrays_lib.ArraySource):
    return _array_identity(source, **options)
  if isinstance(source, tfds_source.TfdsSource):
    return _tfds_identity(source, **options)
  if isinstance(source, synthetic.SyntheticSource):
    return _synthetic_identity(source, **options)
  if hasattr(source, 'gather') and hasattr(source, '__len__'):
    return _gather_identity(source, **options)
  raise TypeError(
    f'cannot identify a {type(source).__name__}: a data source needs __len__ and gather.'
  )


def sample_indices(
  num_examples: int, key: bytes, sample_rows: int = DEFAULT_SAMPLE_ROWS
) -> np.ndarray:
  """The distinct rows (sorted int64) the sampled method hashes.

  All rows when N ≤ s; else s draws with replacement, uniform in [0, N) (bias
  below N/2^64), from SHAKE-256 of (key, N): stable across NumPy versions, and
  unpredictable without the key. Missing a change in k rows has probability
  exactly (1 − k/N)^s (up to that bias).
  """
  if num_examples <= sample_rows:
    return np.arange(num_examples, dtype=np.int64)
  stream = hashlib.shake_256(_SAMPLE_DOMAIN + int(num_examples).to_bytes(8, 'little') + key)
  draws = np.frombuffer(stream.digest(8 * sample_rows), '<u8') % np.uint64(num_examples)
  return np.unique(draws.astype(np.int64))


# ---------------------------------------------------------------------------
# Sources.
# ---------------------------------------------------------------------------


def _array_identity(source, *, key, full_read_bytes, sample_rows):
  n = len(source)
  arrays = (('x', source.images), ('y', source.labels))
  for name, array in arrays:
    if array.dtype.hasobject:
      raise TypeError(
        f'cannot identify {name} of dtype {array.dtype}: object arrays hold pointers, not content.'
      )
  backing = {name: byte_digest.backing(array) for name, array in arrays}
  mapped = {name: b for name, b in backing.items() if b is not None}
  mapped_bytes = sum(array.nbytes for name, array in arrays if name in mapped)
  full = mapped_bytes <= full_read_bytes
  files = sorted({b[0] for b in mapped.values() if b[0]})
  fields = dict(
    kind='memmap' if mapped else 'arrays',
    method='full' if full else 'sampled',
    num_examples=n,
    sample_size=0,
    arrays=[byte_digest.header(name, array) for name, array in arrays],
    bytes=sum(array.nbytes for _, array in arrays),
    files=[byte_digest.file_facts(path, with_mtime=not full) for path in files] if mapped else None,
    labels_sha256=None,
  )
  digest = hashlib.sha256()
  if full:
    for name, array in arrays:
      byte_digest.hash_array(digest, name, array, backing[name])
    return _finish(fields, digest)
  labels = source.labels
  if 'y' not in mapped or labels.nbytes <= full_read_bytes:  # Labels are small: hash them all.
    labels_digest = hashlib.sha256()
    byte_digest.hash_array(labels_digest, 'y', labels, backing['y'])
    fields['labels_sha256'] = labels_digest.hexdigest()
  rows = sample_indices(n, key, sample_rows)
  fields['sample_size'] = min(n, sample_rows)
  digest.update(rows.astype('<i8').tobytes())
  readers = [byte_digest.row_chunks(array, backing[name], rows) for name, array in arrays]
  for parts in zip(*readers):  # Per chunk of rows: x, then y.
    for (name, _), part in zip(arrays, parts):
      byte_digest.hash_array(digest, name, part, None)
  return _finish(fields, digest)


def _tfds_identity(source, *, key, full_read_bytes, sample_rows):
  n = len(source)
  files = _tfds_files(source.source)
  fields = dict(
    kind='tfds',
    method='sampled',
    num_examples=n,
    sample_size=0,
    bytes=None,
    files=None,
    labels_sha256=None,
  )  # Labels: only by decoding every record.
  digest = hashlib.sha256()
  if files is not None:
    total = sum(os.stat(path).st_size for path, _, _ in files)
    full = total <= full_read_bytes
    fields.update(
      method='full' if full else 'sampled',
      bytes=total,
      files=[
        dict(byte_digest.file_facts(path, with_mtime=not full), skip=skip, take=take)
        for path, skip, take in files
      ],
    )
    if full:
      for path, _, _ in files:
        size = os.stat(path).st_size
        digest.update(byte_digest.length_prefixed(os.path.basename(path).encode()))
        digest.update(size.to_bytes(8, 'little'))
        byte_digest.hash_file(digest, path, 0, size)
      return _finish(fields, digest)
  rows = sample_indices(n, key, sample_rows)
  fields['sample_size'] = min(n, sample_rows)
  digest.update(rows.astype('<i8').tobytes())
  for start in range(0, len(rows), byte_digest.SAMPLE_CHUNK_ROWS):
    keys = [int(i) for i in rows[start : start + byte_digest.SAMPLE_CHUNK_ROWS]]
    try:  # Raw records (before the config's preprocessing), one batched read.
      records = source.source.__getitems__(keys)
    except (AttributeError, TypeError):
      records = [source.source[k] for k in keys]
    for record in records:
      byte_digest.hash_tree(digest, '', record)
  return _finish(fields, digest)


def _synthetic_identity(source, *, key, full_read_bytes, sample_rows):
  del full_read_bytes
  cls = type(source)
  parameters = dict(
    **{'class': f'{cls.__module__}.{cls.__qualname__}'},
    num_examples=source.num_examples,
    input_shape=[int(d) for d in source.input_shape],
    num_classes=int(source.num_classes),
    seed=int(source.seed),
    offset=int(source.offset),
    one_hot=bool(source.one_hot),
  )
  digest = hashlib.sha256()
  sample_size = _hash_gathered_sample(digest, source, key, min(sample_rows, SYNTHETIC_SAMPLE_ROWS))
  fields = dict(
    kind='synthetic',
    method='parameters',
    num_examples=len(source),
    sample_size=sample_size,
    parameters=parameters,
  )
  return _finish(fields, digest)


def _gather_identity(source, *, key, full_read_bytes, sample_rows):
  del full_read_bytes
  digest = hashlib.sha256()
  sample_size = _hash_gathered_sample(digest, source, key, sample_rows)
  shape = getattr(source, 'input_shape', None)
  fields = dict(
    kind='gather',
    method='sampled',
    num_examples=len(source),
    sample_size=sample_size,
    source_class=f'{type(source).__module__}.{type(source).__qualname__}',
    input_shape=None if shape is None else [int(d) for d in shape],
  )
  return _finish(fields, digest)


def _hash_gathered_sample(digest, source, key: bytes, sample_rows: int) -> int:
  """Hashes the keyed sample's rows as `source.gather` returns them; the sample size."""
  n = len(source)
  rows = sample_indices(n, key, sample_rows)
  digest.update(rows.astype('<i8').tobytes())
  for start in range(0, len(rows), byte_digest.SAMPLE_CHUNK_ROWS):
    byte_digest.hash_tree(
      digest, '', source.gather(rows[start : start + byte_digest.SAMPLE_CHUNK_ROWS])
    )
  return min(n, sample_rows)


def _tfds_files(split_source) -> list[tuple[str, int | None, int | None]] | None:
  """(path, skip, take) of every local file the split reads, features.json last; None if unknown
  (e.g. tfds.testing.mock_data, or files not on a local disk)."""
  try:
    info = split_source.dataset_info
    instructions = info.splits[split_source.split].file_instructions
    files, seen = [], set()
    for instruction in instructions:
      path = os.fspath(instruction.filename)
      if path not in seen:
        seen.add(path)
        files.append((path, int(instruction.skip), int(instruction.take)))
    features = os.path.join(os.fspath(info.data_dir), 'features.json')  # How records decode.
  except Exception:  # pylint: disable=broad-except  # Any other kind of TFDS source.
    return None
  if os.path.isfile(features):
    files.append((features, None, None))
  if not files or not all(os.path.isfile(path) for path, _, _ in files):
    return None
  return files


def _finish(fields: dict[str, Any], content) -> dict[str, Any]:
  """Adds identity_version and sha256 = SHA-256(canonical JSON of the fields, content digest)."""
  fields = json.loads(json.dumps(dict(identity_version=IDENTITY_VERSION, **fields)))
  canonical = json.dumps(fields, sort_keys=True, separators=(',', ':')).encode()
  fields['sha256'] = hashlib.sha256(
    byte_digest.length_prefixed(canonical) + content.digest()
  ).hexdigest()
  return fields
