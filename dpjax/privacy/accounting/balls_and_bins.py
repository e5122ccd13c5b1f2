"""Balls-and-bins bounds: deterministic, random-allocation PLD (and the shared Gaussian /
truncation helpers); `provable_bound` combines them into the ε attached to a run.

Balls-and-bins (Chua et al. 2025, "Balls-and-Bins Sampling for DP-SGD", seed
000) puts every example in one of T batches per epoch, uniformly and
independently: "random allocation" of each example to 1 of T steps.

Three numbers are computed (docs/accounting.md §2):

* Provable upper bound, the ε attached to a run: the smaller of
  - random-allocation PLD (Feldman & Shenfeld 2025, "Privacy amplification by
    random allocation"; package `pld-accounting`): a dominating PLD of one
    epoch (`random_allocation.py`: child process, time budget, disk cache),
    composed E times (epochs use independent assignments), and
  - the deterministic-order bound: each epoch is a mixture over fixed
    assignments, each the Gaussian mechanism with sensitivity k, so by joint
    convexity ε ≤ ε of `GaussianDpEvent(σ/k)` composed E times (seed 000, §3).
  The result is never above the deterministic bound.
* The Monte-Carlo estimate (`monte_carlo/`): a *high-probability* upper
  bound (confidence 1 − β), reported beside the provable one (opt-in).
* The max-test lower bound (`max_test.py`), and the random-allocation lower
  bound (a dominated PLD), reported beside both.

Policy: random-allocation PLD is attempted for every T and E, within a time
budget per new (σ, T, grid) build (RANDOM_ALLOCATION_TIMEOUT = 300 s; the
build serves every E and δ with the same grid and is cached; its cost is in
scripts/README.md, bench_accounting_scaling.py). If the budget is exceeded the
deterministic bound is attached, labelled as a fallback with how to raise
the budget. `random_allocation=True` removes the limit, False skips it.

Truncation to a cap B (any sampler; Chua et al. 2024b, "Scalable DP-SGD:
Shuffling vs. Poisson Subsampling"): coupling the truncated and untruncated
runs on the same randomness, they differ only if some batch was truncated, so
their total variation is at most τ = (#steps)·Pr[n_t > B], and an (ε, δ₀)-DP
untruncated mechanism gives an (ε, δ₀ + (1 + e^ε)·τ)-DP truncated one.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

from dp_accounting.pld import privacy_loss_mechanism
from scipy import stats

from dpjax.privacy import checks
from dpjax.privacy.accounting import monotone
from dpjax.privacy.accounting import pld_self_compose
from dpjax.privacy.accounting import random_allocation as random_allocation_lib
from dpjax.privacy.accounting import sampler_events

# Default policy for random-allocation PLD (see the module docstring).
RANDOM_ALLOCATION_TIMEOUT = random_allocation_lib.RANDOM_ALLOCATION_TIMEOUT
# `random_allocation_epoch_pld`'s default grid and tail mass (experiments/06_truncation).
EPOCH_PLD_DISCRETIZATION = 0.02
EPOCH_PLD_TAIL_TRUNCATION = 1e-8


# ---------------------------------------------------------------------------------------------
# ε from a monotone δ(ε), with and without a truncation penalty
# ---------------------------------------------------------------------------------------------


def smallest_epsilon(
  delta_at: Callable[[float], float],
  delta: float,
  *,
  penalty_mass: float = 0.0,
  rel_tol: float = 1e-9,
) -> float:
  """An ε with δ(ε) + (1 + e^ε)·τ ≤ δ, as small as bisection finds (inf if none).

  `delta_at` must be non-increasing. Doubling brackets the answer below the ε where
  the penalty alone reaches δ; `monotone.smallest_passing` bisects and returns the
  upper end, where the inequality holds, so the answer is always valid (rounded up,
  never down). With τ = 0 it is the smallest such ε to `rel_tol`·max(1, ε).
  """

  def ok(eps):
    penalty = (1.0 + math.exp(eps)) * penalty_mass if penalty_mass > 0 else 0.0
    return delta_at(eps) + penalty <= delta

  if penalty_mass >= delta / 2:
    return math.inf
  if ok(0.0):
    return 0.0
  lo, hi = 0.0, 1.0
  # Beyond max_eps the penalty alone exceeds δ.
  max_eps = math.log(delta / penalty_mass - 1.0) if penalty_mass > 0 else 1e8
  while not ok(hi):
    lo, hi = hi, 2 * hi
    if hi > max_eps:
      if not ok(max_eps):
        return math.inf
      hi = max_eps
      break
  return monotone.smallest_passing(ok, lo, hi, rel_tol * max(1.0, hi))


@functools.lru_cache(maxsize=256, typed=True)
def _gaussian_loss(noise_multiplier: float) -> privacy_loss_mechanism.GaussianPrivacyLoss:
  # Its construction (scipy freezing a distribution, ~10 ms) is most of a δ(ε); its queries
  # keep no state, so one object per σ answers as a new one does.
  return privacy_loss_mechanism.GaussianPrivacyLoss(noise_multiplier, sensitivity=1.0)


def gaussian_delta(noise_multiplier: float, epsilon: float) -> float:
  """δ(ε) of the Gaussian mechanism, sensitivity 1 (dp_accounting's closed form)."""
  try:
    loss = _gaussian_loss(noise_multiplier)
  except TypeError:  # Unhashable (an array): built for this query.
    loss = privacy_loss_mechanism.GaussianPrivacyLoss(noise_multiplier, sensitivity=1.0)
  return float(loss.get_delta_for_epsilon(epsilon))


def deterministic_epsilon(
  noise_multiplier: float,
  num_epochs: int,
  delta: float,
  *,
  group_size: int = 1,
  penalty_mass: float = 0.0,
) -> float:
  """Exact ε of E epochs in a fixed order (`_deterministic_epsilon`), kept per process by its
  exact arguments and their types (a bool is not an int here): shuffle and balls-and-bins
  reports, their calibration brackets and the trainer's ε at each epoch ask again."""
  args = (noise_multiplier, num_epochs, delta, group_size, penalty_mass)
  try:
    hash(args)
  except TypeError:  # Unhashable (an array): computed, not kept.
    return _deterministic_epsilon(*args)
  return _kept_deterministic_epsilon(*args)


def _deterministic_epsilon(
  noise_multiplier: float,
  num_epochs: int,
  delta: float,
  group_size: int,
  penalty_mass: float,
) -> float:
  """Exact ε of E epochs in a fixed order: `GaussianDpEvent(σ/k)` composed E times.

  E Gaussian releases of sensitivity k compose to one of sensitivity k√E, so
  this is the Gaussian mechanism with noise σ/(k√E), solved in closed form
  (Balle & Wang 2018 via dp_accounting) and rounded up. Also the always-valid
  upper bound for shuffle and balls-and-bins.
  """
  sigma = checks.check_noise_multiplier(noise_multiplier)
  epochs = sampler_events.check_positive_int('num_epochs', num_epochs)
  k = sampler_events.check_positive_int('group_size k', group_size)
  checks.check_delta(delta)
  effective = sigma / (k * math.sqrt(epochs))
  return smallest_epsilon(
    lambda eps: gaussian_delta(effective, eps), delta, penalty_mass=penalty_mass
  )


_kept_deterministic_epsilon = functools.lru_cache(maxsize=1024, typed=True)(_deterministic_epsilon)


# ---------------------------------------------------------------------------------------------
# Truncation
# ---------------------------------------------------------------------------------------------


def log_truncation_mass(
  num_examples: int,
  sampling_probability: float,
  max_batch_size: int,
  num_steps: int,
  *,
  group_size: int = 1,
) -> float:
  """log τ, τ = T·Pr[n_t > B] with n_t ~ Binomial(N + k, p): the TV penalty's mass.

  Batch sizes of Poisson (p = q) and balls-and-bins (p = 1/T) are binomial.
  The larger neighbouring dataset (N + k examples) has the larger tail, so it
  bounds both directions. Log-space (scipy.stats.binom.logsf): no underflow
  or overflow at N = 1e7.
  """
  log_sf = float(stats.binom.logsf(max_batch_size, num_examples + group_size, sampling_probability))
  return math.log(num_steps) + log_sf


# ---------------------------------------------------------------------------------------------
# Random-allocation PLD (`random_allocation`): one epoch, composed E times
# ---------------------------------------------------------------------------------------------


def random_allocation_epoch_pld(
  noise_multiplier: float,
  num_steps: int,
  *,
  discretization: float = EPOCH_PLD_DISCRETIZATION,
  tail_truncation: float = EPOCH_PLD_TAIL_TRUNCATION,
  bound: str = 'upper',
  timeout: float | None = RANDOM_ALLOCATION_TIMEOUT,
):
  """A dominating ('upper') or dominated ('lower') PLD of *one* balls-and-bins epoch, or None.

  `random_allocation.epoch_pld` (a cached build in a child process killed after `timeout`
  s; None on timeout). Epochs use independent assignments, so `pld.self_compose(E)` bounds
  E epochs from the same side. The default grid 0.02 is the one experiments/06_truncation
  uses; `provable_epsilon` picks a finer one from σ, T and δ.
  """
  sigma = checks.check_noise_multiplier(noise_multiplier)
  steps = sampler_events.check_positive_int('num_steps T', num_steps)
  return random_allocation_lib.epoch_pld(
    sigma,
    steps,
    discretization=discretization,
    tail_truncation=tail_truncation,
    bound=bound,
    timeout=timeout,
  )


def random_allocation_epsilon_range(
  noise_multiplier: float,
  num_steps: int,
  delta: float,
  *,
  num_epochs: int = 1,
  discretization: float | None = None,
  timeout: float | None = RANDOM_ALLOCATION_TIMEOUT,
) -> tuple[float, float] | None:
  """(upper, lower) ε of E balls-and-bins epochs by random-allocation PLD, or None on timeout.

  Feldman & Shenfeld 2025. `upper` from the dominating one-epoch PLD composed E times (a
  provable upper bound), `lower` from the dominated one at twice the grid (a provable lower
  bound on the ε of the tight pair). Grid: `random_allocation_lib.default_discretization`.
  """
  sigma = checks.check_noise_multiplier(noise_multiplier)
  steps = sampler_events.check_positive_int('num_steps T', num_steps)
  epochs = sampler_events.check_positive_int('num_epochs', num_epochs)
  checks.check_delta(delta)
  grid = discretization or random_allocation_lib.epochs_discretization(sigma, steps, delta, epochs)
  tail = random_allocation_lib.default_tail_truncation(delta)
  values = []
  for bound, scale in (('upper', 1.0), ('lower', 2.0)):
    pld = random_allocation_epoch_pld(
      sigma, steps, discretization=grid * scale, tail_truncation=tail, bound=bound, timeout=timeout
    )
    if pld is None:
      return None
    values.append(float(compose_epochs(pld, epochs).get_epsilon_for_delta(delta)))
  return values[0], values[1]


def compose_epochs(pld, num_epochs: int):
  """The PLD of `num_epochs` epochs from one epoch's (independent assignments per epoch)."""
  return pld_self_compose.self_compose(pld, num_epochs) if num_epochs > 1 else pld
