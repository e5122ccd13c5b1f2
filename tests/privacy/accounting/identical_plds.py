"""Bit-for-bit equality of two dp_accounting PLDs (PMF type, grid, lower loss, probabilities and
infinity mass of each direction): the check of the modules that rebuild dp_accounting's
algorithms faster (pld_self_compose, gaussian_pld)."""

import numpy as np
from dp_accounting.pld import pld_pmf


def pmfs(pld):
  # pylint: disable-next=protected-access
  return (pld._pmf_remove,) if pld._symmetric else (pld._pmf_remove, pld._pmf_add)


def assert_identical(ours, theirs):
  assert len(pmfs(ours)) == len(pmfs(theirs))
  for a, b in zip(pmfs(ours), pmfs(theirs)):
    assert type(a) is type(b)
    # pylint: disable=protected-access
    assert a._infinity_mass == b._infinity_mass
    assert a._discretization == b._discretization
    if isinstance(a, pld_pmf.SparsePLDPmf):
      assert a._loss_probs == b._loss_probs
      continue
    assert a._lower_loss == b._lower_loss
    np.testing.assert_array_equal(a._probs, b._probs)
    # pylint: enable=protected-access
