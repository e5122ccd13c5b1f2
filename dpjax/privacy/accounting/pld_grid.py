"""The PLD grid that follows ε: refine the discretisation until the bound stops moving.

A privacy-loss distribution discretised pessimistically (dp_accounting's
connect-the-dots, Doroshenko et al. 2022, "Connect the Dots: Tighter Discrete
Approximations of Privacy Loss Distributions"; `PLD_accounting`'s dominating
rounding, Feldman & Shenfeld 2025) dominates the true pair at *every* grid, and
composition keeps the domination: each grid's ε is an upper bound on the true ε.
The smallest of several such bounds is therefore one too. Which grid gives it
depends on nothing but the mechanism's public parameters (σ, q, T, δ), never on
the data, so taking the minimum over refinements releases nothing.

One fixed grid is loose at small ε: at Poisson N = 12.8M, b = 1024, T = 12,500,
σ = 2, δ = 1e-8 the grid 1e-4 gives 0.0286 where finer grids give 0.0206
(the per-step losses, ~q/σ, fall far below the grid), and needlessly fine at large ε
(ε = 15.6 moves by 5e-5 relative between 1e-3 and 1e-4, at 10× the cost).
`refine` makes the grid follow ε: start coarse and cheap (`START_GRID`), jump to
the ladder point below `SCALE`·ε (the caller's `next_grid` may jump finer: the
accountant also resolves one step's loss scale, `step_compositions`), then halve
until the bound moves by less than `REL_TOL` (0.1 %) between two grids, or the
budget refuses the next grid (the caller's `evaluate` returns None). The error of connect-the-dots shrinks about
as the grid squared, so the reported bound is then within ~REL_TOL/3 of the
limit (tests/privacy/accounting/test_pld_grid.py checks 1 % against a fine grid).

Grids lie on the ladder 1e-4·2^k so that one query's step PLDs, kept per
(event, grid) (`step_pld.KeptPLDs`), serve the next; the search is deterministic
(the accountant's budget counts grid points, not seconds), so one configuration
always reports the same ε. The random-allocation grid (`balls_and_bins`) is
refined by halving only, within a time budget that is opt-in.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

# The bound stops moving: the last refinement changed it by less than this fraction.
REL_TOL = 1e-3
# The first (cheapest) grid, and the ladder its refinements live on: 1e-4·2^k.
LADDER_UNIT = 1e-4
START_GRID = LADDER_UNIT * 2**7  # 0.0128
# After the first grid, jump to the ladder point at or below SCALE·ε (then halve).
SCALE = 4e-3
# At most this many grids per query (a guard; the point budgets stop it sooner).
MAX_GRIDS = 16


@dataclasses.dataclass(frozen=True)
class Refined:
  """The result of `refine`.

  Attributes:
    epsilon: the smallest ε over the grids evaluated (an upper bound, see the module).
    grid: the grid that gave it.
    value: what `evaluate` returned with it (e.g. the composed PLD).
    tried: ((grid, ε), ...) in the order evaluated.
    converged: the last refinement moved the bound by less than the tolerance
      (False: the budget, or the grid limit, stopped it first).
  """

  epsilon: float
  grid: float
  value: Any
  tried: tuple[tuple[float, float], ...]
  converged: bool

  def details(self, prefix: str = 'pld') -> dict:
    """What a report carries about the grid."""
    return {
      f'{prefix}_grid': self.grid,
      f'{prefix}_grid_converged': self.converged,
      f'{prefix}_grids_tried': len(self.tried),
    }


def on_ladder(value: float) -> float:
  """The ladder point 1e-4·2^k at or below `value` (> 0)."""
  return LADDER_UNIT * 2.0 ** math.floor(math.log2(value / LADDER_UNIT) + 1e-9)


def next_ladder_grid(grid: float, epsilon: float) -> float:
  """Half the grid, or the ladder point at or below SCALE·ε when that is finer."""
  if not math.isfinite(epsilon) or epsilon <= 0:
    return grid / 2
  return min(grid / 2, on_ladder(SCALE * epsilon))


def halve(grid: float, epsilon: float) -> float:
  """Half the grid (the refinement of grids off the ladder)."""
  del epsilon
  return grid / 2


def moved_less_than(before: float, after: float, rel_tol: float) -> bool:
  """The bound moved by less than rel_tol (relative to the new bound)."""
  if after == 0 or (math.isinf(before) and math.isinf(after)):
    return True  # Zero cannot fall; two infinite bounds: the grid is not what limits it.
  return abs(before - after) < rel_tol * after


def refine(
  evaluate: Callable[[float], tuple[float, Any] | None],
  start: float,
  *,
  rel_tol: float = REL_TOL,
  next_grid: Callable[[float, float], float] = next_ladder_grid,
  coarsest_compared: Callable[[float], float] | None = None,
  max_grids: int = MAX_GRIDS,
) -> Refined:
  """The smallest ε over grids from `start`, refined until it moves by less than rel_tol.

  Args:
    evaluate: grid -> (ε, value), ε an upper bound at that grid; None when the grid is
      beyond the caller's budget (the refinement stops there). Must not return None for
      `start` (raise instead: nothing would be reported).
    start: the first grid.
    rel_tol: stop when two successive grids' ε differ by less than this fraction.
    next_grid: (grid, ε at it) -> the next, finer grid.
    coarsest_compared: ε -> the coarsest grid whose comparison may end the search (None:
      any); keeps a coarse first grid from ending it by a chance agreement.
    max_grids: evaluate at most this many grids (2: the first and one jump, a cheap bound
      for searches that check their answer with the full rule).

  Returns:
    `Refined`, with the minimum over every grid evaluated.
  """
  first = evaluate(start)
  if first is None:
    raise ValueError(f'no PLD at the first grid {start:g}.')
  tried = [(start, first[0])]
  best_eps, best_grid, best_value = first[0], start, first[1]
  grid, eps, converged = start, first[0], False
  while len(tried) < max_grids and not (eps == 0 and math.isfinite(eps)):
    finer = next_grid(grid, eps)
    result = evaluate(finer)
    if result is None:
      break
    tried.append((finer, result[0]))
    if result[0] < best_eps or math.isinf(best_eps):
      best_eps, best_grid, best_value = result[0], finer, result[1]
    trusted = coarsest_compared is None or grid <= coarsest_compared(result[0])
    if trusted and moved_less_than(eps, result[0], rel_tol):
      converged = True
      break
    grid, eps = finer, result[0]
  return Refined(float(best_eps), best_grid, best_value, tuple(tried), converged)


def trusted_ladder_grid(epsilon: float) -> float:
  """`coarsest_compared` for the ladder: a comparison counts once the coarser grid is at most
  2·SCALE·ε (both grids then resolve ε)."""
  return 2 * SCALE * epsilon if math.isfinite(epsilon) else math.inf
