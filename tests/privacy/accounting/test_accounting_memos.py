"""The accounting's per-process memos give dp_accounting's own numbers, bit for bit, and never
mix up two inputs.

A memo that returned a neighbouring configuration's curve or grid would report a wrong ε
silently; each test here compares with the computation done afresh and with distinct inputs
that differ in one parameter only.
"""

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from dpjax.privacy.accounting import rdp_steps

REL = rdp_privacy_accountant.NeighborRel
EVENTS = [
  (dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.1)), REL.ADD_OR_REMOVE_ONE),
  (
    dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.1000001)),
    REL.ADD_OR_REMOVE_ONE,
  ),
  (dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(1.1)), REL.ADD_OR_REMOVE_ONE),
  (dp_event.GaussianDpEvent(3.0), REL.ADD_OR_REMOVE_ONE),
  (
    dp_event.SampledWithoutReplacementDpEvent(1000, 10, dp_event.GaussianDpEvent(0.55)),
    REL.REPLACE_ONE,
  ),
  # Not composed linearly by dp_accounting: the accountant itself answers.
  (dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(2.0)] * 2), REL.ADD_OR_REMOVE_ONE),
]


def _fresh(event, count, relation):
  accountant = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
  accountant.compose(event, count)
  return accountant


@pytest.mark.slow
def test_composed_rdp_is_dp_accountings_curve_bit_for_bit():
  """Every event at two counts, the memo asked before and after all the others: the curve, ε(δ)
  and δ(ε) equal a fresh RdpAccountant's exactly (a memo keyed too coarsely, e.g. by q alone or
  by the rounded σ, would return the neighbouring event's curve: rows 0-2 differ in σ by 1e-7
  or in q)."""
  cases = [(e, r, c) for e, r in EVENTS for c in ((7,) if r == REL.REPLACE_ONE else (1, 2350))]
  first = [rdp_steps.composed_rdp(e, c, r) for e, r, c in cases]
  for (event, relation, count), memo in zip(cases, first):
    fresh, again = _fresh(event, count, relation), rdp_steps.composed_rdp(event, count, relation)
    for got in (memo, again):
      assert np.array_equal(got.rdp, fresh.rdp)
      for delta in (1e-5, 1e-3):
        assert got.get_epsilon(delta) == fresh.get_epsilon(delta)
      for eps in (0.5, 4.0):
        assert got.get_delta(eps) == fresh.get_delta(eps)
  curves = [m.rdp.tobytes() for m in first]
  assert len(set(curves)) == len(curves)


def test_the_step_curve_is_built_once_and_cannot_be_changed(monkeypatch):
  event = dp_event.GaussianDpEvent(0.93)
  first = rdp_steps.one_step_rdp(event, REL.ADD_OR_REMOVE_ONE)
  built = []
  real = rdp_privacy_accountant.RdpAccountant.compose
  monkeypatch.setattr(
    rdp_privacy_accountant.RdpAccountant, 'compose', lambda *a: built.append(a) or real(*a)
  )
  again = rdp_steps.one_step_rdp(event, REL.ADD_OR_REMOVE_ONE)
  assert again[1] is first[1] and not built
  with pytest.raises(ValueError):
    again[1][0] = 0.0
  # The same event under another neighbouring relation is a key of its own.
  rdp_steps.one_step_rdp(event, REL.REPLACE_ONE)
  assert len(built) == 1


def _poisson(n=10_000, b=100):
  from dpjax.privacy import samplers  # pylint: disable=import-outside-toplevel

  return samplers.sampler_class('poisson')(num_examples=n, batch_size=b)


@pytest.mark.slow
def test_a_chosen_grid_serves_the_next_accountant_with_the_same_bits(monkeypatch):
  """The second accountant of a query reuses the grid the first one chose (no refinement: one
  step PLD, at most one composition) and reports the same ε and grid details as a process
  that never computed it; δ, the count, σ or the limits differing in the last digit choose
  their own grid."""
  from dpjax.privacy.accounting import accountant as accountant_lib  # pylint: disable=import-outside-toplevel
  from dpjax.privacy.accounting import step_compositions, step_pld  # pylint: disable=import-outside-toplevel

  def fresh_process():
    for module, name in ((step_pld, 'BUILT_STEPS'), (step_pld, 'COMPOSED')):
      monkeypatch.setattr(module, name, step_pld.KeptPLDs(16))
    monkeypatch.setattr(step_compositions, 'CHOSEN_GRIDS', step_pld.KeptPLDs(256))

  def report(sigma=1.3, delta=1e-5, steps=300, **kw):
    acct = accountant_lib.Accountant(_poisson(), sigma, delta, max_batch_size=None, **kw)
    return acct.epsilon_at(steps, estimates=False)

  fresh_process()
  first = report()
  assert len(step_compositions.CHOSEN_GRIDS._plds) == 1  # pylint: disable=protected-access
  chosen = []
  real = step_compositions.StepCompositions.choose_grid
  monkeypatch.setattr(
    step_compositions.StepCompositions,
    'choose_grid',
    lambda *a: chosen.append(a[1:3]) or real(*a),
  )
  again = report()
  assert not chosen and again.epsilon == first.epsilon and again.details == first.details
  others = [
    report(sigma=1.3 * (1 + 1e-12)),
    report(delta=1e-5 * (1 + 1e-12)),
    report(steps=299),
    report(max_grid_points=step_pld.MAX_GRID_POINTS - 1),
  ]
  assert len(chosen) == 4
  assert all(o.details['pld_grid'] > 0 and o.epsilon != first.epsilon for o in others[:3])
  fresh_process()
  recomputed = report()
  assert chosen[-1][1] == 300  # Computed afresh, with the bits of the memo's answer.
  assert recomputed.epsilon == first.epsilon and recomputed.details == first.details


@pytest.mark.slow
def test_a_calibrated_sigma_is_kept_only_under_its_exact_key(monkeypatch):
  """Calibration asked again returns its σ without a search; a target or steps differing at
  all, or of another type, searches again (numpy scalars are never kept)."""
  import numpy as onp  # pylint: disable=import-outside-toplevel,reimported

  from dpjax.privacy.accounting import calibration, step_pld  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(calibration, 'CALIBRATED', step_pld.KeptPLDs(256))
  searched = []
  real = calibration._calibrate_at_sensitivity  # pylint: disable=protected-access
  monkeypatch.setattr(
    calibration, '_calibrate_at_sensitivity', lambda *a, **k: searched.append(a) or real(*a, **k)
  )
  sampler = _poisson(1000, 50)
  sigma = lambda target=2.0, steps=20, **kw: calibration.calibrate_noise_multiplier(
    sampler, target, 1e-5, steps, max_batch_size=None, **kw
  )
  first = sigma()
  assert sigma() == first and len(searched) == 1
  assert sigma(onp.float64(2.0)) == first and len(searched) == 2  # Computed: the same σ.
  assert sigma(2.0 * (1 + 1e-9)) >= first and sigma(steps=21) > first and len(searched) == 4
  assert calibration._memo_key(sampler, 2.0, 1e-5, 20, 1, {}) != calibration._memo_key(  # pylint: disable=protected-access
    sampler, 2.0, 1e-5, 20, 1.0, {}
  )  # Sensitivity 1 (int) and 1.0: keys of their own.


def test_the_deterministic_bound_is_kept_by_exact_arguments_and_types():
  """The kept ε and δ(ε) equal dp_accounting's, queried on a new GaussianPrivacyLoss each time
  (as before they were kept); a bool is refused as a count even after the int was kept."""
  from dp_accounting.pld import privacy_loss_mechanism  # pylint: disable=import-outside-toplevel

  from dpjax.privacy.accounting import balls_and_bins  # pylint: disable=import-outside-toplevel

  def unkept(sigma, epochs, delta, k=1, tau=0.0):
    effective = sigma / (k * np.sqrt(epochs))
    delta_at = lambda e: float(
      privacy_loss_mechanism.GaussianPrivacyLoss(effective, sensitivity=1.0).get_delta_for_epsilon(
        e
      )
    )
    return balls_and_bins.smallest_epsilon(delta_at, delta, penalty_mass=tau)

  cases = [(1.5, 3, 1e-5, 1, 0.0), (1.5 * (1 + 1e-6), 3, 1e-5, 1, 0.0), (1.5, 4, 1e-5, 1, 0.0)]
  cases += [(1.5, 3, 1e-6, 1, 0.0), (1.5, 3, 1e-5, 2, 0.0), (1.5, 3, 1e-5, 1, 1e-9)]
  got = [
    balls_and_bins.deterministic_epsilon(s, e, d, group_size=k, penalty_mass=t)
    for s, e, d, k, t in cases * 2
  ]
  assert got == [unkept(*c) for c in cases] * 2 and len(set(got)) == len(cases)
  assert balls_and_bins.gaussian_delta(1.5, 2.0) == float(
    privacy_loss_mechanism.GaussianPrivacyLoss(1.5, sensitivity=1.0).get_delta_for_epsilon(2.0)
  )
  with pytest.raises(ValueError, match='num_epochs'):
    balls_and_bins.deterministic_epsilon(1.5, True, 1e-5)


def test_the_random_allocation_grid_is_kept_by_exact_arguments():
  from dpjax.privacy.accounting import random_allocation  # pylint: disable=import-outside-toplevel

  cases = [(4.0, 100, 1e-5), (4.0, 130, 1e-5), (3.0, 100, 1e-5), (4.0, 100, 1e-3)]
  kept = [random_allocation.default_discretization(*c) for c in cases * 2]
  unkept = [random_allocation._default_discretization(*c) for c in cases]  # pylint: disable=protected-access
  assert kept == unkept * 2 and len(set(unkept)) == len(cases)
