"""Data sources with random access: gathering a batch costs O(P), not O(N).

A source maps example indices to a preprocessed batch
`{'x': float32 [P, ...], 'y': int32 [P] or float32 [P, classes]}`:

| `data.source` | what | needs |
|---|---|---|
| `digits` | scikit-learn's bundled 8x8 digits (1797 images), fixed split | nothing (offline) |
| `tfds` | any TFDS dataset, read with `tfds.data_source` (ArrayRecord, random access; no TensorFlow) | `data.name`, a prepared `data.data_dir` |
| `npz` | arrays `x_train, y_train, x_test, y_test` in an `.npz` file | `data.path` |
| `synthetic` | N examples computed from their index (O(1) memory at any N) | `data.num_examples`, `data.input_shape`, `data.num_classes` |

Preprocessing is declared in the config and uses public constants only
(fitting a mean on the private data would leak it):
x = (raw / scale − mean) / std per channel; labels as int or one-hot.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Protocol, Sequence

import ml_collections
import numpy as np

SOURCES = ('digits', 'tfds', 'npz', 'synthetic')
LABEL_FORMATS = ('int', 'one_hot')
DIGITS_TEST_SIZE = 360  # 20% of 1797, stratified, fixed split (random_state=0).


@dataclasses.dataclass(frozen=True)
class Preprocessor:
  """x = (raw / scale − mean) / std (per channel); labels int or one-hot."""

  scale: float
  mean: tuple[float, ...]
  std: tuple[float, ...]
  label_format: str
  num_classes: int

  def __call__(self, raw_x: np.ndarray, raw_y: np.ndarray) -> dict[str, np.ndarray]:
    x = np.asarray(raw_x, dtype=np.float32) / np.float32(self.scale)
    x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
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


def _preprocessor(config: ml_collections.ConfigDict, num_classes: int, channels: int) -> Preprocessor:
  if config.label_format not in LABEL_FORMATS:
    raise ValueError(f'data.label_format = {config.label_format!r}; valid: {", ".join(LABEL_FORMATS)}.')
  if not config.scale > 0:
    raise ValueError(f'data.scale must be > 0, got {config.scale}.')
  mean, std = tuple(config.mean), tuple(config.std)
  for field, value in (('data.mean', mean), ('data.std', std)):
    if len(value) not in (1, channels):
      raise ValueError(f'{field} has {len(value)} entries; it needs 1 or {channels} (channels).')
  if not all(s > 0 for s in std):
    raise ValueError(f'data.std entries must be > 0, got {std}.')
  return Preprocessor(float(config.scale), mean, std, config.label_format, int(num_classes))


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """scikit-learn's digits as (x_train, y_train, x_test, y_test); x is [n, 8, 8, 1] in 0..16."""
  from sklearn import datasets as sk_datasets  # pylint: disable=g-import-not-at-top
  from sklearn import model_selection  # pylint: disable=g-import-not-at-top
  digits = sk_datasets.load_digits()
  images = digits.images.astype(np.float32)[..., None]
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
      images, digits.target, test_size=DIGITS_TEST_SIZE, random_state=0, stratify=digits.target)
  return x_train, y_train.astype(np.int64), x_test, y_test.astype(np.int64)


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
  preprocess = _preprocessor(config, features[config.label_key].num_classes, shape[-1])
  return TfdsSource(source, config.image_key, config.label_key, preprocess, shape)


def make_sources(config: ml_collections.ConfigDict, seed: int = 0) -> tuple[DataSource, DataSource]:
  """The (train, test) sources described by `config` (the `data` block)."""
  if config.source not in SOURCES:
    raise ValueError(f'data.source = {config.source!r} is unknown; valid: {", ".join(SOURCES)}.')
  if config.source == 'digits':
    x_train, y_train, x_test, y_test = load_digits_arrays()
    preprocess = _preprocessor(config, 10, 1)
    return ArraySource(x_train, y_train, preprocess), ArraySource(x_test, y_test, preprocess)
  if config.source == 'npz':
    if not config.path or not os.path.isfile(config.path):
      raise ValueError(f'data.path = {config.path!r} must name an existing .npz file '
                       '(with x_train, y_train, x_test, y_test).')
    with np.load(config.path) as arrays:
      missing = {'x_train', 'y_train', 'x_test', 'y_test'} - set(arrays.files)
      if missing:
        raise ValueError(f'data.path = {config.path!r} lacks arrays {sorted(missing)}.')
      x_train, y_train, x_test, y_test = (arrays[k] for k in ('x_train', 'y_train', 'x_test', 'y_test'))
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    preprocess = _preprocessor(config, num_classes, x_train.shape[-1] if x_train.ndim > 1 else 1)
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
