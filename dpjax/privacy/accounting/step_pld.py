"""The PLD of one DP-SGD step, built as dp_accounting builds it, with its cost known first.

dp_accounting's `PLDAccountant` discretises each event's privacy-loss
distribution with pessimistic rounding (any grid gives an upper bound; which
grid, `pld_grid` and `step_compositions` decide); the grid of a mixture of
Gaussians (group privacy, sampling with replacement) grows as σ falls and its
construction costs points × components, so its size is estimated before
anything is allocated (`estimate_pld_grid_points`) and an oversized grid is
refused with `GridTooLargeError`.
"""

from __future__ import annotations

import collections
import math
import sys
import threading
from typing import Callable

import tqdm
from dp_accounting import dp_event
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism

from dpjax.privacy.accounting import gaussian_pld
from dpjax.privacy.accounting import pld_self_compose

# Refuse to build a per-step PLD whose grid (privacy-loss points × mixture components, what
# dp_accounting evaluates and holds as float64 arrays) exceeds this (the cost of large grids:
# scripts/README.md, bench_accounting_limits.py).
MAX_GRID_POINTS = 2 * 10**6


def step_pld(event: dp_event.DpEvent, interval: float) -> pld_lib.PrivacyLossDistribution:
  """The PLD of one step, built as dp_accounting's PLDAccountant builds it (Gaussian steps by
  `gaussian_pld`, dp_accounting's construction bit for bit, vectorised)."""
  if isinstance(event, dp_event.PoissonSampledDpEvent):
    return gaussian_pld.gaussian_pld(
      event.event.noise_multiplier, interval, sampling_prob=event.sampling_probability
    )
  if isinstance(event, dp_event.MixtureOfGaussiansDpEvent):
    if len(event.sensitivities) == 2 and event.sensitivities[0] == 0:
      # MoG [0, s] with probabilities [1 − p, p] *is* the Poisson-subsampled Gaussian pair
      # with sensitivity s and rate p (both directions); dp_accounting builds that one faster,
      # with the same ε (tests/privacy/accounting/test_accounting_events.py).
      return gaussian_pld.gaussian_pld(
        event.standard_deviation,
        interval,
        sensitivity=event.sensitivities[1],
        sampling_prob=event.sampling_probs[1],
      )
    return pld_lib.from_mixture_gaussian_mechanism(
      standard_deviation=event.standard_deviation,
      sensitivities=event.sensitivities,
      sampling_probs=event.sampling_probs,
      value_discretization_interval=interval,
    )
  if isinstance(event, dp_event.TruncatedSubsampledGaussianDpEvent):
    return pld_lib.from_truncated_subsampled_gaussian_mechanism(
      dataset_size=event.dataset_size,
      sampling_probability=event.sampling_probability,
      truncated_batch_size=event.truncated_batch_size,
      noise_multiplier=event.noise_multiplier,
      value_discretization_interval=interval,
    )
  if isinstance(event, dp_event.GaussianDpEvent):  # One epoch in a fixed order (sensitivity 1).
    return gaussian_pld.gaussian_pld(event.noise_multiplier, interval)
  raise TypeError(f'no per-step PLD for {event!r}')


class KeptPLDs:
  """PLDs (or other results: chosen grids, calibrated σ) kept for this process by key, the
  `size` most recently used (thread-safe).

  Keys name everything a value depends on; dp_accounting's PLDs are not changed by composing or
  querying them, so one object serves every caller.
  """

  def __init__(self, size: int):
    self.size = size
    self._plds: collections.OrderedDict[tuple, pld_lib.PrivacyLossDistribution] = (
      collections.OrderedDict()
    )
    self._lock = threading.Lock()

  def get(self, key: tuple) -> pld_lib.PrivacyLossDistribution | None:
    with self._lock:
      if key in self._plds:
        self._plds.move_to_end(key)
      return self._plds.get(key)

  def put(self, key: tuple, pld: pld_lib.PrivacyLossDistribution) -> None:
    with self._lock:
      self._plds[key] = pld
      while len(self._plds) > self.size:
        self._plds.popitem(last=False)


# Calibration, the planner and ε at many steps ask for the same step, and runs of one config for
# the same compositions, again; one query refines through up to ~10 grids (`pld_grid`). Step
# PLDs hold at most MAX_GRID_POINTS floats; composed ones are kept only up to
# MAX_KEPT_COMPOSED_POINTS (they reach step_compositions.MAX_COMPOSED_POINTS).
BUILT_STEPS = KeptPLDs(16)
COMPOSED = KeptPLDs(16)
MAX_KEPT_COMPOSED_POINTS = 5 * 10**5


def dense_step_pld(event: dp_event.DpEvent, interval: float) -> pld_lib.PrivacyLossDistribution:
  """`step_pld` with dense PMFs, built once per process for each (event, interval): the key is
  the event's repr, which names its class and every parameter."""
  key = (repr(event), float(interval))
  pld = BUILT_STEPS.get(key)
  if pld is None:
    pld = with_dense_pmfs(step_pld(event, interval))
    BUILT_STEPS.put(key, pld)
  return pld


def composed_step_pld(
  step: pld_lib.PrivacyLossDistribution,
  event: dp_event.DpEvent,
  interval: float,
  count: int,
  check: Callable[[pld_lib.PrivacyLossDistribution, int], None],
) -> pld_lib.PrivacyLossDistribution:
  """`count` steps of `step` = `dense_step_pld(event, interval)` (dp_accounting's self_compose),
  kept per process when small; `check(step, count)` runs before a composition is computed."""
  key = (repr(event), float(interval), int(count))
  composed = COMPOSED.get(key)
  if composed is None:
    check(step, count)
    composed = pld_self_compose.self_compose(step, count)
    if sum(getattr(p, 'size', math.inf) for p in pld_pmfs(composed)) <= MAX_KEPT_COMPOSED_POINTS:
      COMPOSED.put(key, composed)
  return composed


def progress_bar(total: int | None, desc: str) -> tqdm.tqdm:
  """A tqdm bar on stderr that appears only after 10 s, and only on a terminal (quiet in tests
  and logs)."""
  return tqdm.tqdm(
    total=total,
    desc=f'dpjax.privacy.accounting: {desc}',
    delay=10,
    disable=None,
    file=sys.stderr,
    leave=False,
    dynamic_ncols=True,
  )


class GridTooLargeError(ValueError):
  """A per-step PLD would exceed `max_grid_points` (raised before anything is allocated)."""


def mixture_components(event: dp_event.DpEvent) -> tuple[float, list, list] | None:
  """(σ, sensitivities, probabilities) of a Gaussian-type step event; None for others."""
  if isinstance(event, dp_event.PoissonSampledDpEvent):
    q = event.sampling_probability
    return event.event.noise_multiplier, [0.0, 1.0], [1 - q, q]
  if isinstance(event, dp_event.MixtureOfGaussiansDpEvent):
    return event.standard_deviation, list(event.sensitivities), list(event.sampling_probs)
  return None


def loss_scale(event: dp_event.DpEvent) -> float:
  """√χ²(P‖Q) of a Gaussian-type step (the spread of its privacy loss where it is small);
  inf for other events.

  For P = Σ_i p_i N(s_i, σ²), Q = N(0, σ²): χ² = Σ_ij p_i p_j e^{s_i s_j / σ²} − 1 (the
  Gaussian moment generating function); Poisson rate q: q·√(e^{1/σ²} − 1). A grid must
  resolve this scale, whatever ε is: at q = 8e-5, σ = 2 it is 4e-5.
  """
  parts = mixture_components(event)
  if parts is None:
    return math.inf
  sigma, sensitivities, probs = parts
  logs = [
    math.log(p) + math.log(r) + s * t / sigma**2
    for s, p in zip(sensitivities, probs)
    for t, r in zip(sensitivities, probs)
    if p > 0 and r > 0
  ]
  top = max(logs)
  log_one_plus = top + math.log(sum(math.exp(v - top) for v in logs))
  return math.sqrt(max(0.0, math.expm1(log_one_plus))) if log_one_plus < 700 else math.inf


def estimate_pld_grid_points(event: dp_event.DpEvent, interval: float) -> int | None:
  """The size of the per-step PLD `step_pld` would build: grid points × mixture components.

  The points are dp_accounting's own connect-the-dots range (its privacy-loss
  tail bounds, both adjacency directions) divided by the discretisation. A
  mixture of > 2 Gaussians evaluates each point against every component (in
  a binary search, arrays of points × components); the Poisson-type pair [0, s]
  has a closed-form inverse and counts its points once. Nothing is built; None
  for events without an estimate (truncated Poisson).
  """
  ranges = loss_ranges(event)
  if ranges is None:
    return None
  widths, components = ranges
  points = 0.0
  for width in widths:
    points = max(points, width / interval + 1)
  return int(math.ceil(points * components))


# (repr(event),) -> its loss ranges: the root searches of a mixture's tail bounds cost ~0.1 s,
# and a grid's refinement asks for them at every grid it considers.
RANGES = KeptPLDs(256)


def loss_ranges(event: dp_event.DpEvent) -> tuple[tuple[float, ...], int] | None:
  """(epsilon_upper − epsilon_lower of dp_accounting's connect-the-dots bounds, per adjacency
  direction; the components each grid point is evaluated against), kept per process by the
  event's repr (its class and every parameter); None for events without an estimate."""
  key = (repr(event),)
  kept = RANGES.get(key)
  if kept is not None:
    return kept
  parts = mixture_components(event)
  if parts is None:
    return None
  sigma, sensitivities, probs = parts
  closed_form = len(sensitivities) == 2 and sensitivities[0] == 0  # As `step_pld` builds it.
  widths = []
  for adjacency in (
    privacy_loss_mechanism.AdjacencyType.ADD,
    privacy_loss_mechanism.AdjacencyType.REMOVE,
  ):
    if closed_form:
      loss = privacy_loss_mechanism.GaussianPrivacyLoss(
        sigma, sensitivity=sensitivities[1], sampling_prob=probs[1], adjacency_type=adjacency
      )
    else:
      loss = privacy_loss_mechanism.MixtureGaussianPrivacyLoss(
        sigma, sensitivities, probs, adjacency_type=adjacency
      )
    bounds = loss.connect_dots_bounds()
    widths.append(bounds.epsilon_upper - bounds.epsilon_lower)
  result = (tuple(widths), 1 if closed_form else len(sensitivities))
  RANGES.put(key, result)
  return result


def pld_pmfs(pld: pld_lib.PrivacyLossDistribution):
  """The PLD's PMFs: (remove,) if symmetric, else (remove, add)."""
  # pylint: disable-next=protected-access
  return (pld._pmf_remove,) if pld._symmetric else (pld._pmf_remove, pld._pmf_add)


def with_dense_pmfs(pld: pld_lib.PrivacyLossDistribution) -> pld_lib.PrivacyLossDistribution:
  """The same PLD with dense PMFs: dp_accounting's sparse self_compose evaluates
  size**count (a big integer) first, which never ends for the step counts of long runs."""
  pmfs = pld_pmfs(pld)
  if not any(isinstance(p, pld_pmf.SparsePLDPmf) for p in pmfs):
    return pld
  dense = [p.to_dense_pmf() if isinstance(p, pld_pmf.SparsePLDPmf) else p for p in pmfs]
  return pld_lib.PrivacyLossDistribution(dense[0], dense[1] if len(dense) > 1 else None)
