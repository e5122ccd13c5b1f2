"""The 8x8 hand-written digits (1797 images, offline) with dpjax's fixed split, embedded.

The images are the UCI "Optical Recognition of Handwritten Digits" test set (Alpaydin and
Kaynak, 1998; CC BY 4.0) as scikit-learn ships them (`sklearn.datasets.load_digits`),
split once by `train_test_split(test_size=360, stratify=labels, random_state=0)` and stored
in `digits.npz` (47 kB, pixels 0..16 as uint8): loading them imports nothing but numpy.
tests/data/test_digits.py checks the file against scikit-learn's arrays and split.
"""

from __future__ import annotations

import os

import numpy as np

DIGITS_TEST_SIZE = 360  # 20% of 1797, stratified, fixed split (random_state=0).
DIGITS_RANGE = 16.0  # Digits pixels are 0..16: data.scale = 0 divides by it.
DIGITS_NUM_CLASSES = 10  # The digits 0-9: the dataset's public description, not its labels.
DIGITS_FILE = os.path.join(os.path.dirname(__file__), 'digits.npz')


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(x_train, y_train, x_test, y_test); x is float32 [n, 8, 8, 1] in 0..16, y int64."""
  with np.load(DIGITS_FILE) as stored:
    return (
      stored['x_train'].astype(np.float32)[..., None],
      stored['y_train'].astype(np.int64),
      stored['x_test'].astype(np.float32)[..., None],
      stored['y_test'].astype(np.int64),
    )
