"""Data sources with random access: gathering a batch costs O(P), not O(N).

A source maps example indices to a preprocessed batch
`{'x': float32 [P, ...], 'y': int32 [P] or float32 [P, classes]}`:

| `data.source` | what | needs |
|---|---|---|
| `digits` | the 8x8 digits (1797 images, scikit-learn's), embedded with a fixed split (`digits`) | nothing (offline) |
| `tfds` | any TFDS dataset, read with `tfds.data_source` (ArrayRecord, random access; no TensorFlow; `tfds_source`) | `data.name`, a prepared `data.data_dir` |
| `npz` | arrays `x_train, y_train, x_test, y_test` in an `.npz` file (`arrays`) | `data.path` |
| `memmap` | `.npy` files `x.npy`, `y.npy` per split, memory-mapped (N beyond RAM; `arrays`) | `data.path` (see below) |
| `synthetic` | N examples computed from their index (O(1) memory at any N; `synthetic`) | `data.num_examples`, `data.input_shape`, `data.num_classes` |

Preprocessing is declared in the config and uses public constants only
(fitting a mean on the private data would leak it; `preprocess`):
x = (raw / scale − mean) / std per channel; labels as int or one-hot.

The `memmap` source reads `<data.path>/<data.train_split>/{x,y}.npy` and
`<data.path>/<data.test_split>/{x,y}.npy` (x [N, ...] any numeric dtype, y [N]
integer labels) with `np.load(mmap_mode='r')`: a gather of b rows touches
O(b) pages, whatever N. `arrays.write_memmap_split` builds such a split from
chunks, so 10^8 rows never sit in RAM.

Sizes that shape the model come from public information only (`public_num_classes`):
K is `data.num_classes`, else the source's public description (digits: 10; TFDS: the
label feature's `num_classes`); npz and memmap labels or tokens need it declared, since
max(y) + 1 would reveal a record's label in the model's shape. Every source is checked
when it is opened (`dpjax.data.validation`): integer labels in [0, K), finite features
within the public bound `data.max_abs_feature` after the preprocessing, one label per
example, the same row shape in every split; one line names the file,
split, array and row. `data.scale = 0` takes the scale from the data's public format,
never its values (digits: 16; uint8: 255; floats: 1).
"""

from __future__ import annotations

import os
from typing import Protocol

import ml_collections
import numpy as np

from dpjax.data import arrays
from dpjax.data import digits
from dpjax.data import preprocess
from dpjax.data import synthetic
from dpjax.data import tfds_source
from dpjax.data import validation as data_validation

SOURCES = ('digits', 'tfds', 'npz', 'memmap', 'synthetic')
LABEL_FORMATS = ('int', 'one_hot')
TARGETS = {'softmax_cross_entropy': 'labels', 'mse': 'values', 'sequence_cross_entropy': 'tokens'}


class DataSource(Protocol):
  """Random access to a preprocessed split."""

  num_classes: int
  input_shape: tuple[int, ...]

  def __len__(self) -> int: ...

  def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]: ...


def make_sources(
  config: ml_collections.ConfigDict, seed: int = 0, loss: str = 'softmax_cross_entropy'
) -> tuple[DataSource, DataSource]:
  """The (train, test) sources described by `config` (the `data` block)."""
  if config.source not in SOURCES:
    raise ValueError(f'data.source = {config.source!r} is unknown; valid: {", ".join(SOURCES)}.')
  if TARGETS.get(loss, 'labels') != 'labels' and config.source not in ('npz', 'memmap'):
    raise ValueError(
      f'loss = {loss!r} needs targets from your own arrays: data.source = '
      f"'npz' or 'memmap' (got {config.source!r}, whose labels are classes)."
    )
  if config.source == 'synthetic':
    return _synthetic_sources(config, seed)
  if config.source == 'tfds':
    return _tfds_sources(config)
  declared = public_num_classes(config, TARGETS[loss])
  if config.source == 'digits':
    return _array_sources(
      config, 'digits', declared, digits.load_digits_arrays(), native_scale=digits.DIGITS_RANGE
    )
  if config.source == 'npz':
    return _array_sources(
      config,
      f'data.path = {config.path!r}',
      declared,
      arrays.load_npz(config.path),
      targets=TARGETS[loss],
    )
  # memmap
  if not config.path or not os.path.isdir(config.path):
    raise ValueError(
      f'data.path = {config.path!r} must be an existing directory when '
      f"data.source = 'memmap' (with <split>/x.npy and <split>/y.npy for "
      f'data.train_split = {config.train_split!r}, data.test_split = '
      f'{config.test_split!r}).'
    )
  (x_train, y_train), (x_test, y_test) = (
    arrays.open_memmap_split(os.path.join(config.path, split))
    for split in (config.train_split, config.test_split)
  )
  return _array_sources(
    config,
    f'data.path = {config.path!r}',
    declared,
    (x_train, y_train, x_test, y_test),
    mapped=True,
    targets=TARGETS[loss],
  )


def public_num_classes(config: ml_collections.ConfigDict, targets: str = 'labels') -> int:
  """K of an array source (digits, npz, memmap) from public information, before the data is read.

  `data.num_classes` when given; else digits' 10 (its public description); npz and memmap
  labels or tokens are refused (one line naming the field): K derived from the labels as
  max + 1 would make the model's shape a function of one record (a head of 11 outputs only
  if some record is labelled 10). Regression targets ('values') take their width from the
  arrays' shape, so K is not needed (0).
  """
  declared = int(config.get('num_classes', 0) or 0)
  if declared or targets == 'values':
    return declared
  if config.source == 'digits':
    return digits.DIGITS_NUM_CLASSES
  what = (
    'the number of classes K (labels in [0, K))'
    if targets == 'labels'
    else ('the vocabulary size V (tokens in [0, V))')
  )
  raise ValueError(
    f'data.num_classes = 0: set it to {what} of your task (data.source = '
    f"{config.source!r}). It must come from the task's definition, not from the "
    'private labels: a size derived from them (max + 1) would reveal in the '
    "model's shape whether a record with the largest label is in the data."
  )


def _check_label_format(config: ml_collections.ConfigDict) -> None:
  if config.label_format not in LABEL_FORMATS:
    raise ValueError(
      f'data.label_format = {config.label_format!r}; valid: {", ".join(LABEL_FORMATS)}.'
    )


def _array_sources(
  config: ml_collections.ConfigDict,
  where: str,
  num_classes: int,
  splits,
  mapped: bool = False,
  targets: str = 'labels',
  native_scale: float | None = None,
) -> tuple[DataSource, DataSource]:
  """`ArraySource`s of (x_train, y_train, x_test, y_test), checked (`where` names them).

  num_classes: K from `public_num_classes`. Memory-mapped labels are checked but kept as
  they are (no in-memory int64 copy).
  """
  x_train, y_train, x_test, y_test = splits
  checked_train, checked_test, size = data_validation.check_splits(
    where, num_classes, x_train, y_train, x_test, y_test, mapped=mapped, targets=targets
  )
  if not mapped:
    y_train, y_test = checked_train, checked_test
  _check_label_format(config)
  if native_scale is not None:  # The source's own range, one channel (digits).
    preprocess_fn = preprocess.make_preprocessor(config, size, 1, native_scale=native_scale)
  else:
    preprocess_fn = preprocess.make_preprocessor(
      config, size, x_train.shape[-1] if x_train.ndim > 1 else 1, x_train.dtype, targets=targets
    )
  if targets != 'tokens':  # The public domain of records (`data.max_abs_feature`).
    bound = float(config.get('max_abs_feature', data_validation.MAX_ABS_FEATURE))
    for name, x in (('x_train', x_train), ('x_test', x_test)):
      data_validation.check_feature_bound(
        f'{where}: {name}', x, preprocess_fn.features, bound, mapped=mapped
      )
  return (
    arrays.ArraySource(x_train, y_train, preprocess_fn),
    arrays.ArraySource(x_test, y_test, preprocess_fn),
  )


def _tfds_sources(config: ml_collections.ConfigDict) -> tuple[DataSource, DataSource]:
  if not config.name:
    raise ValueError("data.name must name a TFDS dataset when data.source = 'tfds'.")
  if not config.data_dir or not os.path.isdir(config.data_dir):
    raise ValueError(
      f'data.data_dir = {config.data_dir!r} must be an existing directory holding the prepared '
      f'TFDS dataset {config.name!r} (datasets are never downloaded at run time).'
    )
  _check_label_format(config)
  return (
    tfds_source.open_split(config, config.train_split),
    tfds_source.open_split(config, config.test_split),
  )


def _synthetic_sources(
  config: ml_collections.ConfigDict, seed: int
) -> tuple[DataSource, DataSource]:
  if not isinstance(config.num_examples, int) or config.num_examples < 1:
    raise ValueError(
      f'data.num_examples must be an integer >= 1 for the synthetic source, '
      f'got {config.num_examples!r}.'
    )
  if config.num_classes < 2:
    raise ValueError(f'data.num_classes must be >= 2, got {config.num_classes}.')
  _check_label_format(config)
  shape = tuple(int(d) for d in config.input_shape)
  test_size = max(1, min(10_000, config.num_examples // 5))
  one_hot = config.label_format == 'one_hot'
  return (
    synthetic.SyntheticSource(
      config.num_examples, shape, config.num_classes, seed, one_hot=one_hot
    ),
    synthetic.SyntheticSource(
      test_size, shape, config.num_classes, seed, config.num_examples, one_hot
    ),
  )
