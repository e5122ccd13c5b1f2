"""Data sources with random access: gathering a batch costs O(P), not O(N).

A source maps example indices to a preprocessed batch
`{'x': float32 [P, ...], 'y': int32 [P] or float32 [P, classes]}`:

| `data.source` | what | needs |
|---|---|---|
| `digits` | scikit-learn's bundled 8x8 digits (1797 images), fixed split | nothing (offline) |
| `tfds` | any TFDS dataset, read with `tfds.data_source` (ArrayRecord, random access; no TensorFlow) | `data.name`, a prepared `data.data_dir` |
| `npz` | arrays `x_train, y_train, x_test, y_test` in an `.npz` file | `data.path` |
| `memmap` | `.npy` files `x.npy`, `y.npy` per split, memory-mapped (N beyond RAM) | `data.path` (see below) |
| `synthetic` | N examples computed from their index (O(1) memory at any N) | `data.num_examples`, `data.input_shape`, `data.num_classes` |

Preprocessing is declared in the config and uses public constants only
(fitting a mean on the private data would leak it):
x = (raw / scale − mean) / std per channel; labels as int or one-hot.

The `memmap` source reads `<data.path>/<data.train_split>/{x,y}.npy` and
`<data.path>/<data.test_split>/{x,y}.npy` (x [N, ...] any numeric dtype, y [N]
integer labels) with `np.load(mmap_mode='r')`: a gather of b rows touches
O(b) pages, whatever N. `write_memmap_split` builds such a split from chunks, so
10^8 rows never sit in RAM.

Every source is checked when it is opened (`dpjax.data_validation`): integer
labels in [0, K), K declared (`data.num_classes`) or derived from the training
labels, finite features, one label per example, the same row shape in every
split; one line names the file, split, array and row. `data.scale = 0`
derives the scale from the data (digits: 16; uint8: 255; floats: 1).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Protocol, Sequence

import ml_collections
import numpy as np

from dpjax import data_validation

SOURCES = ('digits', 'tfds', 'npz', 'memmap', 'synthetic')
LABEL_FORMATS = ('int', 'one_hot')
DIGITS_TEST_SIZE = 360  # 20% of 1797, stratified, fixed split (random_state=0).
DIGITS_RANGE = 16.0  # Digits pixels are 0..16: data.scale = 0 divides by it.
MEMMAP_FILES = ('x.npy', 'y.npy')  # One pair per split directory.


@dataclasses.dataclass(frozen=True)
class Preprocessor:
  """x = (raw / scale − mean) / std (per channel); labels int or one-hot."""

  scale: float
  mean: tuple[float, ...]
  std: tuple[float, ...]
  label_format: str
  num_classes: int  # Classes (labels), the output size (values) or the vocabulary (tokens).
  scale_source: str = 'data.scale'  # Where the scale came from (printed at start).
  targets: str = 'labels'  # 'labels' (classes), 'values' (regression) or 'tokens' (sequences).

  def describe(self) -> str:
    """One line: the preprocessing and where its scale came from."""
    if self.targets == 'tokens':
      return f'x, y = int tokens (vocabulary {self.num_classes}; y = -1: padding)'
    fmt = lambda v: ', '.join(f'{x:g}' for x in v)
    kind = (f'{self.num_classes} classes, labels {self.label_format}' if self.targets == 'labels'
            else f'float targets of size {self.num_classes}')
    return (f'x = (raw / {self.scale:g} − ({fmt(self.mean)})) / ({fmt(self.std)}) '
            f'[scale: {self.scale_source}], {kind}')

  def __call__(self, raw_x: np.ndarray, raw_y: np.ndarray) -> dict[str, np.ndarray]:
    if self.targets == 'tokens':
      return {'x': np.asarray(raw_x).astype(np.int32), 'y': np.asarray(raw_y).astype(np.int32)}
    x = np.asarray(raw_x, dtype=np.float32) / np.float32(self.scale)
    x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
    if self.targets == 'values':
      return {'x': x, 'y': np.asarray(raw_y, np.float32).reshape(len(x), -1)}
    y = np.asarray(raw_y).astype(np.int32)
    if self.label_format == 'one_hot':
      y = np.eye(self.num_classes, dtype=np.float32)[y]
    return {'x': x, 'y': y}


class DataSource(Protocol):
  """Random access to a preprocessed split."""

  num_classes: int
  input_shape: tuple[int, ...]

  def __len__(self) -> int: ...

  def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]: ...


@dataclasses.dataclass(frozen=True)
class ArraySource:
  """In-memory (or memory-mapped) arrays; `gather` is fancy indexing."""

  images: np.ndarray
  labels: np.ndarray
  preprocess: Preprocessor

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


@dataclasses.dataclass(frozen=True)
class TfdsSource:
  """A split read through `tfds.data_source` (random access, no TensorFlow)."""

  source: Sequence
  image_key: str
  label_key: str
  preprocess: Preprocessor
  input_shape: tuple[int, ...]

  @property
  def num_classes(self) -> int:
    return self.preprocess.num_classes

  def __len__(self) -> int:
    return len(self.source)

  def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    keys = [int(i) for i in indices]
    try:
      records = self.source.__getitems__(keys)  # One batched ArrayRecord read.
    except TypeError:  # tfds.testing.mock_data's source lacks the batched read.
      records = [self.source[k] for k in keys]
    images = np.stack([r[self.image_key] for r in records]) if records else np.zeros(
        (0, *self.input_shape), np.float32)
    labels = np.asarray([r[self.label_key] for r in records], dtype=np.int64)
    return self.preprocess(images, labels)


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
  """N examples computed from their index: O(P) per gather, O(1) memory in N.

  Features are uniform in [-1, 1) (no further preprocessing), from a counter-based hash (SplitMix64) of
  (seed, index, feature); the label is the argmax of a fixed linear teacher
  (class c scores the features j ≡ c mod classes), so the task is learnable. Meant for benchmarks at any scale.
  """

  num_examples: int
  input_shape: tuple[int, ...]
  num_classes: int
  seed: int = 0
  offset: int = 0  # The test split uses indices shifted past the training split.
  one_hot: bool = False

  def __len__(self) -> int:
    return self.num_examples

  def _features(self, indices: np.ndarray) -> np.ndarray:
    dim = int(np.prod(self.input_shape))
    counters = ((np.asarray(indices, np.uint64)[:, None] + np.uint64(self.offset)) * np.uint64(dim)
                + np.arange(dim, dtype=np.uint64)[None, :])
    bits = _splitmix64(counters ^ np.uint64(self.seed * 0x9E3779B97F4A7C15 % 2**64))
    uniform = (bits >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)
    return (2 * uniform - 1).reshape((len(indices), *self.input_shape))

  def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    x = self._features(indices)
    # Teacher: class c scores the sum of features j with j ≡ c (mod classes);
    # BLAS-free so gathering stays cheap on a busy machine.
    flat = x.reshape(len(x), -1)
    width = -(-flat.shape[1] // self.num_classes) * self.num_classes
    padded = np.zeros((len(x), width), np.float32)
    padded[:, :flat.shape[1]] = flat
    scores = padded.reshape(len(x), -1, self.num_classes).sum(axis=1)
    y = np.argmax(scores, axis=1).astype(np.int32)
    if self.one_hot:
      return {'x': x, 'y': np.eye(self.num_classes, dtype=np.float32)[y]}
    return {'x': x, 'y': y}


def _splitmix64(z: np.ndarray) -> np.ndarray:
  with np.errstate(over='ignore'):
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _preprocessor(config: ml_collections.ConfigDict, num_classes: int, channels: int,
                  raw_dtype=np.float32, native_scale: float | None = None,
                  targets: str = 'labels') -> Preprocessor:
  """The config's preprocessing; `data.scale = 0` derives the scale from the data.

  Derived: the source's own range (digits: 16), else 255 for uint8 and the integer type's
  maximum for other integers, 1 for floats (`data_validation.auto_scale`).
  """
  if config.label_format not in LABEL_FORMATS:
    raise ValueError(f'data.label_format = {config.label_format!r}; valid: {", ".join(LABEL_FORMATS)}.')
  if config.scale:
    if not config.scale > 0:
      raise ValueError(f'data.scale must be > 0 (0 = derived from the data), got {config.scale}.')
    scale, source = float(config.scale), 'data.scale'
  elif native_scale is not None:
    scale, source = float(native_scale), f"data.scale = 0: the {config.source} data's range"
  else:
    scale = data_validation.auto_scale(raw_dtype)
    source = f'data.scale = 0: derived from the {np.dtype(raw_dtype).name} data'
  mean, std = tuple(config.mean), tuple(config.std)
  for field, value in (('data.mean', mean), ('data.std', std)):
    if len(value) not in (1, channels):
      raise ValueError(f'{field} has {len(value)} entries; it needs 1 or {channels} (channels).')
  if not all(s > 0 for s in std):
    raise ValueError(f'data.std entries must be > 0, got {std}.')
  return Preprocessor(scale, mean, std, config.label_format, int(num_classes), source, targets)


TARGETS = {'softmax_cross_entropy': 'labels', 'mse': 'values', 'sequence_cross_entropy': 'tokens'}


def _checked_arrays(where: str, declared_classes: int, x_train, y_train, x_test, y_test,
                    mapped: bool = False, targets: str = 'labels'):
  """(y_train, y_test, K) after `data_validation`'s checks of both splits (one line each).

  K: the number of classes (labels), the target size (values) or the vocabulary (tokens).
  """
  checks = data_validation
  if targets == 'values':
    checks.check_features(f'{where}: x_train', x_train, mapped=mapped)
    checks.check_features(f'{where}: x_test', x_test, mapped=mapped)
    checks.check_same_rows(f'{where}: x_train', x_train.shape[1:], f'{where}: x_test',
                           x_test.shape[1:])
    size = checks.check_targets(f'{where}: y_train', y_train, num_examples=len(x_train))
    if checks.check_targets(f'{where}: y_test', y_test, num_examples=len(x_test)) != size:
      raise checks.DataError(f'{where}: y_test: targets of another size than y_train\'s {size}.')
    return y_train, y_test, size
  if targets == 'tokens':
    sizes = [checks.check_tokens(f'{where}: {name}', a, num_examples=len(x), low=low,
                                 length=None if name.startswith('x') else x.shape[1])
             for name, a, x, low in (('x_train', x_train, x_train, 0), ('y_train', y_train,
                                     x_train, -1), ('x_test', x_test, x_test, 0),
                                     ('y_test', y_test, x_test, -1))]
    vocab = declared_classes or max(sizes)
    if max(sizes) > vocab:
      raise checks.DataError(f'{where}: token {max(sizes) - 1} is not below data.num_classes = '
                             f'{vocab} (the vocabulary size).')
    return y_train, y_test, vocab
  checks.check_features(f'{where}: x_train', x_train, mapped=mapped)
  checks.check_features(f'{where}: x_test', x_test, mapped=mapped)
  checks.check_same_rows(f'{where}: x_train', x_train.shape[1:], f'{where}: x_test',
                         x_test.shape[1:])
  y_train = checks.check_labels(f'{where}: y_train', y_train, num_examples=len(x_train))
  y_test = checks.check_labels(f'{where}: y_test', y_test, num_examples=len(x_test))
  num_classes = checks.num_classes_of(f'{where}: y_train', y_train, declared_classes)
  checks.check_test_labels(f'{where}: y_test', y_test, num_classes)
  return y_train, y_test, num_classes


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """scikit-learn's digits as (x_train, y_train, x_test, y_test); x is [n, 8, 8, 1] in 0..16."""
  from sklearn import datasets as sk_datasets  # pylint: disable=g-import-not-at-top
  from sklearn import model_selection  # pylint: disable=g-import-not-at-top
  digits = sk_datasets.load_digits()
  images = digits.images.astype(np.float32)[..., None]
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
      images, digits.target, test_size=DIGITS_TEST_SIZE, random_state=0, stratify=digits.target)
  return x_train, y_train.astype(np.int64), x_test, y_test.astype(np.int64)


def write_memmap_split(directory: str, num_examples: int,
                       chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
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
  if (isinstance(num_examples, bool) or not isinstance(num_examples, (int, np.integer))
      or num_examples < 1):
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
          for file, dtype, shape in ((x_file, x.dtype, (num_examples, *row_shape)),
                                     (y_file, y.dtype, (num_examples,))):
            np.lib.format.write_array_header_1_0(file, {
                'descr': np.lib.format.dtype_to_descr(dtype), 'fortran_order': False,
                'shape': shape})
        if x.shape[1:] != row_shape or y.shape != (len(x),):
          raise ValueError(f'chunk of shapes x {x.shape}, y {y.shape} does not match rows of '
                           f'shape {row_shape} with one label each.')
        if not (np.can_cast(x.dtype, dtypes[0]) and np.can_cast(y.dtype, dtypes[1])):
          raise ValueError(f'chunk dtypes ({x.dtype}, {y.dtype}) do not cast safely to the '
                           f'first chunk\'s ({dtypes[0]}, {dtypes[1]}).')
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

  Errors name `data.path`; `make_sources` then checks the content (`data_validation`:
  labels in chunks, O(N) time and O(chunk) memory; features on a sample of rows).
  """
  if not os.path.isdir(directory):
    raise ValueError(f'data.path: {directory!r} is not a directory; the memmap source needs '
                     f'<data.path>/<split>/{{{",".join(MEMMAP_FILES)}}} (see data.write_memmap_split).')
  arrays = []
  for name in MEMMAP_FILES:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      raise ValueError(f'data.path: {path!r} is missing (the memmap source needs '
                       f'{" and ".join(MEMMAP_FILES)} in every split directory).')
    try:
      arrays.append(np.load(path, mmap_mode='r'))
    except Exception as e:  # Bad magic, header or a truncated file (mmap beyond its size).
      raise ValueError(f'data.path: {path!r} is not a complete .npy file: {e}') from e
  x, y = arrays
  if not np.issubdtype(y.dtype, np.integer):
    raise ValueError(f'data.path: {os.path.join(directory, "y.npy")!r} has dtype {y.dtype}; '
                     'memory-mapped labels must be integers.')
  return x, y


def _tfds_split(config, split: str) -> TfdsSource:
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    source = tfds.data_source(config.name, split=split, data_dir=config.data_dir, download=False)
  except Exception as e:  # TFDS raises several types for unprepared data.
    raise ValueError(
        f'Could not open TFDS dataset data.name = {config.name!r}, split {split!r}, in '
        f'data.data_dir = {config.data_dir!r}: {e}\nPrepare it on a machine with network access '
        f'in ArrayRecord format, e.g. `tfds build {config.name} --data_dir DIR '
        f'--file_format=array_record`, and point data.data_dir at DIR.') from e
  features = source.dataset_info.features
  for key in (config.image_key, config.label_key):
    if key not in features:
      raise ValueError(f'TFDS dataset {config.name!r} has no feature {key!r} '
                       f'(data.image_key / data.label_key); it has {list(features)}.')
  shape = tuple(features[config.image_key].shape)
  labels = features[config.label_key]
  declared = int(config.get('num_classes', 0) or 0)
  num_classes = getattr(labels, 'num_classes', None)
  if num_classes is None:
    raise ValueError(f'TFDS dataset {config.name!r}: feature {config.label_key!r} is not a class '
                     'label (data.label_key); dpjax trains classifiers on integer labels.')
  if declared and declared < num_classes:
    raise ValueError(f'data.num_classes = {declared}: the TFDS dataset {config.name!r} declares '
                     f'{num_classes} classes; data.num_classes must be 0 (take them) or >= '
                     f'{num_classes}.')
  # np_dtype: the feature's numpy dtype (its `dtype` would import TensorFlow).
  dtype = np.dtype(getattr(features[config.image_key], 'np_dtype', None) or np.float32)
  preprocess = _preprocessor(config, declared or num_classes, shape[-1], dtype)
  return TfdsSource(source, config.image_key, config.label_key, preprocess, shape)


def make_sources(config: ml_collections.ConfigDict, seed: int = 0,
                 loss: str = 'softmax_cross_entropy') -> tuple[DataSource, DataSource]:
  """The (train, test) sources described by `config` (the `data` block)."""
  if config.source not in SOURCES:
    raise ValueError(f'data.source = {config.source!r} is unknown; valid: {", ".join(SOURCES)}.')
  if TARGETS.get(loss, 'labels') != 'labels' and config.source not in ('npz', 'memmap'):
    raise ValueError(f'loss = {loss!r} needs targets from your own arrays: data.source = '
                     f"'npz' or 'memmap' (got {config.source!r}, whose labels are classes).")
  declared = int(config.get('num_classes', 0) or 0) if config.source != 'synthetic' else 0
  if config.source == 'digits':
    x_train, y_train, x_test, y_test = load_digits_arrays()
    y_train, y_test, num_classes = _checked_arrays('digits', declared, x_train, y_train, x_test,
                                                   y_test)
    preprocess = _preprocessor(config, num_classes, 1, native_scale=DIGITS_RANGE)
    return ArraySource(x_train, y_train, preprocess), ArraySource(x_test, y_test, preprocess)
  if config.source == 'npz':
    path = config.path
    if not path or not os.path.isfile(path):
      raise ValueError(f'data.path = {path!r} must name an existing .npz file '
                       '(with x_train, y_train, x_test, y_test).')
    try:
      arrays = np.load(path, allow_pickle=False)
    except Exception as e:  # pylint: disable=broad-except  # Not a NumPy file at all.
      raise ValueError(f'data.path = {path!r}: not an .npz file ({type(e).__name__}: {e}); '
                       'write one with np.savez(path, x_train=..., y_train=..., x_test=..., '
                       'y_test=...).') from None
    if not isinstance(arrays, np.lib.npyio.NpzFile):
      raise ValueError(f'data.path = {path!r}: a single .npy array, not an .npz archive; the '
                       "npz source needs x_train, y_train, x_test, y_test (np.savez), and "
                       "data.source = 'memmap' reads <split>/x.npy and <split>/y.npy.")
    with arrays:
      missing = {'x_train', 'y_train', 'x_test', 'y_test'} - set(arrays.files)
      if missing:
        raise ValueError(f'data.path = {path!r} lacks arrays {sorted(missing)} (it has '
                         f'{sorted(arrays.files)}).')
      try:
        x_train, y_train, x_test, y_test = (arrays[k] for k in ('x_train', 'y_train', 'x_test',
                                                                'y_test'))
      except ValueError as e:  # Object arrays need pickle: strings, ragged lists.
        raise ValueError(f'data.path = {path!r}: an array holds Python objects ({e}); '
                         'features must be numeric and labels integers.') from None
    targets = TARGETS[loss]
    y_train, y_test, num_classes = _checked_arrays(f'data.path = {path!r}', declared, x_train,
                                                   y_train, x_test, y_test, targets=targets)
    preprocess = _preprocessor(config, num_classes, x_train.shape[-1] if x_train.ndim > 1 else 1,
                               x_train.dtype, targets=targets)
    return ArraySource(x_train, y_train, preprocess), ArraySource(x_test, y_test, preprocess)
  if config.source == 'memmap':
    if not config.path or not os.path.isdir(config.path):
      raise ValueError(f"data.path = {config.path!r} must be an existing directory when "
                       f"data.source = 'memmap' (with <split>/x.npy and <split>/y.npy for "
                       f"data.train_split = {config.train_split!r}, data.test_split = "
                       f"{config.test_split!r}).")
    (x_train, y_train), (x_test, y_test) = (
        open_memmap_split(os.path.join(config.path, split))
        for split in (config.train_split, config.test_split))
    targets = TARGETS[loss]
    _, _, num_classes = _checked_arrays(f'data.path = {config.path!r}', declared, x_train,
                                        y_train, x_test, y_test, mapped=True, targets=targets)
    preprocess = _preprocessor(config, num_classes, x_train.shape[-1] if x_train.ndim > 1 else 1,
                               x_train.dtype, targets=targets)
    return ArraySource(x_train, y_train, preprocess), ArraySource(x_test, y_test, preprocess)
  if config.source == 'tfds':
    if not config.name:
      raise ValueError("data.name must name a TFDS dataset when data.source = 'tfds'.")
    if not config.data_dir or not os.path.isdir(config.data_dir):
      raise ValueError(
          f'data.data_dir = {config.data_dir!r} must be an existing directory holding the prepared '
          f'TFDS dataset {config.name!r} (datasets are never downloaded at run time).')
    return _tfds_split(config, config.train_split), _tfds_split(config, config.test_split)
  # synthetic
  if not isinstance(config.num_examples, int) or config.num_examples < 1:
    raise ValueError(f'data.num_examples must be an integer >= 1 for the synthetic source, '
                     f'got {config.num_examples!r}.')
  if config.num_classes < 2:
    raise ValueError(f'data.num_classes must be >= 2, got {config.num_classes}.')
  if config.label_format not in LABEL_FORMATS:
    raise ValueError(f'data.label_format = {config.label_format!r}; valid: {", ".join(LABEL_FORMATS)}.')
  shape = tuple(int(d) for d in config.input_shape)
  test_size = max(1, min(10_000, config.num_examples // 5))
  one_hot = config.label_format == 'one_hot'
  return (SyntheticSource(config.num_examples, shape, config.num_classes, seed, one_hot=one_hot),
          SyntheticSource(test_size, shape, config.num_classes, seed, config.num_examples, one_hot))
