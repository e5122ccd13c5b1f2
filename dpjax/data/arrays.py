"""Sources over arrays: in memory, read from an `.npz` file, or memory-mapped `.npy` files.

`ArraySource` gathers a batch by fancy indexing, O(P) whatever N. The `memmap` layout is
`<data.path>/<split>/{x,y}.npy` (x [N, ...] any numeric dtype, y [N] integer labels), read
with `np.load(mmap_mode='r')`: a gather of b rows touches O(b) pages.
`write_memmap_split` builds such a split from chunks, so 10^8 rows never sit in RAM.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

import numpy as np

from dpjax.data import preprocess as preprocess_lib

MEMMAP_FILES = ('x.npy', 'y.npy')  # One pair per split directory.
NPZ_ARRAYS = ('x_train', 'y_train', 'x_test', 'y_test')


@dataclasses.dataclass(frozen=True)
class ArraySource:
  """In-memory (or memory-mapped) arrays; `gather` is fancy indexing."""

  images: np.ndarray
  labels: np.ndarray
  preprocess: preprocess_lib.Preprocessor

  @property
  def num_classes(self) -> int:
    return self.preprocess.num_classes

  @property
  def input_shape(self) -> tuple[int, ...]:
    return tuple(self.images.shape[1:])

  def __len__(self) -> int:
    return len(self.labels)

  def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    return self.preprocess(self.images[indices], self.labels[indices])


def load_npz(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(x_train, y_train, x_test, y_test) of the `.npz` file `path`; errors name `data.path`."""
  if not path or not os.path.isfile(path):
    raise ValueError(
      f'data.path = {path!r} must name an existing .npz file '
      '(with x_train, y_train, x_test, y_test).'
    )
  try:
    arrays = np.load(path, allow_pickle=False)
  except Exception as e:  # pylint: disable=broad-except  # Not a NumPy file at all.
    raise ValueError(
      f'data.path = {path!r}: not an .npz file ({type(e).__name__}: {e}); '
      'write one with np.savez(path, x_train=..., y_train=..., x_test=..., '
      'y_test=...).'
    ) from None
  if not isinstance(arrays, np.lib.npyio.NpzFile):
    raise ValueError(
      f'data.path = {path!r}: a single .npy array, not an .npz archive; the '
      'npz source needs x_train, y_train, x_test, y_test (np.savez), and '
      "data.source = 'memmap' reads <split>/x.npy and <split>/y.npy."
    )
  with arrays:
    missing = set(NPZ_ARRAYS) - set(arrays.files)
    if missing:
      raise ValueError(
        f'data.path = {path!r} lacks arrays {sorted(missing)} (it has {sorted(arrays.files)}).'
      )
    try:
      return tuple(arrays[k] for k in NPZ_ARRAYS)
    except ValueError as e:  # Object arrays need pickle: strings, ragged lists.
      raise ValueError(
        f'data.path = {path!r}: an array holds Python objects ({e}); '
        'features must be numeric and labels integers.'
      ) from None


def write_memmap_split(
  directory: str, num_examples: int, chunks: Iterable[tuple[np.ndarray, np.ndarray]]
) -> None:
  """Writes one split as `directory/x.npy`, `directory/y.npy`, one chunk at a time.

  The .npy headers declare all N rows up front and each chunk is appended with
  a plain write, so memory is one chunk whatever N. The files appear (by
  rename) only once all N rows are written.

  Args:
    directory: the split's directory, e.g. `<data.path>/train` (created).
    num_examples: N, the total number of rows in `chunks`.
    chunks: (x, y) pairs: x [n, ...] with the first chunk's row shape and a
      dtype that casts safely to the first chunk's, y [n] integers >= 0.
  """
  if (
    isinstance(num_examples, bool)
    or not isinstance(num_examples, (int, np.integer))
    or num_examples < 1
  ):
    raise ValueError(f'num_examples must be an integer >= 1, got {num_examples!r}.')
  os.makedirs(directory, exist_ok=True)
  paths = [os.path.join(directory, name) for name in MEMMAP_FILES]
  partial = [path + '.partial' for path in paths]
  written, dtypes, row_shape = 0, None, None
  try:
    with open(partial[0], 'wb') as x_file, open(partial[1], 'wb') as y_file:
      for x, y in chunks:
        x, y = np.asarray(x), np.asarray(y)
        if dtypes is None:  # The first chunk fixes the dtypes and the row shape.
          if not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f'labels must be integers, got dtype {y.dtype}.')
          dtypes, row_shape = (x.dtype, y.dtype), x.shape[1:]
          for file, dtype, shape in (
            (x_file, x.dtype, (num_examples, *row_shape)),
            (y_file, y.dtype, (num_examples,)),
          ):
            np.lib.format.write_array_header_1_0(
              file,
              {
                'descr': np.lib.format.dtype_to_descr(dtype),
                'fortran_order': False,
                'shape': shape,
              },
            )
        if x.shape[1:] != row_shape or y.shape != (len(x),):
          raise ValueError(
            f'chunk of shapes x {x.shape}, y {y.shape} does not match rows of '
            f'shape {row_shape} with one label each.'
          )
        if not (np.can_cast(x.dtype, dtypes[0]) and np.can_cast(y.dtype, dtypes[1])):
          raise ValueError(
            f'chunk dtypes ({x.dtype}, {y.dtype}) do not cast safely to the '
            f"first chunk's ({dtypes[0]}, {dtypes[1]})."
          )
        if y.size and y.min() < 0:
          raise ValueError(f'labels must be >= 0, got {y.min()}.')
        written += len(x)
        if written > num_examples:
          raise ValueError(f'chunks hold more than num_examples = {num_examples} rows.')
        x_file.write(np.ascontiguousarray(x, dtypes[0]).tobytes())
        y_file.write(np.ascontiguousarray(y, dtypes[1]).tobytes())
    if written != num_examples:
      raise ValueError(f'chunks hold {written} rows, num_examples = {num_examples}.')
  except BaseException:
    for path in partial:
      if os.path.exists(path):
        os.remove(path)
    raise
  for src, dst in zip(partial, paths):
    os.replace(src, dst)


def open_memmap_split(directory: str) -> tuple[np.ndarray, np.ndarray]:
  """(x, y) of a split written as `directory/{x,y}.npy`, memory-mapped read-only.

  Errors name `data.path`; `sources.make_sources` then checks the content (`data_validation`:
  labels in chunks, O(N) time and O(chunk) memory; features on a sample of rows).
  """
  if not os.path.isdir(directory):
    raise ValueError(
      f'data.path: {directory!r} is not a directory; the memmap source needs '
      f'<data.path>/<split>/{{{",".join(MEMMAP_FILES)}}} (see '
      'dpjax.data.arrays.write_memmap_split).'
    )
  arrays = []
  for name in MEMMAP_FILES:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      raise ValueError(
        f'data.path: {path!r} is missing (the memmap source needs '
        f'{" and ".join(MEMMAP_FILES)} in every split directory).'
      )
    try:
      arrays.append(np.load(path, mmap_mode='r'))
    except Exception as e:  # Bad magic, header or a truncated file (mmap beyond its size).
      raise ValueError(f'data.path: {path!r} is not a complete .npy file: {e}') from e
  x, y = arrays
  if not np.issubdtype(y.dtype, np.integer):
    raise ValueError(
      f'data.path: {os.path.join(directory, "y.npy")!r} has dtype {y.dtype}; '
      'memory-mapped labels must be integers.'
    )
  return x, y
