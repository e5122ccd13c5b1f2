"""Expected error and workloads against dense float64 algebra, closed forms and a simulation."""

import numpy as np
import pytest

from dpjax.privacy.correlated import bandmf
from dpjax.privacy.correlated import expected_error
from dpjax.privacy.correlated import toeplitz
from dpjax.privacy.correlated import workloads

N = 9
WORKLOADS = {
  'prefix': None,
  'momentum': workloads.momentum(N, 0.9, np.linspace(1.0, 0.1, N)),
  'random': np.random.default_rng(3).normal(size=(N, N)),
}
COEFS = [[1.0], [1.0, 0.5, 0.375], [0.8, -0.3, 0.4, 0.2], list(bandmf.prefix_sqrt_coefs(N))]


@pytest.mark.parametrize('name', sorted(WORKLOADS))
@pytest.mark.parametrize('coefs', COEFS)
def test_the_toeplitz_error_is_the_dense_error(name, coefs):
  """rᵀQr (no inverse formed) against σ²Δ²‖A inv(C)‖_F²/n with np.linalg.inv: catches a Q
  built from the wrong diagonals or a transposed workload."""
  a = WORKLOADS[name]
  dense_a = workloads.prefix_sums(N) if a is None else a
  c = toeplitz.dense(coefs, N)
  want = 1.7**2 * 0.6**2 * np.sum((dense_a @ np.linalg.inv(c)) ** 2) / N
  got_dense = expected_error.expected_error(c, 0.6, a, noise_multiplier=1.7)
  got_toeplitz = expected_error.toeplitz_expected_error(coefs, N, 0.6, a, noise_multiplier=1.7)
  np.testing.assert_allclose([got_dense, got_toeplitz], want, rtol=1e-11)


def test_lag_gram_is_its_definition():
  """Q[k, l] = tr((S^k)ᵀ AᵀA S^l) with S the down-shift, for a random A; and the prefix-sum
  shortcut equals the matrix built from A."""
  a = WORKLOADS['random']
  shift = np.eye(N, k=-1)
  powers = [np.linalg.matrix_power(shift, k) for k in range(N)]
  want = np.array([[np.trace(p.T @ a.T @ a @ s) for s in powers] for p in powers])
  np.testing.assert_allclose(expected_error.lag_gram(a), want, rtol=1e-11, atol=1e-11)
  np.testing.assert_allclose(
    expected_error.lag_gram(None, N), expected_error.lag_gram(workloads.prefix_sums(N)), rtol=0
  )


@pytest.mark.parametrize('k', [1, 3])
def test_dp_sgd_closed_form(k):
  """C = I, Δ² = k on prefix sums: ‖A‖_F² = n(n+1)/2, so E = σ²·k·(n+1)/2."""
  assert np.isclose(
    expected_error.dp_sgd_expected_error(N, k, noise_multiplier=2.0), 4 * k * (N + 1) / 2
  )


def test_the_prefix_square_root_closed_form():
  """C = A^(1/2) (coefficients of (1 − x)^(−1/2)): C·C = A, A C⁻¹ = C, so
  E = (Σ_{k<n} a_k²)·(Σ_k (n − k)·a_k²)/n."""
  a = bandmf.prefix_sqrt_coefs(N)
  c = toeplitz.dense(a, N)
  np.testing.assert_allclose(c @ c, workloads.prefix_sums(N), rtol=1e-14, atol=1e-14)
  want = np.sum(a**2) * np.sum((N - np.arange(N)) * a**2) / N
  got = expected_error.toeplitz_expected_error(a, N, np.linalg.norm(a))
  assert np.isclose(got, want, rtol=1e-12)


def test_the_error_is_the_mean_squared_error_of_simulated_noise():
  """The meaning of E: the released prefix sums carry A(C/Δ)⁻¹Z with Z ~ N(0, σ²); its mean
  squared error over 40,000 draws (d = 1) is E within 3 % (the sampling spread is ~0.5 %)."""
  rng = np.random.default_rng(4)
  coefs, sigma = [1.0, 0.5, 0.375], 1.3
  delta = np.linalg.norm(coefs)
  z = rng.normal(scale=sigma, size=(N, 40_000))
  noise = workloads.prefix_sums(N) @ toeplitz.solve(np.asarray(coefs) / delta, z)
  want = expected_error.toeplitz_expected_error(coefs, N, delta, noise_multiplier=sigma)
  assert np.isclose(np.mean(noise**2), want, rtol=0.03)


def test_the_momentum_workload_is_the_heavy_ball_trajectory():
  """A·ĝ equals θ_0 − θ_t of a simulated SGD with momentum β and a learning-rate schedule;
  β = 0 with unit rates is the prefix sums."""
  rng = np.random.default_rng(5)
  beta, rates, g = 0.8, rng.uniform(0.1, 1.0, N), rng.normal(size=N)
  m = theta = 0.0
  moved = []
  for t in range(N):
    m = beta * m + g[t]
    theta -= rates[t] * m
    moved.append(-theta)
  np.testing.assert_allclose(workloads.momentum(N, beta, rates) @ g, moved, rtol=1e-12)
  np.testing.assert_array_equal(workloads.momentum(N), workloads.prefix_sums(N))


@pytest.mark.parametrize(
  'call,match',
  [
    (lambda: workloads.momentum(4, 1.0), 'momentum must be'),
    (lambda: workloads.momentum(4, 0.5, [1.0, 2.0]), 'learning_rates must be'),
    (lambda: expected_error.expected_error(np.eye(3), 1.0, np.ones((2, 2))), 'workload must be'),
    (lambda: expected_error.expected_error(np.eye(3), 0.0), 'sensitivity must be'),
    (lambda: expected_error.toeplitz_expected_error([1.0], 3, 1.0, None, 0.0), 'noise_multi'),
  ],
)
def test_arguments_are_checked(call, match):
  with pytest.raises(ValueError, match=match):
    call()
