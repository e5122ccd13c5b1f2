"""dpjax's strategies against jax_privacy's, read from `jax_privacy_oracle.json`.

The JSON is written by `scripts/jax_privacy_oracle.py` in a separate environment (jax_privacy
is not a dependency; its version and the command are in the file). jax_privacy's loss is the
mean per-query squared error × sensitivity², dpjax's expected error at Δ = 1 and σ = 1.

Tolerances: the same strategy evaluated by both must agree to rounding (rtol 1e-9; seen
<= 1e-15). Optimised strategies come from two different L-BFGS runs: BandMF's objective has
one optimum in these cases, so ours may be worse only by the solvers' stopping tolerances
(rtol 1e-8; seen 8e-10); BLT's objective has local optima (a buffer that dies), so ours may
be worse by rtol 1e-5 (seen 3.5e-6 at n = 400, d = 4) and is often better.
"""

import json
import math
import pathlib

import numpy as np
import pytest

from dpjax.privacy.correlated import bandmf
from dpjax.privacy.correlated import blt
from dpjax.privacy.correlated import expected_error
from dpjax.privacy.correlated import sensitivity
from dpjax.privacy.correlated import toeplitz
from dpjax.privacy.correlated import workloads

ORACLE = json.loads((pathlib.Path(__file__).parent / 'jax_privacy_oracle.json').read_text())
SAME = 1e-9
BANDMF_SOLVER = 1e-8
BLT_SOLVER = 1e-5


def test_the_oracle_names_its_source():
  assert ORACLE['jax_privacy_version'].split('.')[0] in ('1', '2')
  assert 'jax_privacy_oracle.py' in ORACLE['command']


@pytest.mark.parametrize('case', ORACLE['bandmf'], ids=lambda c: f'n{c["n"]}_b{c["bands"]}')
def test_bandmf_matches_jax_privacy(case):
  """Their coefficients' loss by our formula equals theirs (same objective); our optimum is
  not worse than theirs."""
  n, theirs = case['n'], np.asarray(case['coefs'])
  ours_of_theirs = expected_error.toeplitz_expected_error(theirs, n, np.linalg.norm(theirs))
  assert ours_of_theirs == pytest.approx(case['loss'], rel=SAME)
  ours = expected_error.toeplitz_expected_error(bandmf.optimize(n, case['bands']), n, 1.0)
  assert ours <= case['loss'] * (1 + BANDMF_SOLVER)


@pytest.mark.parametrize('case', [c for c in ORACLE['sensitivity'] if 'min_sep' in c])
def test_min_separation_sensitivity_matches_jax_privacy(case):
  """Toeplitz with decreasing coefficients: both exact, equal. Dense bound: ours is at most
  theirs (the same row-wise pattern bound, intersected with a second one)."""
  n, sep = case['n'], case['min_sep']
  k = case['participations'] or math.ceil(n / sep)
  exact = sensitivity.toeplitz_min_separation(case['coefs'], n, k, sep)
  assert exact.exact and exact.value == pytest.approx(case['toeplitz_sensitivity'], rel=1e-12)
  dense = sensitivity.min_separation(toeplitz.dense(case['coefs'], n), k, sep)
  assert exact.value * (1 - 1e-12) <= dense.value <= case['dense_upper_bound'] * (1 + 1e-12)


@pytest.mark.parametrize('case', [c for c in ORACLE['sensitivity'] if 'epochs' in c])
def test_fixed_epoch_sensitivity_matches_jax_privacy(case):
  n = case['n']
  ours = sensitivity.every_period(toeplitz.dense(case['coefs'], n), n // case['epochs'])
  assert ours.value == pytest.approx(case['fixed_epoch'], rel=1e-12)


@pytest.mark.parametrize('case', ORACLE['momentum'], ids=lambda c: f'n{c["n"]}')
def test_a_momentum_workload_matches_jax_privacy(case):
  """Their Toeplitz workload coefficients Σ_{j<=t} β^j are our momentum matrix (unit rates)."""
  n, coefs = case['n'], np.asarray(case['coefs'])
  a = workloads.momentum(n, case['momentum'])
  ours = expected_error.toeplitz_expected_error(coefs, n, np.linalg.norm(coefs[:n]), a)
  assert ours == pytest.approx(case['loss'], rel=SAME)


@pytest.mark.parametrize('case', ORACLE['blt'], ids=lambda c: f'n{c["n"]}_d{c["buffers"]}')
def test_blt_matches_jax_privacy(case):
  """Their BLT's parameters describe C with c_0 = 1 as ours do (same Toeplitz coefficients);
  our d-buffer stream inverts it (their inverse BLT's coefficients); the same loss by both; our
  optimum is not worse than theirs beyond the local-optimum tolerance."""
  n, k, sep = case['n'], case.get('participations', 1), case.get('min_sep')
  theirs = blt.BLT(np.asarray(case['decays']), np.asarray(case['weights']))
  np.testing.assert_allclose(blt.coefs(theirs, n), case['coefs'], rtol=1e-12, atol=1e-15)
  e0 = np.eye(n)[0]
  np.testing.assert_allclose(
    blt.inverse_apply(theirs, e0), case['inverse_coefs'], rtol=1e-9, atol=1e-12
  )

  def loss(b):
    delta = blt.sensitivity_of(b, n, k, sep)
    assert delta.exact
    return expected_error.toeplitz_expected_error(blt.coefs(b, n), n, delta.value)

  assert loss(theirs) == pytest.approx(case['loss'], rel=SAME)
  ours = blt.optimize(n, case['buffers'], participations=k, min_sep=sep)
  assert loss(ours) <= case['loss'] * (1 + BLT_SOLVER)
