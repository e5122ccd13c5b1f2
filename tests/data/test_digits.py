"""The embedded digits are scikit-learn's digits with dpjax's fixed split, bit for bit."""

import numpy as np

from dpjax.data import digits
from tests import child_imports


def test_the_embedded_digits_are_scikit_learns_with_the_fixed_split():
  """scikit-learn (a test-only oracle) loads and splits the digits as dpjax did before it
  embedded them: every array equal, dtypes and shapes as before (fingerprints and accuracies
  of existing runs are unchanged)."""
  from sklearn import datasets, model_selection  # pylint: disable=import-outside-toplevel

  raw = datasets.load_digits()
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
    raw.images.astype(np.float32)[..., None],
    raw.target,
    test_size=digits.DIGITS_TEST_SIZE,
    random_state=0,
    stratify=raw.target,
  )
  want = (x_train, y_train.astype(np.int64), x_test, y_test.astype(np.int64))
  got = digits.load_digits_arrays()
  for g, w in zip(got, want, strict=True):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g, w)
  assert got[0].shape == (1437, 8, 8, 1) and sorted(set(got[3].tolist())) == list(range(10))


def test_loading_the_digits_imports_no_scikit_learn():
  """Each training process loads them: scikit-learn's import and load cost ~2.4 s of CPU."""
  code = 'from dpjax.data import digits\ndigits.load_digits_arrays()'
  assert child_imports.imported(code, ('sklearn',)) == []
