"""Checks of a dataset when it is opened: one line naming the file, split, array and row.

Malformed data used to train "successfully": fractional labels were truncated,
−1 labels trained into a 2-class head, one stray label id of 10^6 built a
65M-parameter head, NaN features trained on noise. `check_splits` refuses all of
these before any compute, with one line: the data's name (file, TFDS dataset),
the split, the array and the offending value and row.

Sizes that shape the model are public: K (the classes, or the token vocabulary) is
given (`data.num_classes`, or the source's public description), never derived from
the labels. max(y) + 1 would put one record's label into the model's shape (a head
of 11 outputs exists only if some record is labelled 10), so a label outside
[0, K) is a data error, not a reason to grow the model. The target width of
regression targets and the row shapes are the arrays' schema (every row has it,
whichever records are present).

Labels: integers, or floats that are exactly integral; in [0, K) in both splits.
Features: numeric, the same row shape in every split, and finite: every value
for data in memory, a sample of rows (`FINITE_SAMPLE_ROWS`, plus the first and
last chunk) for memory-mapped files larger than `FULL_SCAN_BYTES`; after the declared preprocessing, within the public bound
`data.max_abs_feature` (`check_feature_bound`). x and y have one row each per example.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

FULL_SCAN_BYTES = 1 << 30  # Memory-mapped x beyond this is checked on a sample of rows.
FINITE_SAMPLE_ROWS = 1 << 16
SCAN_ROWS = 1 << 16  # Rows per chunk of a full scan (bounds the memory of the check).
MAX_ABS_FEATURE = 1e6  # The default public bound on |x| after the preprocessing.


class DataError(ValueError):
  """The data is malformed; one line naming where."""


def _first_row(mask: np.ndarray) -> int:
  return int(np.flatnonzero(mask)[0])


def check_labels(name: str, y, *, num_examples: int) -> np.ndarray:
  """y as int64 (checked: 1-D, one per example, integral); DataError otherwise."""
  y = np.asarray(y) if not isinstance(y, np.ndarray) else y
  if y.ndim != 1:
    raise DataError(
      f'{name}: labels have shape {y.shape}; they need one integer label per example (shape [N]).'
    )
  if len(y) != num_examples:
    raise DataError(
      f'{name}: {num_examples} examples but {len(y)} labels; x and y need one row each per example.'
    )
  if y.dtype.kind in 'iu':
    return y
  if y.dtype.kind == 'b':
    return y.astype(np.int64)
  if y.dtype.kind != 'f':
    raise DataError(
      f'{name}: labels have dtype {y.dtype}; they must be integers 0..K-1 '
      '(map class names to integers first).'
    )
  bad = ~np.isfinite(y) | (np.floor(y) != y)
  if bad.any():
    row = _first_row(bad)
    raise DataError(
      f'{name}: label {y[row].item()!r} in row {row} is not an integer; labels must be '
      'integers 0..K-1 (or floats that are exactly integral).'
    )
  return y.astype(np.int64)


def label_range(name: str, y: np.ndarray, chunk: int = SCAN_ROWS) -> tuple[int, int, int, int]:
  """(min, row of min, max, row of max) of integer labels, in chunks."""
  low = high = None
  for start in range(0, len(y), chunk):
    part = np.asarray(y[start : start + chunk])
    if not len(part):
      continue
    i, j = int(part.argmin()), int(part.argmax())
    if low is None or part[i] < low[0]:
      low = (int(part[i]), start + i)
    if high is None or part[j] > high[0]:
      high = (int(part[j]), start + j)
  if low is None:
    raise DataError(f'{name}: no examples.')
  return low[0], low[1], high[0], high[1]


def check_label_range(name: str, y: np.ndarray, num_classes: int) -> None:
  """DataError unless every label is in [0, K), K = `num_classes` (given, public)."""
  low, low_row, high, high_row = label_range(name, y)
  if low < 0:
    raise DataError(
      f'{name}: label {low} in row {low_row} is negative; labels must be in [0, {num_classes}).'
    )
  if high >= num_classes:
    raise DataError(
      f'{name}: label {high} in row {high_row} is not in [0, {num_classes}) '
      f'(data.num_classes = {num_classes}, the classes of the task; the model '
      'never grows to fit a label).'
    )


def _row_chunks(x, mapped: bool):
  """(row numbers, rows) of x in chunks: every row, or a sample for a large memory-mapped x."""
  n = len(x)
  if mapped and x.nbytes > FULL_SCAN_BYTES:
    rng = np.random.default_rng(0)
    rows = np.unique(
      np.concatenate(
        [
          np.arange(min(n, 1024)),
          np.arange(max(0, n - 1024), n),
          rng.integers(0, n, FINITE_SAMPLE_ROWS),
        ]
      )
    )
    return (
      (c, np.asarray(x[c]))
      for c in (rows[i : i + SCAN_ROWS] for i in range(0, len(rows), SCAN_ROWS))
    )
  return (
    (np.arange(s, min(n, s + SCAN_ROWS)), np.asarray(x[s : s + SCAN_ROWS]))
    for s in range(0, n, SCAN_ROWS)
  )


def check_features(name: str, x, *, mapped: bool = False) -> None:
  """Numeric and finite (all rows in memory; a sample of rows of a large memory-mapped x)."""
  if x.dtype.kind not in 'biuf':
    raise DataError(f'{name}: features have dtype {x.dtype}; they must be numeric.')
  if x.ndim < 1 or len(x) == 0:
    raise DataError(f'{name}: features have shape {x.shape}; they need at least one example.')
  if x.dtype.kind != 'f':
    return
  for rows, part in _row_chunks(x, mapped):
    finite = np.isfinite(part.reshape(len(part), -1)).all(axis=1)
    if not finite.all():
      i = _first_row(~finite)
      bad = part[i].ravel()[~np.isfinite(part[i].ravel())][0]
      raise DataError(
        f'{name}: example {int(rows[i])} has a non-finite feature value ({bad}); '
        'features must be finite (drop or repair the example).'
      )


def check_feature_bound(
  name: str,
  x,
  preprocess: Callable[[np.ndarray], np.ndarray],
  bound: float,
  *,
  mapped: bool = False,
) -> None:
  """Every preprocessed feature finite with |preprocess(x)| <= bound (`data.max_abs_feature`).

  The bound is public, so it defines the domain of records the guarantee is stated for: an
  example outside it is refused here, before training (one line), never dropped or counted
  while training, where what happens to it would be a function of that one record
  (docs/threat_model.md). Memory-mapped x beyond FULL_SCAN_BYTES is checked on a sample of
  rows, as by `check_features`; an unchecked row outside the bound still adds at most C (or
  exactly zero when its gradient is not finite).
  """
  for rows, part in _row_chunks(x, mapped):
    values = np.asarray(preprocess(part), np.float32).reshape(len(part), -1)
    inside = (np.abs(values) <= bound).all(axis=1)  # NaN compares False: refused too.
    if not inside.all():
      i = _first_row(~inside)
      j = int(np.flatnonzero(~(np.abs(values[i]) <= bound))[0])
      raise DataError(
        f'{name}: example {int(rows[i])} has the feature value {part[i].ravel()[j].item()!r}, '
        f'{values[i, j]:g} after the preprocessing, beyond the public bound ±{bound:g} '
        '(data.max_abs_feature): such an example is refused before training, so that no '
        'single record can change how the run goes. Drop or repair it, set data.scale, '
        'data.mean and data.std so that features are of order 1, or raise '
        'data.max_abs_feature.'
      )


def check_targets(name: str, y, *, num_examples: int) -> int:
  """Regression targets (loss 'mse'): numeric, finite, one row per example; returns their
  size per example (the model's output size): the shape of a row, the arrays' schema, the
  same whichever records are present."""
  y = np.asarray(y) if not isinstance(y, np.ndarray) else y
  if y.ndim < 1 or len(y) != num_examples:
    raise DataError(
      f'{name}: {num_examples} examples but targets of shape {y.shape}; x and y '
      'need one row each per example.'
    )
  if y.dtype.kind not in 'biuf':
    raise DataError(f'{name}: targets have dtype {y.dtype}; loss mse needs numbers.')
  check_features(name, y)
  return int(np.prod(y.shape[1:], dtype=np.int64)) if y.ndim > 1 else 1


def check_tokens(
  name: str, tokens, *, num_examples: int, low: int, vocab: int, length: int | None = None
) -> None:
  """Token sequences (loss 'sequence_cross_entropy'): integers in [low, vocab), shape [N, T]."""
  tokens = np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens
  if tokens.ndim != 2 or len(tokens) != num_examples:
    raise DataError(
      f'{name}: shape {tokens.shape}; sequences need shape [N, T] with N = {num_examples}.'
    )
  if length is not None and tokens.shape[1] != length:
    raise DataError(
      f'{name}: sequences of length {tokens.shape[1]}, but the inputs have '
      f'length {length}; y holds the next token of each input position.'
    )
  if tokens.dtype.kind not in 'iu':
    raise DataError(f'{name}: dtype {tokens.dtype}; tokens must be integers.')
  smallest, row = int(tokens.min()), int(np.argmin(tokens.min(axis=1)))
  if smallest < low:
    raise DataError(
      f'{name}: token {smallest} in row {row}; tokens must be >= {low}'
      + (' (-1 marks padding positions of y).' if low < 0 else '.')
    )
  largest, row = int(tokens.max()), int(np.argmax(tokens.max(axis=1)))
  if largest >= vocab:
    raise DataError(
      f'{name}: token {largest} in row {row} is not below data.num_classes = '
      f'{vocab} (the vocabulary size; the model never grows to fit a token).'
    )


def check_same_rows(train_name: str, x_train_shape, test_name: str, x_test_shape) -> None:
  if tuple(x_train_shape) != tuple(x_test_shape):
    raise DataError(
      f'{test_name}: rows have shape {tuple(x_test_shape)} but the training rows '
      f'({train_name}) have shape {tuple(x_train_shape)}; every split needs the '
      'same example shape.'
    )


def auto_scale(dtype) -> float:
  """The scale that maps raw values to [0, 1]: 255 for uint8, the integer type's max; 1 for floats."""
  dtype = np.dtype(dtype)
  if dtype.kind in 'iu':
    return float(np.iinfo(dtype).max)
  return 1.0


def check_splits(
  where: str,
  num_classes: int,
  x_train,
  y_train,
  x_test,
  y_test,
  mapped: bool = False,
  targets: str = 'labels',
):
  """(y_train, y_test, size) after the checks of both splits (one line each), named `where`.

  num_classes: K, public (`sources.public_num_classes`): the classes (labels) or the
  vocabulary (tokens); every label or token must lie below it. Ignored for 'values'.
  size: K, or the target width of 'values' (the shape of a row of y, its schema).
  """
  if targets != 'values' and num_classes < 1:
    raise DataError(
      f'{where}: data.num_classes = {num_classes}; the number of classes (or the '
      'vocabulary) must be given, never derived from the private labels.'
    )
  if targets == 'tokens':
    for name, a, x, low in (
      ('x_train', x_train, x_train, 0),
      ('y_train', y_train, x_train, -1),
      ('x_test', x_test, x_test, 0),
      ('y_test', y_test, x_test, -1),
    ):
      check_tokens(
        f'{where}: {name}',
        a,
        num_examples=len(x),
        low=low,
        vocab=num_classes,
        length=None if name.startswith('x') else x.shape[1],
      )
    return y_train, y_test, num_classes
  check_features(f'{where}: x_train', x_train, mapped=mapped)
  check_features(f'{where}: x_test', x_test, mapped=mapped)
  check_same_rows(f'{where}: x_train', x_train.shape[1:], f'{where}: x_test', x_test.shape[1:])
  if targets == 'values':
    size = check_targets(f'{where}: y_train', y_train, num_examples=len(x_train))
    if check_targets(f'{where}: y_test', y_test, num_examples=len(x_test)) != size:
      raise DataError(f"{where}: y_test: targets of another size than y_train's {size}.")
    return y_train, y_test, size
  y_train = check_labels(f'{where}: y_train', y_train, num_examples=len(x_train))
  y_test = check_labels(f'{where}: y_test', y_test, num_examples=len(x_test))
  check_label_range(f'{where}: y_train', y_train, num_classes)
  check_label_range(f'{where}: y_test', y_test, num_classes)
  return y_train, y_test, num_classes
