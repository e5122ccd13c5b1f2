"""Streaming SHA-256 of arrays and files, for `identity`: every byte, or sampled rows.

An array is hashed as its header (name, dtype, shape; length-prefixed JSON) followed by its
C-order bytes, in chunks of CHUNK_BYTES: a whole-file memmap through plain reads with
read-ahead (nothing stays mapped), an array in memory through a byte view. Sampled rows of a
whole-file memmap are read with pread after one POSIX_FADV_WILLNEED per row, ~50x faster than
page faults through the mapping on files out of the page cache (scripts/README.md,
bench_data_identity.py).
"""

from __future__ import annotations

import json
import mmap
import os
from typing import Any

import numpy as np

CHUNK_BYTES = 8 << 20  # Bytes hashed per update when streaming arrays and files.
SAMPLE_CHUNK_ROWS = 256  # Rows per gather when hashing a sample (bounds memory for big rows).


def backing(array: np.ndarray) -> tuple[str, int | None] | None:
  """None for an array in memory; (file, offset) for one whose C-order bytes are the file's bytes
  from offset to its end (read with plain reads); (file or '', None) for another mapped view."""
  obj = array
  while obj is not None:
    if isinstance(obj, np.memmap) and getattr(obj, 'filename', None):
      path = obj.filename
      if (
        obj is array
        and array.flags.c_contiguous
        and array.offset + array.nbytes == os.stat(path).st_size
      ):
        return path, array.offset
      return path, None
    if isinstance(obj, mmap.mmap):
      return '', None
    obj = getattr(obj, 'base', None)
  return None


def header(name: str, array: np.ndarray) -> dict[str, Any]:
  return {
    'name': name,
    'dtype': np.lib.format.dtype_to_descr(array.dtype),
    'shape': [int(d) for d in array.shape],
  }


def length_prefixed(blob: bytes) -> bytes:
  return len(blob).to_bytes(8, 'little') + blob


def hash_array(digest, name: str, array: np.ndarray, backing) -> None:
  """Hashes the header (name, dtype, shape), then the C-order bytes, in chunks of CHUNK_BYTES."""
  digest.update(length_prefixed(json.dumps(header(name, array), sort_keys=True).encode()))
  if backing is not None and backing[1] is not None:  # The whole file after its header.
    hash_file(digest, backing[0], backing[1], array.nbytes)
  elif array.flags.c_contiguous:  # A byte view: no copy.
    flat = memoryview(array.reshape(-1).view(np.uint8))
    for start in range(0, len(flat), CHUNK_BYTES):
      digest.update(flat[start : start + CHUNK_BYTES])
  else:  # Copies one chunk of rows at a time.
    row_bytes = max(1, array.nbytes // max(1, len(array)))
    rows = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, len(array), rows):
      digest.update(np.ascontiguousarray(array[start : start + rows]).reshape(-1).view(np.uint8))


def row_chunks(array: np.ndarray, backing, rows: np.ndarray):
  """Yields array[chunk] (C-contiguous) for each chunk of SAMPLE_CHUNK_ROWS sorted rows.

  A whole-file memmap is read with pread after one POSIX_FADV_WILLNEED per row, so the
  kernel fetches all rows at once; page faults through the mapping fetch one readahead
  window at a time, ~50x slower on files out of the page cache (scripts/README.md).
  """
  row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
  chunks = [
    rows[start : start + SAMPLE_CHUNK_ROWS] for start in range(0, len(rows), SAMPLE_CHUNK_ROWS)
  ]
  advise = getattr(os, 'posix_fadvise', None)
  if backing is None or backing[1] is None or row_bytes == 0:
    for chunk in chunks:
      yield np.ascontiguousarray(array[chunk])
    return
  path, offset = backing
  fd = os.open(path, os.O_RDONLY)
  try:
    if advise:
      advise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # This descriptor only: no readahead around rows.
      for row in rows:
        advise(fd, offset + int(row) * row_bytes, row_bytes, os.POSIX_FADV_WILLNEED)
    for chunk in chunks:
      blob = b''.join(os.pread(fd, row_bytes, offset + int(row) * row_bytes) for row in chunk)
      if len(blob) != len(chunk) * row_bytes:
        raise ValueError(f'{path!r} is shorter than its header says ({array.shape}).')
      yield np.frombuffer(blob, array.dtype).reshape((len(chunk), *array.shape[1:]))
  finally:
    os.close(fd)


def hash_file(digest, path: str, offset: int, length: int) -> None:
  """Hashes bytes [offset, offset + length) of a file with plain reads (nothing stays mapped),
  asking the kernel to read the next chunk ahead while this one is hashed."""
  buffer = memoryview(bytearray(min(CHUNK_BYTES, max(1, length))))
  advise = getattr(os, 'posix_fadvise', None)
  fd = os.open(path, os.O_RDONLY)
  try:
    if advise:
      advise(fd, offset, length, os.POSIX_FADV_SEQUENTIAL)
    position, end = offset, offset + length
    while position < end:
      size = min(len(buffer), end - position)
      if advise and position + size < end:
        advise(fd, position + size, min(len(buffer), end - position - size), os.POSIX_FADV_WILLNEED)
      got = os.preadv(fd, [buffer[:size]], position)
      if got <= 0:
        raise ValueError(f'{path!r} ended at byte {position}, expected {end} bytes.')
      digest.update(buffer[:got])
      position += got
  finally:
    os.close(fd)


def file_facts(path: str, *, with_mtime: bool) -> dict[str, Any]:
  """Base name and size (and modification time in ns for the sampled method)."""
  stat = os.stat(path)
  facts = {'name': os.path.basename(path), 'bytes': int(stat.st_size)}
  if with_mtime:
    facts['mtime_ns'] = int(stat.st_mtime_ns)
  return facts


def hash_tree(digest, prefix: str, value) -> None:
  """Hashes a (nested) dict of arrays/scalars: each leaf's path, dtype, shape and bytes."""
  if isinstance(value, dict):
    for name in sorted(value):
      hash_tree(digest, f'{prefix}/{name}', value[name])
    return
  array = np.asarray(value)
  if array.dtype.hasobject:
    raise TypeError(f'cannot identify {prefix!r} of dtype object.')
  hash_array(digest, prefix, np.ascontiguousarray(array), None)
