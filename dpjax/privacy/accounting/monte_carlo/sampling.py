"""Sampling the privacy loss of the balls-and-bins and Poisson pairs: order statistics of
uniforms (Algorithm 6, Rényi representation), one epoch of the pair, importance sampling."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import special

from dpjax.privacy.accounting import max_test
from dpjax.privacy.accounting.monte_carlo.bounds import HockeyStickSums

REMOVE, ADD = 'remove', 'add'
# 'auto' samples every coordinate (exact L) up to this many steps, order statistics above: the
# block bounds cost little accuracy at large T but are visibly pessimistic when ε is small.
AUTO_EXACT_MAX_STEPS = 1000
# float64 elements per per-chunk array (bounds memory at a few tens of MB).
CHUNK_ELEMENTS = 1 << 20
# Samples per chunk, the unit of one random stream and of one parallel task (see the package
# docstring); fixed, so the samples do not depend on the number of workers.
SAMPLES_PER_CHUNK = 1 << 13
# Below this log(E·Pr(A_1)) we skip sampling and use the trivial bound δ ≤ E·Pr(A_1) (< 1e-260).
LOG_SCALE_TRIVIAL = -600.0


def order_statistic_ranks(
  n: int, num_exact_ranks: int = 100, rank_growth: float = 1.05
) -> np.ndarray:
  """Default ranks: 1, …, num_exact_ranks, then ×rank_growth (rounded up) until n, n included."""
  ranks = list(range(1, min(n, num_exact_ranks) + 1))
  k = ranks[-1]
  while k < n:
    k = min(n, max(k + 1, math.ceil(k * rank_growth)))
    ranks.append(k)
  return np.asarray(ranks, dtype=np.int64)


def log_top_uniform(rng, n, size, log_min=None):
  """log of the max of n i.i.d. U(0,1), optionally conditioned on max ≥ exp(log_min).

  max^n is uniform on (e^{n·log_min}, 1): max^n = V + e^{a}(1 − V), V = e^{−Exp(1)}, a = n·log_min.
  """
  e = rng.standard_exponential(size)
  if log_min is None:
    return -e / n
  a = n * np.asarray(log_min, dtype=np.float64)
  with np.errstate(divide='ignore', invalid='ignore'):
    one_minus_v = -np.expm1(-e)
    # a ≥ −1: log1p(−(1 − V)(1 − e^a)) keeps max^n ≈ 1 exact; otherwise the log-sum form.
    near_one = np.log1p(-one_minus_v * -np.expm1(np.minimum(a, 0.0)))
    general = np.logaddexp(-e, a + np.log(one_minus_v))
  return np.where(a >= -1, near_one, general) / n


def _gamma(rng, shapes, size):
  """Independent Gamma(shapes[j]) columns; Exp(1) where the shape is 1 (faster, same law)."""
  out = np.empty((size, len(shapes)))
  unit = shapes == 1
  out[:, unit] = rng.standard_exponential((size, int(unit.sum())))
  if not unit.all():
    out[:, ~unit] = rng.standard_gamma(shapes[~unit].astype(np.float64), (size, int((~unit).sum())))
  return out


def log_uniform_order_statistics(rng, n, ranks, size, log_top_min=None) -> np.ndarray:
  """log U_(k) for the k-th largest of n i.i.d. U(0,1), k ∈ ranks (ranks[0] = 1), jointly.

  The top one is drawn by inversion (optionally conditioned on U_(1) ≥ exp(log_top_min),
  Appendix B.3); given U_(1) = u the other n − 1 are i.i.d. U(0, u) (Proposition B.4), whose
  order statistics are u·(1 − Γ_j/Γ_n) with Γ partial sums of Exp(1) (Rényi).
  Returns shape [size, len(ranks)], non-increasing along the last axis.
  """
  out = np.empty((size, len(ranks)))
  out[:, 0] = log_top_uniform(rng, n, size, log_top_min)
  if len(ranks) > 1:
    sub = ranks[1:] - 1  # ranks among the remaining n − 1 (1-based)
    increments = _gamma(rng, np.diff(np.concatenate([[0], sub])), size)  # Γ_{s_i} − Γ_{s_{i−1}}
    tail = rng.standard_gamma(float(n - sub[-1]), size)  # Γ_n − Γ_{s_m}, shape ≥ 1
    head = np.cumsum(increments, axis=1)  # Γ_{s_i}
    after = np.zeros_like(head)  # Σ_{j>i} increments_j, summed from the right (no cancellation)
    after[:, :-1] = np.cumsum(increments[:, :0:-1], axis=1)[:, ::-1]
    after += tail[:, None]
    total = head[:, -1] + tail
    complement = head / total[:, None]  # 1 − U'
    with np.errstate(divide='ignore'):
      log_rest = np.where(complement < 0.5, np.log1p(-complement), np.log(after / total[:, None]))
    out[:, 1:] = out[:, :1] + log_rest
  return out


def _upper_block_weights(ranks, n):
  """S ≤ Σ_i (k_{i+1} − k_i) e^{x_(k_i)/σ²}, k_{m+1} = n + 1."""
  return np.diff(np.concatenate([ranks, [n + 1]])).astype(np.float64)


def _lower_block_weights(ranks):
  """S ≥ e^{x_(k_1)/σ²} + Σ_{i≥2} (k_i − k_{i−1}) e^{x_(k_i)/σ²}."""
  return np.concatenate([[1], np.diff(ranks)]).astype(np.float64)


def _log_weighted_sum_exp(values, log_weights):
  """log Σ_j w_j e^{values_j} along axis 1 (values may be −inf)."""
  terms = values + log_weights
  shift = np.max(terms, axis=1, keepdims=True)
  return shift[:, 0] + np.log(np.sum(np.exp(terms - shift), axis=1))


# ---------------------------------------------------------------------------------------------
# One epoch of the balls-and-bins pair
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Epoch:
  """Sampling configuration for one epoch of one direction."""

  direction: str
  sigma: float
  num_steps: int
  ranks: np.ndarray | None  # None: sample all T coordinates directly
  threshold: float | None = None  # importance event level C (None: unconditioned)

  def sample(self, rng, size) -> tuple[np.ndarray, np.ndarray]:
    """(L or its pessimistic bound, max_t x_t) for `size` independent samples."""
    if self.direction == REMOVE:
      return self._remove(rng, size)
    return self._add(rng, size)

  def _loss(self, log_sum):
    """L = log S − log T − 1/(2σ²) from log S, S = Σ_t e^{x_t/σ²}."""
    return log_sum - math.log(self.num_steps) - 0.5 / self.sigma**2

  def _first_coordinate_and_top(self, rng, size):
    """x_1 ~ N(1, σ²) and the conditioning of the others' maximum (Alg. 10, grouped).

    Under A = {max_t x_t ≥ C}: case 1 (x_1 ≥ C, others free) has probability
    (1 − F_1)/Pr(A); otherwise x_1 < C and the other T − 1 have max ≥ C.
    """
    sigma = self.sigma
    if self.threshold is None:
      return 1 + sigma * rng.standard_normal(size), None
    c = self.threshold
    log_f1, log_s1 = special.log_ndtr((c - 1) / sigma), special.log_ndtr((1 - c) / sigma)
    log_f0 = special.log_ndtr(c / sigma)
    log_pr_event = _log_event_probability(REMOVE, sigma, self.num_steps, c)
    case1 = -rng.standard_exponential(size) < log_s1 - log_pr_event
    if log_f0 == 0.0:  # Φ̄(C/σ) < 1e-308 while Pr(A) > 1e-260: case 2 has probability < 1e-40
      case1[:] = True
    e = rng.standard_exponential(size)
    x1 = np.where(
      case1, 1 - sigma * special.ndtri_exp(log_s1 - e), 1 + sigma * special.ndtri_exp(log_f1 - e)
    )
    log_top_min = np.where(case1, -np.inf, log_f0)
    return x1, log_top_min

  def _remove(self, rng, size):
    sigma, n = self.sigma, self.num_steps - 1
    x1, log_top_min = self._first_coordinate_and_top(rng, size)
    if n == 0:
      return self._loss(x1 / sigma**2), x1
    if self.ranks is None:
      if log_top_min is None:
        others = sigma * rng.standard_normal((size, n))
      else:  # max first (conditioned), then the rest i.i.d. below it: the same law as Alg. 10
        log_top = log_top_uniform(rng, n, size, log_top_min)
        log_u = np.concatenate(
          [log_top[:, None], log_top[:, None] - rng.standard_exponential((size, n - 1))], axis=1
        )
        others = sigma * special.ndtri_exp(log_u)
      log_sum = np.logaddexp(x1 / sigma**2, special.logsumexp(others / sigma**2, axis=1))
      return self._loss(log_sum), np.maximum(x1, others.max(axis=1))
    others = sigma * special.ndtri_exp(
      log_uniform_order_statistics(rng, n, self.ranks, size, log_top_min)
    )
    log_sum_others = _log_weighted_sum_exp(
      others / sigma**2, np.log(_upper_block_weights(self.ranks, n))
    )
    return self._loss(np.logaddexp(x1 / sigma**2, log_sum_others)), np.maximum(x1, others[:, 0])

  def _add(self, rng, size):
    sigma, n = self.sigma, self.num_steps
    # Conditioning on max < C: i.i.d. normals truncated to (−∞, C), i.e. U scaled by Φ(C/σ).
    log_scale = 0.0 if self.threshold is None else special.log_ndtr(self.threshold / sigma)
    if self.ranks is None:
      if self.threshold is None:
        x = sigma * rng.standard_normal((size, n))
      else:
        x = sigma * special.ndtri_exp(log_scale - rng.standard_exponential((size, n)))
      return self._loss(special.logsumexp(x / sigma**2, axis=1)), x.max(axis=1)
    x = sigma * special.ndtri_exp(
      log_scale + log_uniform_order_statistics(rng, n, self.ranks, size)
    )
    log_sum = _log_weighted_sum_exp(x / sigma**2, np.log(_lower_block_weights(self.ranks)))
    return self._loss(log_sum), x[:, 0]


def _event_threshold(direction, sigma, num_steps, num_epochs, conditioning_epsilon) -> float:
  """C₁ (P‖Q: max ≥ C₁) or C₂ (Q‖P: max < C₂) at level ε_c / E."""
  level = conditioning_epsilon / num_epochs
  if direction == REMOVE:
    return sigma**2 * level + 0.5
  return sigma**2 * (math.log(num_steps) - level) + 0.5


def _log_event_probability(direction, sigma, num_steps, threshold) -> float:
  """log Pr(A_1) for one epoch: log Pr_P(max ≥ C₁) or log Pr_Q(max < C₂), in log-space.

  These are the max-test laws P', Q' of `max_test` (no underflow for tiny probabilities).
  """
  p_law, q_law = max_test.balls_and_bins_max_pair(sigma, num_steps)
  if direction == REMOVE:
    return float(p_law.log_sf(threshold))
  return float(q_law.log_cdf(threshold))


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one direction is sampled: per-epoch samplers, event and scale."""

  direction: str
  sigma: float
  num_steps: int
  num_epochs: int
  ranks: np.ndarray | None
  threshold: float | None
  log_scale: float

  @property
  def method(self) -> str:
    base = 'order_statistics' if self.ranks is not None else 'naive'
    if self.threshold is None:
      return base
    return 'importance' if base == 'naive' else 'importance_order_statistics'

  def chunk_size(self) -> int:
    """Samples per chunk: SAMPLES_PER_CHUNK, fewer when one sample is wide (memory)."""
    width = self.num_steps if self.ranks is None else len(self.ranks)
    return max(1, min(SAMPLES_PER_CHUNK, CHUNK_ELEMENTS // max(1, width)))

  def sample(self, rng, size) -> tuple[np.ndarray, np.ndarray]:
    """(L_total or its pessimistic bound, weight 1/N) for `size` samples."""
    total = np.zeros(size)
    count = np.ones(size)
    for epoch in range(self.num_epochs):
      conditioned = self.threshold is not None and epoch == 0
      sampler = _Epoch(
        self.direction,
        self.sigma,
        self.num_steps,
        self.ranks,
        self.threshold if conditioned else None,
      )
      loss, top = sampler.sample(rng, size)
      total += loss
      if self.threshold is not None and epoch > 0:
        count += (top >= self.threshold) if self.direction == REMOVE else (top < self.threshold)
    return total, 1.0 / count


def make_plan(
  direction,
  sigma,
  num_steps,
  num_epochs,
  method,
  conditioning_epsilon,
  num_exact_ranks,
  rank_growth,
) -> Plan:
  """The Plan of one direction: ranks, importance event and scale ('auto': package docstring)."""
  use_os = method in ('auto', 'order_statistics', 'importance_order_statistics')
  n = num_steps - 1 if direction == REMOVE else num_steps
  ranks = order_statistic_ranks(n, num_exact_ranks, rank_growth) if use_os and n > 0 else None
  if method == 'auto' and ranks is not None and (len(ranks) == n or n <= AUTO_EXACT_MAX_STEPS):
    ranks = None  # exact L, no block bias
  threshold, log_scale = None, 0.0
  if method in ('auto', 'importance', 'importance_order_statistics'):
    c = _event_threshold(direction, sigma, num_steps, num_epochs, conditioning_epsilon)
    log_scale_c = math.log(num_epochs) + _log_event_probability(direction, sigma, num_steps, c)
    if method != 'auto' or log_scale_c <= math.log(0.5):
      threshold, log_scale = c, log_scale_c
  return Plan(direction, float(sigma), int(num_steps), int(num_epochs), ranks, threshold, log_scale)


def hockey_stick_terms(direction, loss, weight, epsilons):
  """f_i(ε_j) = w_i (1 − e^{ε_j ∓ L_i})₊, shape [samples, k]."""
  sign = -1.0 if direction == REMOVE else 1.0
  with np.errstate(over='ignore', invalid='ignore'):
    f = np.maximum(-np.expm1(epsilons[None, :] + sign * loss[:, None]), 0.0)
  return f * weight[:, None]


def trivial_sums(plan: Plan, epsilons, num_samples) -> HockeyStickSums | None:
  """δ ≤ E·Pr(A_1) needs no samples: mean f := 1 when E·Pr(A_1) < e^{-600}."""
  if plan.log_scale >= LOG_SCALE_TRIVIAL:
    return None
  return HockeyStickSums(
    epsilons,
    np.full_like(epsilons, float(num_samples)),
    num_samples,
    np.full_like(epsilons, plan.log_scale),
  )


def hockey_stick_sum(direction, loss, weight, epsilons) -> np.ndarray:
  """Σ_i f_i(ε_j) over the given samples, in row blocks of bounded memory."""
  rows = max(1, CHUNK_ELEMENTS // len(epsilons))
  total = np.zeros_like(epsilons)
  for start in range(0, len(loss), rows):
    total += hockey_stick_terms(
      direction, loss[start : start + rows], weight[start : start + rows], epsilons
    ).sum(axis=0)
  return total


def poisson_loss(x, sigma, q):
  """L = Σ_t log(1 − q + q e^{(2x_t − 1)/(2σ²)})."""
  with np.errstate(divide='ignore'):
    log_1mq = math.log1p(-q) if q < 1 else -math.inf
  return np.sum(np.logaddexp(log_1mq, math.log(q) + (2 * x - 1) / (2 * sigma**2)), axis=1)
