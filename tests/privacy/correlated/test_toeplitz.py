"""Toeplitz strategies against dense float64 linear algebra (np.linalg.inv / solve)."""

import numpy as np
import pytest

from dpjax.privacy.correlated import toeplitz

COEFS = [
  [2.0],  # DP-SGD up to scale.
  [1.0, 0.5, 0.375, 0.3125],  # The first coefficients of (1 − x)^(−1/2).
  [1.0, -0.6, 0.2],  # Signs mixed: CᵀC has negative entries.
  [0.7, 1.3, -0.4, 0.9, 0.1, 0.05, 0.2, 0.3, 0.1, 0.2, 0.1, 0.4],  # More bands than steps.
]


@pytest.mark.parametrize('coefs', COEFS)
@pytest.mark.parametrize('n', [1, 5, 9])
def test_dense_is_the_banded_toeplitz_matrix(coefs, n):
  """Catches an off-by-one in the bands or a transposed (upper-triangular) C."""
  c = toeplitz.dense(coefs, n)
  for i in range(n):
    for j in range(n):
      want = coefs[i - j] if 0 <= i - j < len(coefs) else 0.0
      assert c[i, j] == want


@pytest.mark.parametrize('coefs', COEFS)
def test_the_streaming_recursion_is_the_inverse(coefs):
  """inverse_apply (the privatizer's reference) and lfilter equal np.linalg.solve(C, z) for a
  stream of vectors: catches a wrong sign, a history read in the wrong order, or a missing ÷c_0."""
  rng = np.random.default_rng(0)
  n = 11
  z = rng.normal(size=(n, 3))
  want = np.linalg.solve(toeplitz.dense(coefs, n), z)
  np.testing.assert_allclose(toeplitz.inverse_apply(coefs, z), want, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(toeplitz.inverse_apply(coefs, z[:, 0]), want[:, 0], rtol=1e-10)
  np.testing.assert_allclose(toeplitz.solve(coefs, z), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('coefs', COEFS)
def test_inverse_coefs_are_the_first_column_of_the_inverse(coefs):
  """C⁻¹ is lower-triangular Toeplitz with first column inverse_coefs (against np.linalg.inv)."""
  n = 8
  inv = np.linalg.inv(toeplitz.dense(coefs, n))
  r = toeplitz.inverse_coefs(coefs, n)
  np.testing.assert_allclose(inv, toeplitz.dense(r, n), rtol=1e-10, atol=1e-12)


def test_the_inverse_of_the_prefix_square_root_is_the_series_of_its_reciprocal():
  """(1 − x)^(−1/2) inverts to (1 − x)^(1/2): 1, −1/2, −1/8, −1/16, −5/128 (closed form)."""
  coefs = [1.0, 1 / 2, 3 / 8, 5 / 16, 35 / 128]
  np.testing.assert_allclose(
    toeplitz.inverse_coefs(coefs, 5), [1, -1 / 2, -1 / 8, -1 / 16, -5 / 128], rtol=1e-14
  )


@pytest.mark.parametrize('coefs', COEFS)
def test_column_norms(coefs):
  """Catches norms read from rows or from the untruncated coefficients."""
  n = 6
  np.testing.assert_allclose(
    toeplitz.column_norms(coefs, n), np.linalg.norm(toeplitz.dense(coefs, n), axis=0), rtol=1e-14
  )


@pytest.mark.parametrize('bad', [[], [0.0, 1.0], [-1.0], [1.0, np.nan], [[1.0]]])
def test_coefficients_that_make_no_invertible_c_are_refused(bad):
  with pytest.raises(ValueError, match='coefs must be'):
    toeplitz.dense(bad, 4)
