"""T steps of one DP-SGD step event as a PLD, at the grid that follows ε, within memory limits.

An accountant holds one `StepCompositions`: it builds each step's PLD once per
grid (`step_pld.dense_step_pld`, also kept per process), composes it
(dp_accounting's `self_compose`), and chooses the grid per (event, steps) by
`pld_grid.refine`: from a coarse grid, refined until ε(δ) moves by < 0.1 %, the
smallest bound kept (every grid's pessimistic PLD is an upper bound). Refinement
stops, without an error, where its budget ends (REFINEMENT_GRID_POINTS,
MAX_REFINED_COMPOSED_POINTS, `max_grid_points`); the first grid above
`max_grid_points`, or any composition above MAX_COMPOSED_POINTS, is refused
(`GridTooLargeError`) before it is allocated.
"""

from __future__ import annotations

import dataclasses

from dp_accounting import dp_event
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpjax.privacy.accounting import pld_grid
from dpjax.privacy.accounting.step_pld import composed_step_pld
from dpjax.privacy.accounting.step_pld import dense_step_pld
from dpjax.privacy.accounting.step_pld import estimate_pld_grid_points
from dpjax.privacy.accounting.step_pld import GridTooLargeError
from dpjax.privacy.accounting.step_pld import KeptPLDs
from dpjax.privacy.accounting.step_pld import loss_scale
from dpjax.privacy.accounting.step_pld import pld_pmfs
from dpjax.privacy.accounting.step_pld import progress_bar

# A composed PLD beyond this many grid points (x 16 bytes in its FFT) is refused before it is
# allocated.
MAX_COMPOSED_POINTS = 5 * 10**7
# The refinement's budget, counted in grid points so that it is the same on every machine (and
# one configuration always reports the same ε): the step grids of one query together hold at
# most REFINEMENT_GRID_POINTS points × mixture components (~5-20 s of dp_accounting's
# construction on one core: scripts/bench_accounting_grid.py), and a composition expected (twice
# the last one's points) above MAX_REFINED_COMPOSED_POINTS (~10 s of FFTs) is not started. The
# first grid is always built (if within max_grid_points).
REFINEMENT_GRID_POINTS = 3 * 10**5
# The first jump also resolves the step's own loss scale (`step_pld.loss_scale`): a grid
# ≤ √χ²/8, which small sampling rates need long before SCALE·ε does (issue 34: 3.1e-6 at
# q = 8e-5, where SCALE·ε = 1.4e-3). Then halving as usual.
LOSS_SCALE_FRACTION = 1 / 8
MAX_REFINED_COMPOSED_POINTS = 5 * 10**6
# The grid each (event, steps, δ, limits) query chose, for every accountant of the process (the
# planner's rows, the trainer's ε at its last step after its plan, a CLI's table and JSON):
# the refinement through up to MAX_GRIDS compositions is done once; the choice is a pure
# function of the key (the budget counts grid points, not seconds), so ε is bit-identical
# (tests/privacy/accounting/test_accounting_memos.py). Kept without the composed PLD.
CHOSEN_GRIDS = KeptPLDs(256)


def cost_twin(event: dp_event.DpEvent) -> dp_event.DpEvent:
  """The event whose grid estimate stands for `event`'s: dp_accounting builds a truncated
  Poisson step from the Poisson-subsampled Gaussian of the same rate and σ."""
  if isinstance(event, dp_event.TruncatedSubsampledGaussianDpEvent):
    return dp_event.PoissonSampledDpEvent(
      event.sampling_probability, dp_event.GaussianDpEvent(event.noise_multiplier)
    )
  return event


class StepCompositions:
  """Composed step PLDs of one accountant: ε(δ)'s grid chosen once per (event, steps).

  Args:
    noise_multiplier: σ (for messages).
    delta: the δ at which the grid's ε is compared.
    max_grid_points: the per-step limit (grid points × mixture components).
    fixed_interval: a fixed discretisation instead of the refined one (None: refine).
    coarsening: > 1 for searches: the first jump only, unconfirmed (a valid bound, within
      a few 0.1 % of the refined one), or multiplies a fixed grid.
    describe: (event, points, interval) -> the message of a `GridTooLargeError` for a step grid.
  """

  def __init__(
    self,
    noise_multiplier: float,
    delta: float,
    max_grid_points: int,
    fixed_interval: float | None,
    coarsening: float,
    describe,
  ):
    self.noise_multiplier = noise_multiplier
    self.delta = delta
    self.max_grid_points = max_grid_points
    self.fixed_interval = fixed_interval
    self.coarsening = coarsening
    self.describe = describe
    self.step_plds: dict[tuple[str, float], pld_lib.PrivacyLossDistribution] = {}
    self.grids: dict[tuple[str, int], pld_grid.Refined] = {}

  def composed(
    self, event: dp_event.DpEvent, count: int, what: str
  ) -> pld_lib.PrivacyLossDistribution:
    """`count` steps of `event` at the grid with the smallest ε(δ) (`what` names the sampler
    on the progress bar)."""
    key = (repr(event), int(count))
    if key in self.grids:
      return self.at_grid(event, self.grids[key].grid, count)
    # Everything the choice depends on (σ and `describe` only word its errors).
    chosen_key = (*key, self.delta, self.max_grid_points, self.fixed_interval, self.coarsening)
    chosen = CHOSEN_GRIDS.get(chosen_key)
    if chosen is not None:  # The same grid again: one composition, or none if it was kept.
      self.grids[key] = dataclasses.replace(chosen, value=self.at_grid(event, chosen.grid, count))
      return self.grids[key].value
    with progress_bar(None, f'PLD of {count} {what} steps') as bar:
      self.grids[key] = self.choose_grid(event, count, bar)
    CHOSEN_GRIDS.put(chosen_key, dataclasses.replace(self.grids[key], value=None))
    return self.grids[key].value

  def grid_details(self, event: dp_event.DpEvent, count: int, what: str) -> dict:
    """The grid `composed(event, count)` used, for a report."""
    if (repr(event), int(count)) not in self.grids:
      self.composed(event, count, what)
    return self.grids[(repr(event), int(count))].details()

  def choose_grid(self, event: dp_event.DpEvent, count: int, bar) -> pld_grid.Refined:
    """The refinement (or the fixed grid); only the first grid may raise GridTooLargeError."""
    fixed = self.fixed_interval
    start = min(0.1, fixed * self.coarsening) if fixed is not None else pld_grid.START_GRID
    spent = {'points': 0, 'composed': 0}

    def affordable(interval):
      points = estimate_pld_grid_points(cost_twin(event), interval) or 0
      return (
        points <= self.max_grid_points
        and spent['points'] + points <= REFINEMENT_GRID_POINTS
        and 2 * spent['composed'] <= MAX_REFINED_COMPOSED_POINTS
      )

    scale = loss_scale(cost_twin(event)) * LOSS_SCALE_FRACTION

    def next_grid(interval, eps):  # The jump toward the grid ε needs, as far as the budget allows.
      finer = pld_grid.next_ladder_grid(interval, eps)
      if 0 < scale < finer:
        finer = pld_grid.on_ladder(scale)
      while finer < interval / 2 and not affordable(finer):
        finer *= 2
      return finer

    def evaluate(interval):
      if interval != start and not affordable(interval):
        return None
      try:
        pld = self.at_grid(event, interval, count)
      except GridTooLargeError:
        if interval == start:
          raise
        return None
      spent['points'] += estimate_pld_grid_points(cost_twin(event), interval) or 0
      spent['composed'] = max(getattr(p, 'size', 0) for p in pld_pmfs(pld))
      eps = float(pld.get_epsilon_for_delta(self.delta))
      bar.set_postfix_str(f'grid {interval:.3g}: ε = {eps:.5g}', refresh=False)
      bar.update()
      return eps, pld

    if fixed is not None:
      eps, pld = evaluate(start)
      return pld_grid.Refined(eps, start, pld, ((start, eps),), False)
    return pld_grid.refine(
      evaluate,
      start,
      rel_tol=pld_grid.REL_TOL * self.coarsening,
      next_grid=next_grid,
      coarsest_compared=pld_grid.trusted_ladder_grid,
      max_grids=pld_grid.MAX_GRIDS if self.coarsening == 1 else 2,
    )

  def at_grid(
    self, event: dp_event.DpEvent, interval: float, count: int
  ) -> pld_lib.PrivacyLossDistribution:
    """`count` steps of `event` at this grid; the step PLD is kept here whatever the process
    cache has evicted since."""
    key = (repr(event), float(interval))
    if key not in self.step_plds:
      self.check_grid(event, interval)
      self.step_plds[key] = dense_step_pld(event, interval)
    return composed_step_pld(self.step_plds[key], event, interval, count, self.check_composition)

  def check_grid(self, event: dp_event.DpEvent, interval: float) -> None:
    """GridTooLargeError before building a step PLD above max_grid_points."""
    points = estimate_pld_grid_points(event, interval)
    if points is not None and points > self.max_grid_points:
      raise GridTooLargeError(self.describe(event, points, interval))

  def check_composition(self, pld: pld_lib.PrivacyLossDistribution, count: int) -> None:
    """GridTooLargeError before composing `count` steps would allocate more than
    MAX_COMPOSED_POINTS (dp_accounting's own truncation bounds of the composed support)."""
    for pmf in pld_pmfs(pld):
      probs = getattr(pmf, '_probs', None)
      if probs is None or count <= 1 or (len(probs) - 1) * count + 1 <= MAX_COMPOSED_POINTS:
        continue  # Without truncation the composed support has (len − 1)·count + 1 points.
      low, high = pld_common.compute_self_convolve_bounds(probs, count, 1e-15)
      if high - low + 1 > MAX_COMPOSED_POINTS:
        raise GridTooLargeError(
          f'num_steps = {count}: composing the privacy loss of {count:.3g} steps needs '
          f'~{high - low + 1:.3g} grid points, beyond the {MAX_COMPOSED_POINTS:.0e} that fit '
          f'in memory (σ = {self.noise_multiplier:.4g}). Shorten the run, or raise σ.'
        )
