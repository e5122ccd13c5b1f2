"""BandMF's objective, gradient and optimum against independent computations and closed forms."""

import itertools

import numpy as np
import pytest
import scipy.optimize

from dpjax.privacy.correlated import bandmf
from dpjax.privacy.correlated import expected_error
from dpjax.privacy.correlated import sensitivity
from dpjax.privacy.correlated import toeplitz
from dpjax.privacy.correlated import workloads


def error(coefs, n, workload=None, k=1, sep=None):
  """E at Δ = 1 from the dense C and the enumerating-free dense sensitivity (independent of the
  optimiser's weights)."""
  c = toeplitz.dense(coefs, n)
  delta = sensitivity.min_separation(c, k, sep or n)
  assert delta.exact
  return expected_error.expected_error(c, delta.value, workload)


def test_prefix_sqrt_coefs():
  np.testing.assert_allclose(
    bandmf.prefix_sqrt_coefs(6), [1, 1 / 2, 3 / 8, 5 / 16, 35 / 128, 63 / 256], rtol=1e-15
  )
  assert np.all(np.isfinite(bandmf.prefix_sqrt_coefs(5000)))


def test_the_objective_and_its_gradient():
  """f = Δ²·‖A C⁻¹‖_F² against the dense computation, and ∇f against finite differences
  (catches a wrong adjoint, e.g. C⁻¹ for C⁻ᵀ, or a sensitivity weight off by one column)."""
  n, k, sep = 17, 3, 7  # The third participation's column holds c_0..c_2 only.
  a = workloads.momentum(n, 0.5, np.linspace(1.0, 0.2, n))
  q = expected_error.lag_gram(a)
  coefs = np.array([1.0, 0.6, 0.3, 0.25, 0.1])
  weights = bandmf.sensitivity_weights(n, coefs.size, k, sep)
  value, grad = bandmf.loss_and_grad(coefs, q, weights)
  assert np.isclose(value / n, error(coefs, n, a, k, sep), rtol=1e-11)
  fd = scipy.optimize.approx_fprime(coefs, lambda c: bandmf.loss_and_grad(c, q, weights)[0], 1e-7)
  np.testing.assert_allclose(grad, fd, rtol=1e-5)


def test_one_band_is_dp_sgd():
  n = 30
  coefs = bandmf.optimize(n, 1)
  np.testing.assert_array_equal(coefs, [1.0])
  coefs = bandmf.optimize(n, 1, participations=3, min_sep=10)
  np.testing.assert_allclose(coefs, [3**-0.5], rtol=1e-15)
  assert np.isclose(error(coefs, n, k=3, sep=10), expected_error.dp_sgd_expected_error(n, 3))


@pytest.mark.parametrize('name', ['prefix', 'momentum'])
def test_more_bands_never_hurt_and_all_beat_dp_sgd(name):
  """The optimum over b bands is feasible for b + 1 bands: the error must not grow with b
  (within the optimiser's tolerance), and b >= 2 is strictly below DP-SGD."""
  n = 48
  a = None if name == 'prefix' else workloads.momentum(n, 0.9, np.linspace(1.0, 0.1, n))
  errors = [error(bandmf.optimize(n, b, a), n, a) for b in (1, 2, 4, 8, 16, 48)]
  assert errors[0] == pytest.approx(expected_error.dp_sgd_expected_error(n, 1, a), rel=1e-12)
  assert all(e2 <= e1 * (1 + 1e-7) for e1, e2 in itertools.pairwise(errors))
  assert errors[1] < 0.8 * errors[0]


def test_the_dense_optimum_is_near_the_prefix_square_root():
  """b = n on prefix sums: at most A^(1/2)'s error (a feasible point, closed form) and at least
  the nuclear-norm bound ‖A‖_*²/n² that no factorisation beats (‖A‖_* <= ‖B‖_F‖C‖_F)."""
  n = 64
  sqrt_coefs = bandmf.prefix_sqrt_coefs(n)
  sqrt_error = np.sum(sqrt_coefs**2) * np.sum((n - np.arange(n)) * sqrt_coefs**2) / n
  optimum = error(bandmf.optimize(n, n), n)
  nuclear = np.linalg.svd(workloads.prefix_sums(n), compute_uv=False).sum() ** 2 / n**2
  assert nuclear < optimum <= sqrt_error
  assert optimum > 0.9 * sqrt_error  # A^(1/2) is within a few per cent of optimal (4.5 % here).


@pytest.mark.parametrize(
  'k,sep,bands',
  [(1, None, 4), (3, 4, 4), (2, 9, 5), (4, 6, 3), (4, 7, 5)],  # Last: truncated.
)
def test_the_result_has_sensitivity_one_for_its_pattern(k, sep, bands):
  """Δ of the returned C, computed from the dense matrix (dynamic programming over patterns),
  is 1: the strategy's σ is the noise multiplier of the accounting."""
  n = 24
  coefs = bandmf.optimize(n, bands, participations=k, min_sep=sep)
  delta = sensitivity.min_separation(toeplitz.dense(coefs, n), k, sep or n)
  assert delta.exact and np.isclose(delta.value, 1.0, rtol=1e-12)


def test_full_columns_make_the_multi_participation_optimum_a_rescaling():
  """With every worst-case column holding all b coefficients, Δ² = k·‖c‖²: the same strategy as
  single participation divided by √k (catches participation weights on the wrong columns)."""
  n, bands = 40, 4
  single = bandmf.optimize(n, bands)
  multi = bandmf.optimize(n, bands, participations=3, min_sep=10)
  np.testing.assert_allclose(multi, single / np.sqrt(3), rtol=1e-5)


def test_a_long_horizon_converges_through_unstable_trial_steps():
  """n = 2000, b = 2: L-BFGS's first trial step makes C⁻¹ overflow; the optimiser must still
  reach the stationary point (c_1/c_0 ≈ 0.905), not stop at its initial 1/2."""
  n = 2000
  coefs = bandmf.optimize(n, 2)
  q = expected_error.lag_gram(None, n)
  weights = bandmf.sensitivity_weights(n, 2, 1, n)
  value, grad = bandmf.loss_and_grad(coefs / coefs[0], q, weights)
  assert abs(grad[1] / value) < 1e-4
  assert 0.85 < coefs[1] / coefs[0] < 0.95


@pytest.mark.parametrize(
  'kwargs,match',
  [
    ({'n': 10, 'bands': 11}, 'bands must be'),
    ({'n': 10, 'bands': 4, 'participations': 2, 'min_sep': 3}, 'min_sep must be >= bands'),
    ({'n': 10, 'bands': 2, 'workload': np.ones((3, 3))}, 'workload must be'),
    ({'n': 0, 'bands': 1}, 'n must be'),
    ({'n': 10, 'bands': 2, 'participations': 2}, 'min_sep must be given'),
  ],
)
def test_arguments_are_checked(kwargs, match):
  with pytest.raises(ValueError, match=match):
    bandmf.optimize(**kwargs)
