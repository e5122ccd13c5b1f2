"""`Strategy` and `make`: the normalisation (unit max column norm, the sensitivity of one
participation) against dense float64 C, the expected error against a dense inverse, the
matching privatizer, and the one-line refusals."""

import numpy as np
import pytest

from dpjax.privacy import correlated_noise
from dpjax.privacy.correlated import bandmf
from dpjax.privacy.correlated import blt
from dpjax.privacy.correlated import sensitivity
from dpjax.privacy.correlated import strategy
from dpjax.privacy.correlated import workloads


def _dense_ratio(c, workload=None):
  """‖A C⁻¹‖_F² / ‖A‖_F² by a dense inverse (the expected error relative to DP-SGD, Δ = 1)."""
  a = workloads.prefix_sums(c.shape[0]) if workload is None else workload
  return np.sum((a @ np.linalg.inv(c)) ** 2) / np.sum(a**2)


def test_bandmf_is_the_optimiser_normalised_to_one_participation():
  """coefs = bandmf.optimize's (unit norm for single participation), C's columns have norm
  <= 1 with the first exactly 1 (a strategy scaled by Δ of several participations, or not
  scaled at all, fails); bands and state vectors; the error ratio is a dense inverse's."""
  s = strategy.make('bandmf', 12, num_bands=3)
  np.testing.assert_allclose(s.coefs, bandmf.optimize(12, 3), rtol=1e-12)
  c = s.dense()
  norms = np.linalg.norm(c, axis=0)
  assert norms[0] == pytest.approx(1.0, abs=1e-12) and np.all(norms <= 1 + 1e-12)
  assert sensitivity.single_participation(c).value == pytest.approx(1.0, abs=1e-12)
  assert (s.bands, s.state_vectors) == (3, 2)
  np.testing.assert_array_equal(s.toeplitz_coefs(), np.pad(s.coefs, (0, 9)))
  assert s.expected_error() == pytest.approx(_dense_ratio(c), rel=1e-10)
  assert s.expected_error() < 1  # The optimum beats C = I, whose ratio is 1.
  momentum = workloads.momentum(12, 0.9)
  assert s.expected_error(momentum) == pytest.approx(_dense_ratio(c, momentum), rel=1e-10)


def test_one_band_is_dp_sgd():
  s = strategy.make('bandmf', 5, num_bands=1)
  np.testing.assert_array_equal(s.dense(), np.eye(5))
  assert s.expected_error() == pytest.approx(1.0, rel=1e-12) and s.state_vectors == 0


def test_blt_is_scaled_to_unit_max_column_norm_over_its_steps():
  """C = scale·C_blt with C_blt of the optimised decays and weights: first column norm 1 over
  n steps (blt.coefs computed independently), not banded (bands = n), d state vectors; the
  expected-error ratio with the sensitivities of E = 2 participations is Δ²/E times the
  single-participation one."""
  s = strategy.make('blt', 10, num_buffers=2)
  found = blt.BLT(np.array(s.decays), np.array(s.weights))
  np.testing.assert_allclose(s.toeplitz_coefs(), s.scale * blt.coefs(found, 10), rtol=1e-15)
  assert np.linalg.norm(s.dense(), axis=0).max() == pytest.approx(1.0, abs=1e-12)
  assert (s.bands, s.state_vectors) == (10, 2)
  assert s.expected_error() == pytest.approx(_dense_ratio(s.dense()), rel=1e-10)
  two = sensitivity.every_period(s.dense(), 5).value
  assert s.expected_error(sensitivity=two, dp_sgd_sensitivity=2**0.5) == pytest.approx(
    s.expected_error() * two**2 / 2, rel=1e-12
  )


def test_the_privatizer_runs_this_strategy():
  band = strategy.make('bandmf', 8, num_bands=2).privatizer(1.1, 1.0, 32.0, 7)
  assert isinstance(band, correlated_noise.BandedPrivatizer) and band.bands == 2
  s = strategy.make('blt', 8, num_buffers=1)
  mechanism = s.privatizer(1.1, 1.0, 32.0, 7, noise_impl='rbg')
  assert isinstance(mechanism, correlated_noise.BLTPrivatizer)
  assert (mechanism.decays, mechanism.weights, mechanism.scale, mechanism.num_steps) == (
    s.decays,
    s.weights,
    s.scale,
    8,
  )
  assert mechanism.noise_impl == 'rbg' and mechanism.noise_std == pytest.approx(1.1 / s.scale)


@pytest.mark.parametrize(
  'kind, n, fields, match',
  [
    ('dense', 8, {}, 'kind must be one of bandmf, blt'),
    ('bandmf', 0, {'num_bands': 1}, 'num_steps must be'),
    ('bandmf', 8, {}, 'num_bands must be given'),
    ('bandmf', 8, {'num_bands': 9}, 'num_bands must be'),
    ('bandmf', 8, {'num_bands': 2, 'num_buffers': 2}, 'num_buffers is a BLT count'),
    ('blt', 8, {}, 'num_buffers must be given'),
    ('blt', 8, {'num_buffers': 0}, 'num_buffers must be'),
    ('blt', 8, {'num_bands': 2}, 'num_bands is a BandMF count'),
  ],
)
def test_make_refuses_with_one_line_naming_the_argument(kind, n, fields, match):
  with pytest.raises(ValueError, match=match) as info:
    strategy.make(kind, n, **fields)
  assert '\n' not in str(info.value)


@pytest.mark.parametrize(
  'fields, match',
  [
    ({'kind': 'bandmf', 'num_steps': 4, 'coefs': (1.0, 0.5)}, 'coefs must give C unit max'),
    ({'kind': 'bandmf', 'num_steps': 1, 'coefs': (0.6, 0.8)}, 'coefs must hold <= num_steps'),
    ({'kind': 'bandmf', 'num_steps': 4, 'coefs': (1.0,), 'scale': 2.0}, 'BLT parameters'),
    ({'kind': 'blt', 'num_steps': 4, 'decays': (0.5,), 'weights': (0.5,)}, 'scale must give'),
    ({'kind': 'blt', 'num_steps': 4, 'coefs': (1.0,)}, 'coefs is a BandMF parameter'),
    ({'kind': 'blt', 'num_steps': 4, 'decays': (1.5,), 'weights': (0.5,)}, 'decays must be'),
  ],
)
def test_a_strategy_not_normalised_or_mixed_is_refused(fields, match):
  with pytest.raises(ValueError, match=match):
    strategy.Strategy(**fields)
