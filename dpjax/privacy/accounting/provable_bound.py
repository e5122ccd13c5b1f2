"""The provable ε attached to a balls-and-bins run: random allocation, else deterministic.

The dominating one-epoch random-allocation PLD (Feldman & Shenfeld 2025, "Privacy
amplification by random allocation"; `balls_and_bins.random_allocation_epoch_pld`),
composed over the E epochs, and never above the deterministic-order bound
(`balls_and_bins.deterministic_epsilon`), which is attached instead when the PLD is not built
within its time budget (docs/accounting.md §2). With a truncation at B, τ = T·Pr[n_t > B]
is paid at the answer's own ε: the smallest ε with δ_PLD(ε) + (1 + e^ε)·τ ≤ δ (Chua et al.
2024b, "Scalable DP-SGD: Shuffling vs. Poisson Subsampling").
"""

from __future__ import annotations

import dataclasses
import math

from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import pld_grid
from dpjax.privacy.accounting import random_allocation as random_allocation_lib

# Refining the random-allocation grid (`pld_grid`, by halving) is opt-in: its rounding falls
# only linearly with the grid (≈ 0.3·E·grid) while each halving costs 3-6× the build
# (scripts/README.md), so moving ε by < 0.1 % takes ~5 halvings, 100-1000× the first build.
# `provable_epsilon(refine_seconds=...)` allows a budget; a halving is tried only when
# REFINE_COST_FACTOR × the last build's recorded seconds fits in what is left of it.
RANDOM_ALLOCATION_REFINE_SECONDS = 0.0
REFINE_COST_FACTOR = 6.0


@dataclasses.dataclass(frozen=True)
class ProvableBound:
  """The provable ε attached to a balls-and-bins run, and what it came from.

  Attributes:
    epsilon: min(random-allocation upper, deterministic); a provable upper bound.
    method: 'random_allocation_pld ...' or 'deterministic ...' (with why, on a fallback).
    deterministic_epsilon: the always-valid fallback (with the truncation penalty).
    random_allocation_upper: random-allocation PLD upper bound, or None if not run.
    random_allocation_lower: random-allocation PLD lower bound (the tight pair's ε
      is at least this), or None.
    delta0: δ spent on the untruncated mechanism (δ minus the truncation penalty).
    discretization: the loss grid of the one-epoch PLD, or None.
  """

  epsilon: float
  method: str
  deterministic_epsilon: float
  random_allocation_upper: float | None
  random_allocation_lower: float | None
  delta0: float
  discretization: float | None = None


def provable_epsilon(
  noise_multiplier: float,
  num_steps: int,
  delta: float,
  *,
  num_epochs: int = 1,
  group_size: int = 1,
  log_penalty_mass: float = -math.inf,
  random_allocation: bool | None = None,
  timeout: float | None = balls_and_bins.RANDOM_ALLOCATION_TIMEOUT,
  lower: bool = False,
  refine_seconds: float = RANDOM_ALLOCATION_REFINE_SECONDS,
) -> ProvableBound:
  """Provable ε(δ) of E epochs of balls-and-bins with T steps each.

  The dominating one-epoch random-allocation PLD (grid from σ, T, δ, E:
  `random_allocation.epochs_discretization`; if it is not built within the budget, the
  one-epoch grid is tried), composed E times; with
  a truncation penalty τ, the smallest ε with δ_PLD(ε) + (1 + e^ε)·τ ≤ δ. Never above the
  deterministic bound, which is attached instead when the PLD is not built within `timeout`.

  Args:
    noise_multiplier: σ.
    num_steps: T, bins (steps) per epoch.
    delta: the target δ (the total, truncation penalty included).
    num_epochs: E, epochs started so far.
    group_size: k. Random allocation covers k = 1 only; k > 1 uses the
      deterministic bound with sensitivity k.
    log_penalty_mass: log τ of the truncation penalty (−inf: no truncation).
    random_allocation: None (default): attempt it within `timeout` seconds; True: no time
      limit; False: skip it (deterministic bound).
    timeout: seconds allowed to each new one-epoch PLD build under the default policy.
    lower: also the random-allocation lower bound (a dominated PLD at twice the one-epoch
      grid; without truncation only).
    refine_seconds: seconds allowed to refining the grid by halving (`_refined_upper`);
      0 (the default): the grid above, unrefined.
  """
  tau = math.exp(log_penalty_mass)
  det = balls_and_bins.deterministic_epsilon(
    noise_multiplier, num_epochs, delta, group_size=group_size, penalty_mass=tau
  )
  # The deterministic bound's δ₀ = δ − (1 + e^{ε_det})·τ (independent of the answer).
  delta0 = delta - (1.0 + math.exp(det)) * tau if math.isfinite(det) else 0.0
  if group_size != 1 or random_allocation is False:
    why = 'group_size > 1' if group_size != 1 else 'random_allocation=False'
    return ProvableBound(det, f'deterministic ({why})', det, None, None, delta0)
  budget = None if random_allocation else timeout
  coarse = random_allocation_lib.default_discretization(noise_multiplier, num_steps, delta)
  tail = random_allocation_lib.default_tail_truncation(delta)
  pld, grid, note = _epoch_pld(noise_multiplier, num_steps, delta, num_epochs, coarse, tail, budget)
  if pld is None:
    why = (
      f'deterministic FALLBACK: the random-allocation PLD did not finish within the '
      f'time budget of {budget} s (raise it: config privacy.random_allocation_timeout, '
      f'Accountant(random_allocation_timeout=...) or python -m dpjax.account '
      f'--random-allocation-timeout SECONDS)'
    )
    return ProvableBound(det, why, det, None, None, delta0, grid)
  refined = _refined_upper(
    noise_multiplier, num_steps, num_epochs, delta, tau, tail, grid, pld, refine_seconds, budget
  )
  upper, grid = refined.epsilon, refined.grid
  method = (
    'random_allocation_pld (one-epoch dominating PLD'
    + (', composed E times' if num_epochs > 1 else '')
    + note
    + ')'
  )
  spent = delta
  if tau > 0:
    method += ' + tv_truncation_penalty at its own ε'
    spent = delta - (1.0 + math.exp(upper)) * tau if math.isfinite(upper) else 0.0
  low = None
  if lower and tau == 0:  # a side number: on the cheap one-epoch grid, doubled
    low = _lower(noise_multiplier, num_steps, delta, num_epochs, 2 * coarse, tail, budget)
  if upper < det:
    return ProvableBound(upper, method, det, upper, low, spent, grid)
  return ProvableBound(
    det, 'deterministic (below the random-allocation bound here)', det, upper, low, delta0, grid
  )


def _epoch_pld(sigma, steps, delta, epochs, coarse: float, tail: float, budget):
  """(the dominating one-epoch PLD or None, its grid, a note): at the grid for E epochs
  (`random_allocation.epochs_discretization`), else, if that misses the budget, at the
  one-epoch grid `coarse` (looser after E epochs, but cheaper)."""
  grid = random_allocation_lib.epochs_discretization(sigma, steps, delta, epochs)
  pld = balls_and_bins.random_allocation_epoch_pld(
    sigma, steps, discretization=grid, tail_truncation=tail, timeout=budget
  )
  note = ''
  if pld is None and grid < coarse:
    grid, note = coarse, '; the finer grid for E epochs missed the time budget'
    pld = balls_and_bins.random_allocation_epoch_pld(
      sigma, steps, discretization=grid, tail_truncation=tail, timeout=budget
    )
  return pld, grid, note


def _lower(sigma, steps, delta, epochs, grid, tail, budget) -> float | None:
  """The random-allocation lower bound: the dominated one-epoch PLD at `grid`, composed E
  times (the tight pair's ε is at least this), or None when it is not built in time."""
  dominated = balls_and_bins.random_allocation_epoch_pld(
    sigma, steps, discretization=grid, tail_truncation=tail, bound='lower', timeout=budget
  )
  if dominated is None:
    return None
  return float(balls_and_bins.compose_epochs(dominated, epochs).get_epsilon_for_delta(delta))


def _upper(composed, delta: float, tau: float) -> float:
  """ε(δ) of a composed dominating PLD, with the truncation penalty at its own ε if τ > 0."""
  if tau > 0:
    return balls_and_bins.smallest_epsilon(composed.get_delta_for_epsilon, delta, penalty_mass=tau)
  return float(composed.get_epsilon_for_delta(delta))


def _refined_upper(
  sigma: float,
  steps: int,
  epochs: int,
  delta: float,
  tau: float,
  tail: float,
  grid: float,
  pld,
  refine_seconds: float,
  timeout: float | None,
):
  """The upper bound on `pld` (built at `grid`), refined by halving the grid (`pld_grid`:
  the smallest bound kept, each a dominating PLD's) while ε moves by >= 0.1 % and the next
  build, predicted at REFINE_COST_FACTOR × the last one's recorded seconds, fits in what is
  left of `refine_seconds` (it is also killed there)."""
  left = [float(refine_seconds)]

  def evaluate(g):
    built = pld
    if g != grid:
      last = random_allocation_lib.build_seconds(sigma, steps, 2 * g, tail)
      if last is None or REFINE_COST_FACTOR * last > left[0]:
        return None
      limit = left[0] if timeout is None else min(timeout, left[0])
      built = balls_and_bins.random_allocation_epoch_pld(
        sigma, steps, discretization=g, tail_truncation=tail, timeout=limit
      )
      left[0] -= random_allocation_lib.build_seconds(sigma, steps, g, tail) or limit
      if built is None:
        return None
    return _upper(balls_and_bins.compose_epochs(built, epochs), delta, tau), built

  return pld_grid.refine(evaluate, grid, next_grid=pld_grid.halve)
