"""BLT strategies: the streaming noise against the dense Toeplitz matrix, and the optimiser."""

import itertools

import numpy as np
import pytest
import scipy.linalg
import scipy.optimize
import scipy.signal

from dpjax.privacy.correlated import bandmf
from dpjax.privacy.correlated import blt
from dpjax.privacy.correlated import expected_error
from dpjax.privacy.correlated import sensitivity
from dpjax.privacy.correlated import toeplitz
from dpjax.privacy.correlated import workloads

N = 14
BLTS = [
  blt.BLT(np.array([0.9]), np.array([0.4])),
  blt.BLT(np.array([0.5, 0.95]), np.array([0.2, 0.1])),
  blt.BLT(np.array([0.3, 0.7, 0.99]), np.array([1.5, 0.4, 0.05])),  # c_1 > c_0: not monotone.
]


@pytest.mark.parametrize('b', BLTS)
def test_coefficients_are_the_buffered_sum(b):
  """c_0 = 1, c_t = Σ_i ω_i θ_i^(t−1), written out term by term."""
  c = blt.coefs(b, N)
  assert c[0] == 1.0
  for t in range(1, N):
    want = sum(w * th ** (t - 1) for th, w in zip(b.decays, b.weights))
    assert np.isclose(c[t], want, rtol=1e-14)


@pytest.mark.parametrize('b', BLTS)
def test_the_streaming_noise_is_the_dense_inverse(b):
  """d buffers of state give C⁻¹z of the dense n × n Toeplitz matrix (np.linalg.solve), for a
  stream of vectors and of scalars; catches a buffer decayed before it is read, or + for −."""
  rng = np.random.default_rng(6)
  c = toeplitz.dense(blt.coefs(b, N), N)
  z = rng.normal(size=(N, 5))
  want = np.linalg.solve(c, z)
  np.testing.assert_allclose(blt.inverse_apply(b, z), want, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(blt.inverse_apply(b, z[:, 2]), want[:, 2], rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(
    toeplitz.inverse_apply(blt.coefs(b, N), z), want, rtol=1e-10, atol=1e-12
  )


@pytest.mark.parametrize('b', BLTS)
def test_the_rational_form(b):
  """c(x) = P/Q: lfilter(P, Q) is C and lfilter(Q, P) is C⁻¹ (the optimiser's O(n·d) solve)."""
  p, q = blt.rational(b)
  c = toeplitz.dense(blt.coefs(b, N), N)
  z = np.random.default_rng(7).normal(size=N)
  np.testing.assert_allclose(scipy.signal.lfilter(p, q, z), c @ z, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(
    scipy.signal.lfilter(q, p, z), np.linalg.solve(c, z), rtol=1e-10, atol=1e-12
  )


@pytest.mark.parametrize('b', BLTS)
def test_the_inverse_is_a_blt_with_as_many_buffers(b):
  """Dvijotham et al.'s Lemma 5.2: r_t (t >= 1) of C⁻¹ is a sum of d geometric sequences, so
  its Hankel matrix has rank d (checked on the dense inverse)."""
  r = np.linalg.inv(toeplitz.dense(blt.coefs(b, N), N))[:, 0]
  hankel = scipy.linalg.hankel(r[1:8], r[7:])
  singular = np.linalg.svd(hankel, compute_uv=False)
  d = b.decays.size
  assert singular[d - 1] > 1e-8 * singular[0] and np.all(singular[d:] < 1e-10 * singular[0])


def test_the_objective_and_its_gradient():
  """f(c) = ‖C·1_π‖²·‖A C⁻¹‖_F² against dense algebra, ∇f against finite differences."""
  n, starts = 20, np.array([0, 6, 12])
  a = workloads.momentum(n, 0.7)
  q = expected_error.lag_gram(a)
  c = blt.coefs(BLTS[1], n)
  value, grad = blt.loss_and_grad(c, q, starts)
  dense = toeplitz.dense(c, n)
  ones = np.zeros(n)
  ones[starts] = 1.0
  want = np.sum((dense @ ones) ** 2) * np.sum((a @ np.linalg.inv(dense)) ** 2)
  assert np.isclose(value, want, rtol=1e-11)
  fd = scipy.optimize.approx_fprime(c, lambda x: blt.loss_and_grad(x, q, starts)[0], 1e-7)
  np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-6 * np.abs(grad).max())


def dense_error(b, n, workload=None, k=1, sep=None):
  """E at Δ = 1 with Δ from the dense C's pattern (0, sep, ...) and the exact-path check."""
  c = blt.coefs(b, n)
  delta = blt.sensitivity_of(b, n, k, sep)
  assert delta.exact
  pattern = np.arange(0, n, sep or n)[:k]
  assert np.isclose(
    delta.value, sensitivity.pattern_sensitivity(toeplitz.dense(c, n), pattern).value, rtol=1e-12
  )
  return expected_error.expected_error(toeplitz.dense(c, n), delta.value, workload)


def test_optimised_blts_approach_the_best_toeplitz_strategy():
  """Prefix sums, n = 64: one buffer already beats b = 4 BandMF; two to four buffers are within
  0.2 % of the optimal dense Toeplitz strategy (BandMF with b = n) and below A^(1/2); none beats
  that optimum or the nuclear-norm bound; more buffers do not hurt beyond the optimiser's
  tolerance (1e-4: it is a local search)."""
  n = 64
  best = expected_error.toeplitz_expected_error(bandmf.optimize(n, n), n, 1.0)
  sqrt = bandmf.prefix_sqrt_coefs(n)
  sqrt_error = expected_error.toeplitz_expected_error(sqrt, n, np.linalg.norm(sqrt))
  errors = [dense_error(blt.optimize(n, d), n) for d in (1, 2, 3, 4)]
  assert errors[0] < expected_error.toeplitz_expected_error(bandmf.optimize(n, 4), n, 1.0)
  assert all(best * (1 - 1e-6) <= e for e in errors)
  assert all(e < min(1.002 * best, sqrt_error) for e in errors[1:])
  assert all(e2 <= e1 * (1 + 1e-4) for e1, e2 in itertools.pairwise(errors))


def test_a_multi_participation_blt_is_optimised_for_its_pattern():
  """k = 3 participations 16 apart: the BLT optimised for that pattern has a lower error at its
  own (exact) Δ than the single-participation BLT at the same pattern's Δ."""
  n, k, sep = 48, 3, 16
  for_pattern = dense_error(blt.optimize(n, 2, participations=k, min_sep=sep), n, k=k, sep=sep)
  for_one = dense_error(blt.optimize(n, 2), n, k=k, sep=sep)
  assert for_pattern < for_one


def test_a_momentum_workload():
  """With momentum 0.9 the optimised BLT still beats DP-SGD (factor > 2) and matches the dense
  Toeplitz optimum within 1 %."""
  n = 40
  a = workloads.momentum(n, 0.9)
  err = dense_error(blt.optimize(n, 2, a), n, a)
  best = expected_error.toeplitz_expected_error(bandmf.optimize(n, n, a), n, 1.0, a)
  assert err < expected_error.dp_sgd_expected_error(n, 1, a) / 2
  assert best * (1 - 1e-6) <= err < best * 1.01


@pytest.mark.parametrize(
  'call,match',
  [
    (lambda: blt.coefs(blt.BLT([1.0], [0.5]), 4), 'decays must be'),
    (lambda: blt.coefs(blt.BLT([0.5], [-0.1]), 4), 'weights finite numbers >= 0'),
    (lambda: blt.coefs(blt.BLT([0.5, 0.6], [0.1]), 4), 'one of each per buffer'),
    (lambda: blt.optimize(1, 2), 'n must be'),
    (lambda: blt.optimize(10, 0), 'buffers must be'),
    (lambda: blt.optimize(10, 2, participations=3), 'min_sep must be given'),
    (lambda: blt.sensitivity_of(BLTS[0], 10, 2), 'min_sep must be given'),
    (lambda: blt.inverse_apply(BLTS[0], np.zeros((2, 2, 2))), 'z must have shape'),
  ],
)
def test_arguments_are_checked(call, match):
  with pytest.raises(ValueError, match=match):
    call()
