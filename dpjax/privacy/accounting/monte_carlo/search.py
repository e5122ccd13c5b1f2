"""ε at a target δ from Monte-Carlo samples: sample counts, the conditioning level, the search."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
from scipy import optimize
from scipy import special

from dpjax.privacy import checks
from dpjax.privacy.accounting import max_test
from dpjax.privacy.accounting import monotone
from dpjax.privacy.accounting.monte_carlo import parallel
from dpjax.privacy.accounting.monte_carlo.bounds import HockeyStickSums
from dpjax.privacy.accounting.monte_carlo.bounds import kl_upper_confidence_bound
from dpjax.privacy.accounting.monte_carlo.parallel import default_workers
from dpjax.privacy.accounting.monte_carlo.parallel import chunk_tasks
from dpjax.privacy.accounting.monte_carlo.parallel import sample_chunk
from dpjax.privacy.accounting.monte_carlo.sampling import ADD
from dpjax.privacy.accounting.monte_carlo.sampling import AUTO_EXACT_MAX_STEPS
from dpjax.privacy.accounting.monte_carlo.sampling import Plan
from dpjax.privacy.accounting.monte_carlo.sampling import REMOVE
from dpjax.privacy.accounting.monte_carlo.sampling import hockey_stick_sum
from dpjax.privacy.accounting.monte_carlo.sampling import make_plan
from dpjax.privacy.accounting.monte_carlo.sampling import order_statistic_ranks
from dpjax.privacy.accounting.monte_carlo.sampling import trivial_sums
from dpjax.privacy.accounting.monte_carlo.validation import Method
from dpjax.privacy.accounting.monte_carlo.validation import Seed
from dpjax.privacy.accounting.monte_carlo.validation import check_common
from dpjax.privacy.accounting.monte_carlo.validation import check_method
from dpjax.privacy.accounting.monte_carlo.validation import check_ranks
from dpjax.privacy.accounting.monte_carlo.validation import check_seed
from dpjax.privacy.accounting.monte_carlo.validation import check_workers

# Importance sampling conditions at this fraction of the max-test lower bound on ε(δ).
CONDITIONING_FRACTION = 0.9
# Default sample count: this many times the least count for which an estimate exists at δ, β.
SAMPLES_PER_FLOOR = 10
MIN_SAMPLES = 10_000
# Wall time per sampled coordinate, one core (`estimated_seconds`; scripts/bench_accounting.py).
SECONDS_PER_COORDINATE = 6e-8


@dataclasses.dataclass(frozen=True)
class MonteCarloResult:
  """ε from the Monte-Carlo accountant.

  Attributes:
    epsilon: smallest ε found with δ⁺(ε) ≤ delta: an upper bound on ε(δ) with probability
      ≥ confidence over the sampling (a *high-probability* upper bound).
    epsilon_point: ε where the point estimate p̂(ε) = delta (not a guarantee). With importance
      sampling it is ≥ conditioning_epsilon, 0.9 × the max-test lower bound.
    delta: the target δ.
    confidence: 1 − β.
    num_samples: m per direction.
    method: the sampler used in each direction.
    seed: the sampler seed.
    conditioning_epsilon: ε_c of the importance event (0.9 × the max-test lower bound), or None.
    seconds: wall time of the estimate.
  """

  epsilon: float
  epsilon_point: float
  delta: float
  confidence: float
  num_samples: int
  method: str
  seed: Seed
  conditioning_epsilon: float | None = None
  seconds: float | None = dataclasses.field(default=None, compare=False)


def gaussian_epsilon(sigma: float, delta: float) -> float:
  """ε(δ) of the Gaussian mechanism, sensitivity 1, noise σ (for a bisection bracket only)."""

  def excess(eps):
    return (
      special.ndtr(-eps * sigma + 0.5 / sigma)
      - math.exp(eps) * special.ndtr(-eps * sigma - 0.5 / sigma)
      - delta
    )

  if excess(0.0) <= 0:
    return 0.0
  hi = 1.0
  while excess(hi) > 0:
    hi *= 2
  return optimize.brentq(excess, 0.0, hi)


class _LossSamples:
  """Stored per-direction samples, per chunk; δ estimates at any ε from one sample set.

  Sums are taken per chunk and added in chunk order, exactly as `balls_and_bins_sums` does, so
  both give the same bits for the same seed.
  """

  def __init__(self, plan: Plan, num_samples: int, chunks: list[tuple[np.ndarray, np.ndarray]]):
    self.plan, self.num_samples, self.chunks = plan, num_samples, chunks

  def sums(self, epsilon: float) -> HockeyStickSums:
    eps = np.asarray([epsilon], dtype=np.float64)
    trivial = trivial_sums(self.plan, eps, self.num_samples)
    if trivial is not None:
      return trivial
    sum_f = np.zeros(1)
    for loss, weight in self.chunks:
      sum_f += hockey_stick_sum(self.plan.direction, loss, weight, eps)
    return HockeyStickSums(eps, sum_f, self.num_samples, np.full(1, self.plan.log_scale))


def _smallest_epsilon(value_at, delta, lo, start_hi) -> float:
  """Smallest ε ≥ lo (to 1e-9 relative) with value_at(ε) ≤ delta, value non-increasing."""
  if value_at(lo) <= delta:
    return lo
  hi = max(start_hi, lo + 1.0)
  for _ in range(200):
    if value_at(hi) <= delta:
      break
    lo, hi = hi, 2 * hi
  else:
    raise RuntimeError('No epsilon found with the estimate below delta.')
  return monotone.smallest_passing(lambda eps: value_at(eps) <= delta, lo, hi, 1e-9 * max(1.0, hi))


def _conditioning_level(sigma, num_steps, delta, num_epochs, method) -> float:
  """ε_c of the importance event: CONDITIONING_FRACTION × the max-test lower bound on ε(δ).

  Below the provable lower bound, so neither the bound nor the point estimate is ever held at
  the max-test value (the conditioned samples estimate δ(ε) only for ε ≥ ε_c).
  """
  if method not in ('auto', 'importance', 'importance_order_statistics'):
    return 0.0
  return CONDITIONING_FRACTION * max_test.balls_and_bins_lower_bound_epsilon(
    sigma, num_steps, delta, num_epochs=num_epochs
  )


def default_num_samples(
  sigma: float,
  num_steps: int,
  delta: float,
  beta: float = 1e-3,
  *,
  num_epochs: int = 1,
  method: Method = 'auto',
) -> int:
  """m per direction from δ and β: SAMPLES_PER_FLOOR × the least m for which an ε exists.

  With no positive sample the Chernoff bound of a direction is s·(1 − (β/2)^{1/m}) ≈
  s·log(2/β)/m (s = E·Pr(A), the importance scale, 1 without it), which must be < δ; m =
  10·s·log(2/β)/δ leaves δ/10 for that floor, so δ⁺(ε) ≤ δ is met near the true ε (Chua et al.
  2025, §5: m ≳ several/δ). At least MIN_SAMPLES.
  """
  check_common(sigma, num_steps, num_epochs, 1, beta)
  level = _conditioning_level(sigma, num_steps, delta, num_epochs, method)
  scale = max(
    math.exp(make_plan(direction, sigma, num_steps, num_epochs, method, level, 100, 1.05).log_scale)
    for direction in (REMOVE, ADD)
  )
  return max(MIN_SAMPLES, math.ceil(SAMPLES_PER_FLOOR * scale * math.log(2 / beta) / delta))


def estimated_seconds(
  num_samples: int, num_steps: int, num_epochs: int = 1, workers: int = 1
) -> float:
  """Rough wall time of `balls_and_bins_epsilon` ('auto'): m × width × E × 2 directions."""
  width = num_steps if num_steps <= AUTO_EXACT_MAX_STEPS else len(order_statistic_ranks(num_steps))
  return SECONDS_PER_COORDINATE * num_samples * width * num_epochs * 2 / max(1, workers)


def _check_enough_samples(plans, num_samples, delta, beta, sigma, num_steps, num_epochs):
  """ValueError when even no positive sample leaves a direction's upper confidence bound on δ
  (the Chernoff-Hoeffding KL bound at β/2, times the plan's importance scale) at or above δ."""
  floor = kl_upper_confidence_bound(0.0, num_samples, beta / 2)[0]
  for plan in plans:
    if math.exp(plan.log_scale) * floor >= delta:
      raise ValueError(
        f'num_samples = {num_samples} is too small for delta = {delta} at beta = {beta}: even '
        f'with no positive sample the {plan.direction} upper confidence bound is '
        f'{math.exp(plan.log_scale) * floor:.3g}; need num_samples > '
        f'{math.ceil(math.exp(plan.log_scale) * math.log(2 / beta) / delta)} (default: '
        f'{default_num_samples(sigma, num_steps, delta, beta, num_epochs=num_epochs)}).'
      )


def balls_and_bins_epsilon(
  sigma: float,
  num_steps: int,
  delta: float,
  *,
  num_epochs: int = 1,
  num_samples: int | None = None,
  beta: float = 1e-3,
  method: Method = 'auto',
  seed: Seed = 0,
  num_exact_ranks: int = 100,
  rank_growth: float = 1.05,
  workers: int | None = None,
) -> MonteCarloResult:
  """High-probability upper bound on ε(δ) of balls-and-bins DP-SGD (Algorithms 4-6, 11).

    One sample set per direction; ε is found by bisection on the monotone δ⁺(ε). Importance
    sampling conditions once at ε_c = CONDITIONING_FRACTION × the max-test lower bound on ε(δ)
    (`max_test`), below every ε the bisection returns, so one conditioned sample set serves them
    all. `workers` processes (None: the available cores, as many as the work pays to start,
  `parallel.default_workers`) draw the chunks, the bisection runs here
    on the stored losses; the result does not depend on `workers`. num_samples None:
    `default_num_samples(σ, T, δ, β)`.

    Raises:
      ValueError: bad arguments, or num_samples too small for delta (even p̂ = 0 leaves δ⁺ > δ).
  """
  checks.check_delta(delta)
  if num_samples is None:
    num_samples = default_num_samples(
      sigma, num_steps, delta, beta, num_epochs=num_epochs, method=method
    )
  check_common(sigma, num_steps, num_epochs, num_samples, beta)
  check_method(method)
  check_ranks(num_exact_ranks, rank_growth)
  check_seed(seed)
  if workers is None:
    workers = default_workers(estimated_seconds(num_samples, num_steps, num_epochs))
  check_workers(workers)
  started = time.monotonic()
  conditioning = _conditioning_level(sigma, num_steps, delta, num_epochs, method)
  plans = [
    make_plan(
      direction, sigma, num_steps, num_epochs, method, conditioning, num_exact_ranks, rank_growth
    )
    for direction in (REMOVE, ADD)
  ]
  _check_enough_samples(plans, num_samples, delta, beta, sigma, num_steps, num_epochs)
  tasks = [chunk_tasks(plan, seed, (d, 0), num_samples) for d, plan in enumerate(plans)]
  chunks = parallel.run(sample_chunk, tasks[0] + tasks[1], workers)
  samples = [
    _LossSamples(plans[0], num_samples, chunks[: len(tasks[0])]),
    _LossSamples(plans[1], num_samples, chunks[len(tasks[0]) :]),
  ]

  def ucb(eps):
    return max(s.sums(eps).upper_confidence_bound(beta / 2)[0] for s in samples)

  def point(eps):
    return max(s.sums(eps).point_estimate()[0] for s in samples)

  start = gaussian_epsilon(sigma / math.sqrt(num_epochs), delta)
  used_importance = any(plan.threshold is not None for plan in plans)
  lo = conditioning if used_importance else 0.0
  methods = {plan.direction: plan.method for plan in plans}
  epsilon = _smallest_epsilon(ucb, delta, lo, start)
  epsilon_point = _smallest_epsilon(point, delta, lo, start)
  return MonteCarloResult(
    epsilon=epsilon,
    epsilon_point=epsilon_point,
    delta=float(delta),
    confidence=1 - beta,
    num_samples=num_samples,
    method=f'{method}(P‖Q: {methods[REMOVE]}, Q‖P: {methods[ADD]})',
    seed=seed,
    conditioning_epsilon=conditioning if used_importance else None,
    seconds=time.monotonic() - started,
  )
