"""FS-RDP (Birrell et al. 2024, seed 001): closed form, paper reference, dp_accounting identity."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from dpjax.privacy.accounting import fixed_size_rdp

N, B, SIGMA, STEPS_PER_EPOCH, DELTA = 50_000, 120, 6.0, 416, 1e-5


@pytest.mark.parametrize('epochs, expected', [(50, 0.454), (100, 0.659), (250, 1.083)])
def test_reproduces_the_paper_setting(epochs, expected):
  eps, order = fixed_size_rdp.fixed_size_rdp_epsilon(B / N, SIGMA, STEPS_PER_EPOCH * epochs, DELTA)
  assert eps == pytest.approx(expected, rel=0.01)
  assert 2 < order < 256  # The optimum is interior: the order range is not binding.


def test_order_two_closed_form():
  # α = 2: (1−q)² + 2q(1−q) + q² e^{4/σ²} = 1 + q²(e^{4/σ²} − 1).
  q, sigma = 0.01, 1.3
  got = fixed_size_rdp.fixed_size_rdp(q, sigma, [2])[0]
  assert got == pytest.approx(math.log1p(q**2 * math.expm1(4 / sigma**2)), rel=1e-12)


def test_equals_renyi_divergence_of_the_mog_pair():
  # At integer orders the FS-RDP sum is E_{K~Bin(α,q)} exp(2K(K−1)/σ²) = the Rényi divergence of
  # (1−q)N(0,σ²) + qN(2,σ²) from N(0,σ²), i.e. dp_accounting's Poisson-subsampled Gaussian RDP
  # with noise σ/2 (Mironov et al. 2019), computed there independently.
  q, sigma = 0.02, 2.5
  orders = np.arange(2, 65)
  acct = rdp_privacy_accountant.RdpAccountant(orders=list(orders))
  acct.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma / 2)), 1)
  reference = acct._rdp  # pylint: disable=protected-access
  np.testing.assert_allclose(fixed_size_rdp.fixed_size_rdp(q, sigma, orders), reference, rtol=1e-9)


def test_tighter_than_the_replace_one_baseline():
  # docs/accounting.md §7: ≈1.1 (FS-RDP) vs ≈2.3 (Wang et al., replace-one) at 250 epochs.
  steps = STEPS_PER_EPOCH * 250
  eps, _ = fixed_size_rdp.fixed_size_rdp_epsilon(B / N, SIGMA, steps, DELTA)
  acct = rdp_privacy_accountant.RdpAccountant(
    neighboring_relation=rdp_privacy_accountant.NeighborRel.REPLACE_ONE
  )
  acct.compose(
    dp_event.SampledWithoutReplacementDpEvent(N, B, dp_event.GaussianDpEvent(SIGMA / 2)), steps
  )
  wang = acct.get_epsilon(DELTA)
  assert wang == pytest.approx(2.3, rel=0.02)
  assert eps < wang / 2


def test_monotone_in_steps_and_noise():
  q = B / N
  e1 = fixed_size_rdp.fixed_size_rdp_epsilon(q, SIGMA, 1000, DELTA)[0]
  e2 = fixed_size_rdp.fixed_size_rdp_epsilon(q, SIGMA, 2000, DELTA)[0]
  e3 = fixed_size_rdp.fixed_size_rdp_epsilon(q, 2 * SIGMA, 2000, DELTA)[0]
  assert e3 < e1 < e2


def test_small_sigma_does_not_overflow():
  rdp = fixed_size_rdp.fixed_size_rdp(0.01, 0.3, fixed_size_rdp.DEFAULT_ORDERS)
  assert np.all(np.isfinite(rdp)) and np.all(np.diff(rdp) > 0)


@pytest.mark.parametrize(
  'kwargs, field',
  [
    (dict(sampling_probability=1.0), 'sampling probability'),
    (dict(sampling_probability=0.0), 'sampling probability'),
    (dict(noise_multiplier=0.0), 'noise_multiplier'),
    (dict(num_steps=0), 'num_steps'),
    (dict(delta=1.0), 'delta'),
    (dict(orders=[1.5, 2]), 'orders'),
  ],
)
def test_bad_input(kwargs, field):
  args = dict(sampling_probability=0.01, noise_multiplier=1.0, num_steps=10, delta=1e-5)
  args.update(kwargs)
  with pytest.raises(ValueError, match=field):
    fixed_size_rdp.fixed_size_rdp_epsilon(**args)
