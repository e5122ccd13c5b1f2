"""dpjax's Gaussian PLD against dp_accounting's `from_gaussian_mechanism`, bit for bit."""

import math
import time

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as mechanism

from dpjax.privacy.accounting import gaussian_pld
from tests.privacy.accounting.identical_plds import assert_identical

# (σ, q, sensitivity, grid): q = 1 (symmetric), small and large q, a sensitivity ≠ 1 (a group or
# a mixture [0, s]), coarse and fine grids; each builds in < 0.5 s in dp_accounting.
CASES = [
  (1.0, 1.0, 1.0, 1e-3),
  (3.0, 1.0, 2.0, 1e-3),
  (0.9, 0.01, 1.0, 1e-3),
  (0.5, 0.5, 1.0, 1e-2),
  (2.3, 0.2, 0.7, 3e-3),
  (8.0, 1e-3, 1.0, 1e-4),
  (1.1, 0.999, 3.0, 1e-2),
]


@pytest.mark.parametrize('sigma, q, sensitivity, grid', CASES)
def test_the_pld_is_dp_accountings_bit_for_bit(sigma, q, sensitivity, grid):
  ours = gaussian_pld.gaussian_pld(sigma, grid, sensitivity=sensitivity, sampling_prob=q)
  theirs = pld_lib.from_gaussian_mechanism(
    sigma, sensitivity=sensitivity, value_discretization_interval=grid, sampling_prob=q
  )
  assert_identical(ours, theirs)


@pytest.mark.parametrize('adjacency', [mechanism.AdjacencyType.ADD, mechanism.AdjacencyType.REMOVE])
@pytest.mark.parametrize('q', [1.0, 0.3, 1e-4])
def test_cutoffs_are_the_scalar_inverse_at_every_branch(adjacency, q):
  """Each branch of dp_accounting's `inverse_privacy_loss`: ε = 0 (its log(a + c)), the range's
  edge log(1 − q) / −log(1 − q) (an infinite cutoff, also within math.isclose of it), and
  random ε inside the range; a wrong sign, order of operations or edge differs at these."""
  loss = mechanism.GaussianPrivacyLoss(
    1.3, sensitivity=0.8, sampling_prob=q, adjacency_type=adjacency
  )
  rng = np.random.default_rng(0)
  if q == 1.0:
    epsilons = np.concatenate([[0.0, -0.0], rng.normal(0, 3, 50)])
  else:
    edge = math.log(1 - q) if adjacency == mechanism.AdjacencyType.REMOVE else -math.log(1 - q)
    side = 1.0 if adjacency == mechanism.AdjacencyType.REMOVE else -1.0
    inside = edge + side * rng.exponential(2.0, 50)
    epsilons = np.concatenate([[0.0, edge, edge * (1 + 1e-10)], inside])
  expected = np.array([loss.inverse_privacy_loss(e) for e in epsilons])
  np.testing.assert_array_equal(gaussian_pld.cutoffs(loss, epsilons), expected)


def test_it_costs_a_fraction_of_dp_accountings_build():
  """The reason for the module: dp_accounting inverts the privacy loss point by point in Python
  (σ = 1, q = 0.01, grid 1e-4: ~6·10⁴ points, ~1.5 s on the 2-core box); a factor of 3
  required, best of 2 each."""

  def best(fn):
    times = []
    for _ in range(2):
      start = time.process_time()
      fn(1.0, sampling_prob=0.01, value_discretization_interval=2e-4)
      times.append(time.process_time() - start)
    return min(times)

  def ours(sigma, sampling_prob, value_discretization_interval):
    return gaussian_pld.gaussian_pld(
      sigma, value_discretization_interval, sampling_prob=sampling_prob
    )

  assert best(ours) * 3 < best(pld_lib.from_gaussian_mechanism)
