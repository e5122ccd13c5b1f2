"""RDP of `count` steps of one event, dp_accounting's numbers with the step's curve built once.

dp_accounting's `RdpAccountant.compose(event, count)` adds `count · rdp(event)` to a zero
curve, and `rdp(event)` of a subsampled Gaussian (~150 orders, the fractional ones summed
term by term in Python) costs ~0.1-0.5 s; the trainer's ε at every checkpoint, calibration
and a report with estimates ask for the same step at other counts again and again. Here the
one-step curve is built once per process (by dp_accounting itself, keyed by the event's repr,
the orders and the neighbouring relation) and multiplied by `count` as dp_accounting does:
0 + count·x is count·x, so ε and δ are bit-identical
(tests/privacy/accounting/test_accounting_memos.py).
"""

from __future__ import annotations

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from dpjax.privacy.accounting.step_pld import KeptPLDs

# Events whose RDP dp_accounting composes linearly (`self._rdp += count * f(event)`); any
# other event is composed by dp_accounting's accountant each time.
_LINEAR = (
  dp_event.GaussianDpEvent,
  dp_event.PoissonSampledDpEvent,
  dp_event.SampledWithoutReplacementDpEvent,
)
NeighborRel = rdp_privacy_accountant.NeighborRel


class ComposedRdp:
  """The RDP curve of a composition, queried as dp_accounting's `RdpAccountant` is."""

  def __init__(self, orders: np.ndarray, rdp: np.ndarray):
    self.orders = orders
    self.rdp = rdp

  def get_epsilon(self, target_delta: float) -> float:
    return rdp_privacy_accountant.compute_epsilon(self.orders, self.rdp, target_delta)[0]

  def get_delta(self, target_epsilon: float) -> float:
    return rdp_privacy_accountant.compute_delta(self.orders, self.rdp, target_epsilon)[0]


# (repr(event), relation) -> (orders, one step's RDP), the most recently used kept.
_ONE_STEP = KeptPLDs(64)


def one_step_rdp(event: dp_event.DpEvent, relation: NeighborRel) -> tuple[np.ndarray, np.ndarray]:
  """(orders, RDP of one step), read-only, computed by dp_accounting once per process: the key
  is the event's repr, which names its class and every parameter."""
  key = (repr(event), relation)
  kept = _ONE_STEP.get(key)
  if kept is not None:
    return kept
  accountant = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
  accountant.compose(event, 1)
  orders, rdp = accountant.orders, accountant.rdp
  orders.flags.writeable = rdp.flags.writeable = False
  _ONE_STEP.put(key, (orders, rdp))
  return orders, rdp


def composed_rdp(
  event: dp_event.DpEvent, count: int, relation: NeighborRel = NeighborRel.ADD_OR_REMOVE_ONE
) -> ComposedRdp | rdp_privacy_accountant.RdpAccountant:
  """`count` steps of `event` under `relation` with dp_accounting's default orders."""
  if type(event) not in _LINEAR:
    accountant = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    accountant.compose(event, count)
    return accountant
  orders, one = one_step_rdp(event, relation)
  return ComposedRdp(orders, np.zeros_like(one) + count * one)
