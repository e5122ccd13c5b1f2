"""scikit-learn's bundled 8x8 digits (1797 images, offline) with dpjax's fixed split."""

from __future__ import annotations

import numpy as np

DIGITS_TEST_SIZE = 360  # 20% of 1797, stratified, fixed split (random_state=0).
DIGITS_RANGE = 16.0  # Digits pixels are 0..16: data.scale = 0 divides by it.
DIGITS_NUM_CLASSES = 10  # The digits 0-9: the dataset's public description, not its labels.


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """scikit-learn's digits as (x_train, y_train, x_test, y_test); x is [n, 8, 8, 1] in 0..16."""
  from sklearn import datasets as sk_datasets  # pylint: disable=g-import-not-at-top
  from sklearn import model_selection  # pylint: disable=g-import-not-at-top

  digits = sk_datasets.load_digits()
  images = digits.images.astype(np.float32)[..., None]
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
    images, digits.target, test_size=DIGITS_TEST_SIZE, random_state=0, stratify=digits.target
  )
  return x_train, y_train.astype(np.int64), x_test, y_test.astype(np.int64)
