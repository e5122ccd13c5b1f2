"""Monte-Carlo upper confidence bounds on δ(ε) for balls-and-bins DP-SGD.

Chua et al. 2025, "Balls-and-Bins Sampling for DP-SGD" (AISTATS; seed 000): Algorithm 4
(Monte Carlo + Chernoff–Hoeffding), Algorithm 5 (importance sampling), Algorithm 6
(order-statistics sampling), Appendix B.3 (their combination), Appendix B.4 / Algorithm 11
(multiple epochs). The mathematics is restated in docs/accounting.md §2.

Pair for one epoch of T steps: P = (1/T) Σ_t N(e_t, σ²I_T), Q = N(0, σ²I_T), with privacy loss
L(x) = log((1/T) Σ_t exp((2x_t − 1)/(2σ²))). E epochs: product pair, L_total = Σ_e L(x^(e)).

  δ_{P‖Q}(ε) = E_{x~P}[(1 − e^{ε − L})₊]   ("remove")
  δ_{Q‖P}(ε) = E_{x~Q}[(1 − e^{ε + L})₊]   ("add");   δ(ε) = max of the two.

What is guaranteed. `delta_ucb` and `MonteCarloResult.epsilon` hold with probability ≥ 1 − β
over the sampler's randomness: each direction gets β/2 and a Chernoff–Hoeffding (Bernoulli-KL)
bound on the mean of f ∈ [0, 1]; the union bound covers both. Point estimates are *not*
guarantees. Order statistics replace L by a bound in the pessimistic direction (upper bound
for P‖Q, lower bound for Q‖P), and importance sampling is exact, so both keep the guarantee.
Solving for ε on one sample set is valid because δ⁺(ε) is non-increasing in ε: if the true
ε*(δ) were above the reported ε̂, then δ⁺(ε*) ≤ δ⁺(ε̂) ≤ δ = δ(ε*), i.e. the fixed-ε bound at
ε* failed, which has probability ≤ β.

Importance sampling (Algorithm 5) with one event A per epoch, at a level ε_c ≤ ε:
  P‖Q: A = {max_t x_t ≥ C₁}, C₁ = σ²ε_c/E + 1/2, as L_e ≤ (2 max_t x_t − 1)/(2σ²);
  Q‖P: A = {max_t x_t < C₂}, C₂ = σ²(log T − ε_c/E) + 1/2, as L_e ≥ (2 max_t x_t − 1)/(2σ²) − log T.
For P‖Q, f > 0 ⟹ Σ_e L_e > ε ≥ ε_c ⟹ some L_e > ε_c/E ⟹ some epoch is in A (Q‖P alike with
L_e < −ε_c/E). One epoch (E = 1) this is Algorithm 5 exactly. Several epochs (the paper leaves
this open, Appendix B.4): conditioning epoch 1 on A alone would be wrong, since the epoch that
makes f > 0 can be any. With N = #{e : epoch e in A} (≥ 1 wherever f > 0) and i.i.d. epochs,
E[f] = Σ_e E[f 1_{A_e} / N] = E · Pr(A) · E[f / N | epoch 1 in A]: condition epoch 1 on A, draw
the others unconditioned, and average g = f/N ∈ [0, 1]; the factor E · Pr(A) is `log_scale`.
One conditioned sample set serves every ε ≥ ε_c. `method='auto'` uses it in a direction only
when E · Pr(A) ≤ 1/2 (at E · Pr(A) ≥ 1 it cannot help). Pr(A) is computed in log-space.

Order statistics (Algorithm 6). L depends on x only through S = Σ_t exp(x_t/σ²). For ranks
1 = k_1 < … < k_m of the sorted coordinates we sample x_(k_i) exactly and bound
  S ≤ Σ_i (k_{i+1} − k_i) e^{x_(k_i)/σ²}                  (k_{m+1} = n + 1; docs §2)
  S ≥ e^{x_(k_1)/σ²} + Σ_{i≥2} (k_i − k_{i−1}) e^{x_(k_i)/σ²}
The lower bound credits the k_i − k_{i−1} − 1 unsampled coordinates between two ranks with the
smaller sampled value; it is the docs' bound tightened, and both bounds are exact when every
rank is sampled. The joint law of the uniform order statistics is drawn with the Rényi
representation (k-th smallest of n uniforms = Γ_k/Γ_{n+1}, Γ partial sums of Exp(1)), which is
the same joint law Algorithm 6 builds from its Beta chain, but hands us 1 − U with full relative
precision; normals come from `scipy.special.ndtri_exp` of log U, so the top order statistics of
n = 10⁶ coordinates (U within 1e-6 of 1) lose nothing. Cost O(samples × ranks), independent of T.
The block bounds are pessimistic by roughly the spread of x within a block, which matters when
ε is small: σ = 1, T = 10⁴, δ = 1e-3 gives ε ≈ 0.045 with the default ranks (100 exact, then
×1.05) and ≈ 0.026 with rank_growth = 1.01 (3x the cost). 'auto' therefore samples every
coordinate (exact L) for T ≤ 1000 and uses order statistics above.

Parallel execution (one host). The m samples of a direction are cut into chunks of a fixed
size (`_SAMPLES_PER_CHUNK`, fewer for wide samples); chunk c of conditioning group g of
direction d draws from its own stream `np.random.SeedSequence(seed, spawn_key=(d, g, c))`
(independent streams, NumPy's spawn tree). A chunk yields its Σ_i f_i (or its losses, for the
ε search); chunks are added in chunk order whatever process computed them. With `workers = n`
the calling process and a `concurrent.futures.ProcessPoolExecutor` of n − 1 processes started
with the 'spawn' method (the caller may have initialised JAX, after which fork is unsafe) claim
chunks from the two ends of a shared counter. The samples, the sums and every bound are
therefore a function of the arguments and the seed alone, bit-for-bit the same for any number
of workers. Merging adds counts (Σ f, m); the confidence bound is computed once, from the
merged sums. Each worker first imports dpjax.accounting and dp_accounting (~2.5 s CPU), so
workers pay off for runs of tens of seconds (T ≥ 1e3 or m ≥ 1e5), not for small ones. As with
any 'spawn' pool, a script calling with workers > 1 needs the `if __name__ == '__main__':` guard.

Many machines. `balls_and_bins_sums` returns the sufficient statistics (Σ_i f_i(ε), m,
log_scale) of one seed and direction. Run it on each machine with its own seed, e.g. (seed, j)
for machine j (SeedSequence makes these independent streams) and the same other arguments
(with importance sampling, pass one `conditioning_epsilon` so the conditioning agrees), through
any engine (Ray: `ray.get([ray.remote(balls_and_bins_sums).remote(..., seed=(seed, j)) for j in
range(M)])`; Dask, MPI or a job array alike); merge with `HockeyStickSums.merge` and turn the
merged sums into bounds with `delta_from_sums`. Merge sums, never bounds.
"""

from __future__ import annotations

from concurrent import futures
import dataclasses
import math
import multiprocessing
import os
import time
from typing import Literal, Sequence, Union

import numpy as np
from scipy import optimize
from scipy import special

from dpjax.accounting import max_test

Method = Literal['auto', 'naive', 'importance', 'order_statistics', 'importance_order_statistics']
METHODS = ('auto', 'naive', 'importance', 'order_statistics', 'importance_order_statistics')
Seed = Union[int, Sequence[int]]

# float64 elements per per-chunk array (bounds memory at a few tens of MB).
_CHUNK_ELEMENTS = 1 << 20
# Samples per chunk, the unit of one random stream and of one parallel task (module docstring);
# fixed, so the samples do not depend on the number of workers.
_SAMPLES_PER_CHUNK = 1 << 13
_REMOVE, _ADD = 'remove', 'add'
# 'auto' samples every coordinate (exact L) up to this many steps, order statistics above: the
# block bounds cost little accuracy at large T but are visibly pessimistic when ε is small.
_AUTO_EXACT_MAX_STEPS = 1000
# Importance sampling conditions at this fraction of the max-test lower bound on ε(δ).
CONDITIONING_FRACTION = 0.9
# Default sample count: this many times the least count for which an estimate exists at δ, β.
SAMPLES_PER_FLOOR = 10
MIN_SAMPLES = 10_000
# Wall time per sampled coordinate, one core (`estimated_seconds`; scripts/bench_accounting.py).
SECONDS_PER_COORDINATE = 6e-8
# Below this log(E·Pr(A_1)) we skip sampling and use the trivial bound δ ≤ E·Pr(A_1) (< 1e-260).
_LOG_SCALE_TRIVIAL = -600.0


# ---------------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------------


def _is_number(value) -> bool:
  return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
          and math.isfinite(value))


def _check_int(name, value, minimum):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f'{name} must be an integer >= {minimum}, got {value!r}.')


def _check_common(sigma, num_steps, num_epochs, num_samples, beta):
  if not (_is_number(sigma) and sigma > 0):
    raise ValueError(f'sigma (noise multiplier) must be a finite number > 0, got {sigma!r}.')
  _check_int('num_steps', num_steps, 1)
  _check_int('num_epochs', num_epochs, 1)
  _check_int('num_samples', num_samples, 1)
  if not (_is_number(beta) and 0 < beta < 1):
    raise ValueError(f'beta (failure probability) must be in (0, 1), got {beta!r}.')


def _check_epsilons(epsilons) -> np.ndarray:
  eps = np.atleast_1d(np.asarray(epsilons, dtype=np.float64))
  if eps.ndim != 1 or eps.size == 0 or not np.all(np.isfinite(eps)) or np.any(eps < 0):
    raise ValueError(f'epsilons must be a non-empty 1-d array of finite values >= 0, '
                     f'got {epsilons!r}.')
  return eps


def _check_seed(seed):
  values = [seed] if isinstance(seed, (int, np.integer)) else seed
  try:
    ok = len(values) > 0 and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in values)
  except TypeError:
    ok = False
  if not ok:
    raise ValueError(f'seed must be an integer >= 0 or a sequence of them, got {seed!r}.')


def _check_workers(workers):
  _check_int('workers', workers, 1)


def _check_method(method):
  if method not in METHODS:
    raise ValueError(f'method must be one of {METHODS}, got {method!r}.')


def _check_ranks(num_exact_ranks, rank_growth):
  _check_int('num_exact_ranks', num_exact_ranks, 1)
  if not (_is_number(rank_growth) and rank_growth > 1):
    raise ValueError(f'rank_growth must be a finite number > 1, got {rank_growth!r}.')


# ---------------------------------------------------------------------------------------------
# Chernoff–Hoeffding confidence bounds (Algorithm 4)
# ---------------------------------------------------------------------------------------------


def _bernoulli_kl(mean: float, p: float) -> float:
  """KL(Bernoulli(mean) ‖ Bernoulli(p)), accurate for tiny p."""
  first = special.xlogy(mean, mean) - special.xlogy(mean, p)
  second = 0.0 if mean >= 1 else (1 - mean) * (math.log1p(-mean) - math.log1p(-p))
  return first + second


_RTOL = 1e-12


def kl_upper_confidence_bound(mean, num_samples: int, beta: float) -> np.ndarray:
  """Largest p ∈ [mean, 1] with m · KL(mean ‖ p) ≤ log(1/β).

  For the mean of m i.i.d. variables in [0, 1] with expectation p,
  Pr[mean ≤ p − t] ≤ exp(−m KL(p − t ‖ p)) (Chernoff–Hoeffding), so the returned value is
  ≥ p with probability ≥ 1 − β. The root is rounded up by brentq's tolerance.
  """
  target = math.log(1 / beta) / num_samples
  out = []
  for mu in np.atleast_1d(np.asarray(mean, dtype=np.float64)):
    mu = min(max(float(mu), 0.0), 1.0)
    top = math.nextafter(1.0, 0.0)
    if mu >= 1 or _bernoulli_kl(mu, top) <= target:
      out.append(1.0)
      continue
    root = optimize.brentq(lambda p: _bernoulli_kl(mu, p) - target, mu, top,
                           xtol=1e-300, rtol=_RTOL)
    out.append(min(1.0, root * (1 + 4 * _RTOL) + 1e-300))
  return np.asarray(out)


def kl_lower_confidence_bound(mean, num_samples: int, beta: float) -> np.ndarray:
  """Smallest p ∈ [0, mean] with m · KL(mean ‖ p) ≤ log(1/β) (≤ the truth w.p. ≥ 1 − β)."""
  target = math.log(1 / beta) / num_samples
  out = []
  for mu in np.atleast_1d(np.asarray(mean, dtype=np.float64)):
    mu = min(max(float(mu), 0.0), 1.0)
    bottom = 1e-300
    if mu <= bottom or _bernoulli_kl(mu, bottom) <= target:
      out.append(0.0)
      continue
    top = mu if mu < 1 else math.nextafter(1.0, 0.0)
    root = optimize.brentq(lambda p: _bernoulli_kl(mu, p) - target, bottom, top,
                           xtol=1e-300, rtol=_RTOL)
    out.append(max(0.0, root * (1 - 4 * _RTOL)))
  return np.asarray(out)


@dataclasses.dataclass(frozen=True, eq=False)
class HockeyStickSums:
  """Sufficient statistics of the Monte-Carlo estimate of one hockey-stick divergence.

  δ(ε_j) = exp(log_scale_j) · E[f(ε_j)] is estimated by exp(log_scale_j) · sum_f[j] / m, with
  f ∈ [0, 1] i.i.d. over the m samples. log_scale = 0 for plain sampling and
  log(E · Pr(A_1)) for importance sampling (module docstring).

  Attributes:
    epsilons: the ε grid, shape [k].
    sum_f: Σ_i f_i(ε_j), shape [k].
    num_samples: m.
    log_scale: shape [k].
  """

  epsilons: np.ndarray
  sum_f: np.ndarray
  num_samples: int
  log_scale: np.ndarray

  def merge(self, other: 'HockeyStickSums') -> 'HockeyStickSums':
    """Pools two independent runs of the same estimator (same ε grid and conditioning)."""
    if not (np.array_equal(self.epsilons, other.epsilons)
            and np.array_equal(self.log_scale, other.log_scale)):
      raise ValueError('Can only merge sums with the same epsilons and the same conditioning '
                       '(log_scale); use the same arguments and a different seed.')
    return HockeyStickSums(self.epsilons, self.sum_f + other.sum_f,
                           self.num_samples + other.num_samples, self.log_scale)

  def mean(self) -> np.ndarray:
    return self.sum_f / self.num_samples

  def point_estimate(self) -> np.ndarray:
    return np.minimum(1.0, np.exp(self.log_scale) * self.mean())

  def upper_confidence_bound(self, beta: float) -> np.ndarray:
    """≥ δ(ε_j) with probability ≥ 1 − β, for each ε_j."""
    ucb = kl_upper_confidence_bound(self.mean(), self.num_samples, beta)
    return np.minimum(1.0, np.exp(self.log_scale) * ucb)

  def lower_confidence_bound(self, beta: float) -> np.ndarray:
    """≤ δ(ε_j) with probability ≥ 1 − β, for each ε_j."""
    lcb = kl_lower_confidence_bound(self.mean(), self.num_samples, beta)
    return np.minimum(1.0, np.exp(self.log_scale) * lcb)


def delta_from_sums(remove: HockeyStickSums, add: HockeyStickSums,
                    beta: float) -> tuple[np.ndarray, np.ndarray]:
  """(point estimate, upper confidence bound) of δ(ε) = max(δ_{P‖Q}, δ_{Q‖P}).

  β is split β/2 per direction, so the UCB holds for both with probability ≥ 1 − β.
  """
  if not (_is_number(beta) and 0 < beta < 1):
    raise ValueError(f'beta (failure probability) must be in (0, 1), got {beta!r}.')
  point = np.maximum(remove.point_estimate(), add.point_estimate())
  ucb = np.maximum(remove.upper_confidence_bound(beta / 2), add.upper_confidence_bound(beta / 2))
  return point, ucb


# ---------------------------------------------------------------------------------------------
# Order statistics of uniforms (Algorithm 6, Rényi representation)
# ---------------------------------------------------------------------------------------------


def order_statistic_ranks(n: int, num_exact_ranks: int = 100,
                          rank_growth: float = 1.05) -> np.ndarray:
  """Default ranks: 1, …, num_exact_ranks, then ×rank_growth (rounded up) until n, n included."""
  ranks = list(range(1, min(n, num_exact_ranks) + 1))
  k = ranks[-1]
  while k < n:
    k = min(n, max(k + 1, math.ceil(k * rank_growth)))
    ranks.append(k)
  return np.asarray(ranks, dtype=np.int64)


def _log_top_uniform(rng, n, size, log_min=None):
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
    out[:, ~unit] = rng.standard_gamma(shapes[~unit].astype(np.float64),
                                       (size, int((~unit).sum())))
  return out


def _log_uniform_order_statistics(rng, n, ranks, size, log_top_min=None) -> np.ndarray:
  """log U_(k) for the k-th largest of n i.i.d. U(0,1), k ∈ ranks (ranks[0] = 1), jointly.

  The top one is drawn by inversion (optionally conditioned on U_(1) ≥ exp(log_top_min),
  Appendix B.3); given U_(1) = u the other n − 1 are i.i.d. U(0, u) (Proposition B.4), whose
  order statistics are u·(1 − Γ_j/Γ_n) with Γ partial sums of Exp(1) (Rényi).
  Returns shape [size, len(ranks)], non-increasing along the last axis.
  """
  out = np.empty((size, len(ranks)))
  out[:, 0] = _log_top_uniform(rng, n, size, log_top_min)
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
    if self.direction == _REMOVE:
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
    log_pr_event = _log_event_probability(_REMOVE, sigma, self.num_steps, c)
    case1 = -rng.standard_exponential(size) < log_s1 - log_pr_event
    if log_f0 == 0.0:  # Φ̄(C/σ) < 1e-308 while Pr(A) > 1e-260: case 2 has probability < 1e-40
      case1[:] = True
    e = rng.standard_exponential(size)
    x1 = np.where(case1, 1 - sigma * special.ndtri_exp(log_s1 - e),
                  1 + sigma * special.ndtri_exp(log_f1 - e))
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
        log_top = _log_top_uniform(rng, n, size, log_top_min)
        log_u = np.concatenate(
            [log_top[:, None], log_top[:, None] - rng.standard_exponential((size, n - 1))], axis=1)
        others = sigma * special.ndtri_exp(log_u)
      log_sum = np.logaddexp(x1 / sigma**2, special.logsumexp(others / sigma**2, axis=1))
      return self._loss(log_sum), np.maximum(x1, others.max(axis=1))
    others = sigma * special.ndtri_exp(
        _log_uniform_order_statistics(rng, n, self.ranks, size, log_top_min))
    log_sum_others = _log_weighted_sum_exp(others / sigma**2,
                                           np.log(_upper_block_weights(self.ranks, n)))
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
        log_scale + _log_uniform_order_statistics(rng, n, self.ranks, size))
    log_sum = _log_weighted_sum_exp(x / sigma**2, np.log(_lower_block_weights(self.ranks)))
    return self._loss(log_sum), x[:, 0]


def _event_threshold(direction, sigma, num_steps, num_epochs, conditioning_epsilon) -> float:
  """C₁ (P‖Q: max ≥ C₁) or C₂ (Q‖P: max < C₂) at level ε_c / E."""
  level = conditioning_epsilon / num_epochs
  if direction == _REMOVE:
    return sigma**2 * level + 0.5
  return sigma**2 * (math.log(num_steps) - level) + 0.5


def _log_event_probability(direction, sigma, num_steps, threshold) -> float:
  """log Pr(A_1) for one epoch: log Pr_P(max ≥ C₁) or log Pr_Q(max < C₂), in log-space.

  These are the max-test laws P', Q' of `max_test` (no underflow for tiny probabilities).
  """
  p_law, q_law = max_test.balls_and_bins_max_pair(sigma, num_steps)
  if direction == _REMOVE:
    return float(p_law.log_sf(threshold))
  return float(q_law.log_cdf(threshold))


@dataclasses.dataclass(frozen=True)
class _Plan:
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
    """Samples per chunk: _SAMPLES_PER_CHUNK, fewer when one sample is wide (memory)."""
    width = self.num_steps if self.ranks is None else len(self.ranks)
    return max(1, min(_SAMPLES_PER_CHUNK, _CHUNK_ELEMENTS // max(1, width)))

  def sample(self, rng, size) -> tuple[np.ndarray, np.ndarray]:
    """(L_total or its pessimistic bound, weight 1/N) for `size` samples."""
    total = np.zeros(size)
    count = np.ones(size)
    for epoch in range(self.num_epochs):
      conditioned = self.threshold is not None and epoch == 0
      sampler = _Epoch(self.direction, self.sigma, self.num_steps, self.ranks,
                       self.threshold if conditioned else None)
      loss, top = sampler.sample(rng, size)
      total += loss
      if self.threshold is not None and epoch > 0:
        count += (top >= self.threshold) if self.direction == _REMOVE else (top < self.threshold)
    return total, 1.0 / count


def _make_plan(direction, sigma, num_steps, num_epochs, method, conditioning_epsilon,
               num_exact_ranks, rank_growth) -> _Plan:
  use_os = method in ('auto', 'order_statistics', 'importance_order_statistics')
  n = num_steps - 1 if direction == _REMOVE else num_steps
  ranks = order_statistic_ranks(n, num_exact_ranks, rank_growth) if use_os and n > 0 else None
  if method == 'auto' and ranks is not None and (len(ranks) == n or n <= _AUTO_EXACT_MAX_STEPS):
    ranks = None  # exact L at a cost within ~2-3x of order statistics; no block bias
  threshold, log_scale = None, 0.0
  if method in ('auto', 'importance', 'importance_order_statistics'):
    c = _event_threshold(direction, sigma, num_steps, num_epochs, conditioning_epsilon)
    log_scale_c = math.log(num_epochs) + _log_event_probability(direction, sigma, num_steps, c)
    if method != 'auto' or log_scale_c <= math.log(0.5):
      threshold, log_scale = c, log_scale_c
  return _Plan(direction, float(sigma), int(num_steps), int(num_epochs), ranks, threshold,
               log_scale)


def _f(direction, loss, weight, epsilons):
  """f_i(ε_j) = w_i (1 − e^{ε_j ∓ L_i})₊, shape [samples, k]."""
  sign = -1.0 if direction == _REMOVE else 1.0
  with np.errstate(over='ignore', invalid='ignore'):
    f = np.maximum(-np.expm1(epsilons[None, :] + sign * loss[:, None]), 0.0)
  return f * weight[:, None]


def _trivial_sums(plan: _Plan, epsilons, num_samples) -> HockeyStickSums | None:
  """δ ≤ E·Pr(A_1) needs no samples: mean f := 1 when E·Pr(A_1) < e^{-600}."""
  if plan.log_scale >= _LOG_SCALE_TRIVIAL:
    return None
  return HockeyStickSums(epsilons, np.full_like(epsilons, float(num_samples)), num_samples,
                         np.full_like(epsilons, plan.log_scale))


def _f_sum(direction, loss, weight, epsilons) -> np.ndarray:
  """Σ_i f_i(ε_j) over the given samples, in row blocks of bounded memory."""
  rows = max(1, _CHUNK_ELEMENTS // len(epsilons))
  total = np.zeros_like(epsilons)
  for start in range(0, len(loss), rows):
    total += _f(direction, loss[start:start + rows], weight[start:start + rows],
                epsilons).sum(axis=0)
  return total


# ---------------------------------------------------------------------------------------------
# Chunks: independent streams, run serially or in worker processes
# ---------------------------------------------------------------------------------------------


def _chunks(plan: _Plan, seed: Seed, key: tuple[int, int], num_samples: int) -> list[tuple]:
  """(plan, stream, size) per chunk; chunk c draws from SeedSequence(seed, spawn_key=(*key, c)).

  key = (direction index, conditioning group index). No chunks for a trivial plan.
  """
  if plan.log_scale < _LOG_SCALE_TRIVIAL:
    return []
  size = plan.chunk_size()
  return [(plan, np.random.SeedSequence(seed, spawn_key=(*key, c)), min(size, num_samples - start))
          for c, start in enumerate(range(0, num_samples, size))]


def _sample_chunk(plan: _Plan, stream: np.random.SeedSequence,
                  size: int) -> tuple[np.ndarray, np.ndarray]:
  """(loss, weight) of one chunk (runs in a worker process)."""
  return plan.sample(np.random.default_rng(stream), size)


def _sum_chunk(plan: _Plan, stream: np.random.SeedSequence, size: int,
               epsilons: np.ndarray) -> np.ndarray:
  """Σ_i f_i(ε_j) of one chunk (runs in a worker process)."""
  loss, weight = _sample_chunk(plan, stream, size)
  return _f_sum(plan.direction, loss, weight, epsilons)


# In a worker process of `_run`: the shared [front, back) bounds of the unclaimed tasks.
_worker_claims = None


def _init_worker(claims) -> None:
  global _worker_claims
  _worker_claims = claims


def _claim(claims, from_front: bool) -> int | None:
  """Claims the next unclaimed task index from one end of [front, back), or None if none."""
  with claims.get_lock():
    front, back = claims[0], claims[1]
    if front >= back:
      return None
    if from_front:
      claims[0] = front + 1
      return front
    claims[1] = back - 1
    return back - 1


def _drain(fn, tasks: list[tuple], from_front: bool = True, claims=None) -> dict[int, object]:
  """{index: fn(*task)} for the tasks this process claims, one at a time, until none is left."""
  claims = _worker_claims if claims is None else claims
  done = {}
  while (i := _claim(claims, from_front)) is not None:
    done[i] = fn(*tasks[i])
  return done


def _run(fn, tasks: list[tuple], workers: int) -> list:
  """[fn(*task) for task in tasks], in order, by `workers` processes: this one and workers − 1.

  The others are spawned ('spawn': fork after JAX initialisation is unsafe) and claim tasks
  from the front of a shared counter, this process from the back, so none waits for another to
  start (~2.5 s CPU each: they import dp_accounting) and a process that starts after the tasks
  are all claimed is not waited for.
  """
  if workers == 1 or len(tasks) <= 1:
    return [fn(*task) for task in tasks]
  context = multiprocessing.get_context('spawn')
  claims = context.Array('q', [0, len(tasks)])
  num_others = min(workers - 1, len(tasks) - 1)
  pool = futures.ProcessPoolExecutor(num_others, mp_context=context, initializer=_init_worker,
                                     initargs=(claims,))
  try:
    others = {pool.submit(_drain, fn, tasks) for _ in range(num_others)}
    for future in others:  # a late process unpickles `claims` at start: keep it alive until then
      future.add_done_callback(lambda _, keep=claims: keep)
    done = _drain(fn, tasks, from_front=False, claims=claims)
    while len(done) < len(tasks) and others:  # wait only for processes that claimed tasks
      finished, others = futures.wait(others, return_when=futures.FIRST_COMPLETED)
      for future in finished:
        done.update(future.result())
    return [done[i] for i in range(len(tasks))]
  finally:
    with claims.get_lock():  # on an error here, the others stop after their current task
      claims[0] = claims[1]
    pool.shutdown(wait=False, cancel_futures=True)


def _direction_rngs(seed: Seed, count: int = 1):
  """Independent generators per direction (and per conditioning level) from one seed (Poisson)."""
  remove, add = np.random.SeedSequence(seed).spawn(2)
  return ([np.random.default_rng(s) for s in remove.spawn(count)],
          [np.random.default_rng(s) for s in add.spawn(count)])


# ---------------------------------------------------------------------------------------------
# Public API: balls-and-bins
# ---------------------------------------------------------------------------------------------


def balls_and_bins_sums(sigma: float, num_steps: int, epsilons, *, num_epochs: int = 1,
                        num_samples: int, method: Method = 'auto', seed: Seed = 0,
                        conditioning_epsilon: float | None = None, num_exact_ranks: int = 100,
                        rank_growth: float = 1.05,
                        workers: int = 1) -> tuple[HockeyStickSums, HockeyStickSums]:
  """Monte-Carlo sufficient statistics for balls-and-bins, (P‖Q "remove", Q‖P "add").

  Args:
    sigma: noise multiplier σ.
    num_steps: T, steps (bins) per epoch.
    epsilons: grid of ε ≥ 0.
    num_epochs: E (Algorithm 11: L_total = Σ_e L_e, independent epochs).
    num_samples: m per direction (per ε when importance sampling conditions on each ε).
    method: 'naive' (all T coordinates), 'importance' (Alg. 5), 'order_statistics' (Alg. 6),
      'importance_order_statistics' (App. B.3), 'auto' (order statistics when T > 1000, all
      coordinates otherwise, plus importance in a direction where E·Pr(A_1) ≤ 1/2).
    seed: int or sequence of ints (e.g. (seed, j) on machine j, whose sums are then merged).
    conditioning_epsilon: importance sampling only. None conditions each ε of the grid on its
      own event (Alg. 5; costs m samples per ε); a value ε_c ≤ min(epsilons) conditions once on
      the event at ε_c, valid for every ε ≥ ε_c (one sample set).
    num_exact_ranks, rank_growth: order-statistic ranks (`order_statistic_ranks`).
    workers: processes sampling the chunks; the sums do not depend on it (module docstring).

  Returns:
    (remove, add) `HockeyStickSums`; combine with `delta_from_sums`.
  """
  _check_common(sigma, num_steps, num_epochs, num_samples, 0.5)
  eps = _check_epsilons(epsilons)
  _check_method(method)
  _check_ranks(num_exact_ranks, rank_growth)
  _check_seed(seed)
  _check_workers(workers)
  importance = method in ('auto', 'importance', 'importance_order_statistics')
  if conditioning_epsilon is not None:
    if not (_is_number(conditioning_epsilon) and 0 <= conditioning_epsilon <= eps.min()):
      raise ValueError(f'conditioning_epsilon must be in [0, min(epsilons)] = [0, {eps.min()}], '
                       f'got {conditioning_epsilon!r}.')
  per_epsilon = importance and conditioning_epsilon is None
  # One sample set per ε of the grid (each conditioned on its own event), or one for all.
  groups = ([(float(e), eps[i:i + 1]) for i, e in enumerate(eps)] if per_epsilon
            else [(conditioning_epsilon or 0.0, eps)])
  plans = {(d, g): _make_plan(direction, sigma, num_steps, num_epochs, method, level,
                              num_exact_ranks, rank_growth)
           for d, direction in enumerate((_REMOVE, _ADD)) for g, (level, _) in enumerate(groups)}
  tasks, owners = [], []
  for key, plan in plans.items():
    for task in _chunks(plan, seed, key, num_samples):
      tasks.append(task + (groups[key[1]][1],))
      owners.append(key)
  # A trivial plan has no chunks and mean f := 1 (`_trivial_sums`).
  sum_f = {key: np.full_like(groups[key[1]][1], float(num_samples)
                             if plan.log_scale < _LOG_SCALE_TRIVIAL else 0.0)
           for key, plan in plans.items()}
  for key, chunk_sum in zip(owners, _run(_sum_chunk, tasks, workers)):
    sum_f[key] += chunk_sum  # in chunk order, whoever computed it
  results = []
  for d in range(2):
    keys = [(d, g) for g in range(len(groups))]
    results.append(HockeyStickSums(
        eps, np.concatenate([sum_f[key] for key in keys]), num_samples,
        np.concatenate([np.full(len(groups[g][1]), plans[d, g].log_scale) for _, g in keys])))
  return results[0], results[1]


def balls_and_bins_delta(sigma: float, num_steps: int, epsilons, *, num_epochs: int = 1,
                         num_samples: int, beta: float = 1e-3, method: Method = 'auto',
                         seed: Seed = 0, conditioning_epsilon: float | None = None,
                         num_exact_ranks: int = 100, rank_growth: float = 1.05,
                         workers: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Monte-Carlo δ(ε) of balls-and-bins DP-SGD: (point estimate, UCB at confidence 1 − β).

  The UCB is ≥ the true δ(ε) with probability ≥ 1 − β (for each ε of the grid); the point
  estimate is not a guarantee. Arguments as in `balls_and_bins_sums`.
  """
  _check_common(sigma, num_steps, num_epochs, num_samples, beta)
  remove, add = balls_and_bins_sums(
      sigma, num_steps, epsilons, num_epochs=num_epochs, num_samples=num_samples, method=method,
      seed=seed, conditioning_epsilon=conditioning_epsilon, num_exact_ranks=num_exact_ranks,
      rank_growth=rank_growth, workers=workers)
  return delta_from_sums(remove, add, beta)


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


def _gaussian_epsilon(sigma: float, delta: float) -> float:
  """ε(δ) of the Gaussian mechanism, sensitivity 1, noise σ (for a bisection bracket only)."""
  def excess(eps):
    return (special.ndtr(-eps * sigma + 0.5 / sigma)
            - math.exp(eps) * special.ndtr(-eps * sigma - 0.5 / sigma) - delta)
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

  def __init__(self, plan: _Plan, num_samples: int, chunks: list[tuple[np.ndarray, np.ndarray]]):
    self.plan, self.num_samples, self.chunks = plan, num_samples, chunks

  def sums(self, epsilon: float) -> HockeyStickSums:
    eps = np.asarray([epsilon], dtype=np.float64)
    trivial = _trivial_sums(self.plan, eps, self.num_samples)
    if trivial is not None:
      return trivial
    sum_f = np.zeros(1)
    for loss, weight in self.chunks:
      sum_f += _f_sum(self.plan.direction, loss, weight, eps)
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
  while hi - lo > 1e-9 * max(1.0, hi):
    mid = 0.5 * (lo + hi)
    if value_at(mid) <= delta:
      hi = mid
    else:
      lo = mid
  return hi


def available_cores() -> int:
  """Cores this process may run on (`os.process_cpu_count`, Python ≥ 3.13, else the affinity)."""
  count = getattr(os, 'process_cpu_count', None)
  if count is not None:
    return max(1, count() or 1)
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except AttributeError:  # no affinity on this platform
    return max(1, os.cpu_count() or 1)


def _conditioning_level(sigma, num_steps, delta, num_epochs, method) -> float:
  """ε_c of the importance event: CONDITIONING_FRACTION × the max-test lower bound on ε(δ).

  Below the provable lower bound, so neither the bound nor the point estimate is ever held at
  the max-test value (the conditioned samples estimate δ(ε) only for ε ≥ ε_c).
  """
  if method not in ('auto', 'importance', 'importance_order_statistics'):
    return 0.0
  return CONDITIONING_FRACTION * max_test.balls_and_bins_lower_bound_epsilon(
      sigma, num_steps, delta, num_epochs=num_epochs)


def default_num_samples(sigma: float, num_steps: int, delta: float, beta: float = 1e-3, *,
                        num_epochs: int = 1, method: Method = 'auto') -> int:
  """m per direction from δ and β: SAMPLES_PER_FLOOR × the least m for which an ε exists.

  With no positive sample the Chernoff bound of a direction is s·(1 − (β/2)^{1/m}) ≈
  s·log(2/β)/m (s = E·Pr(A), the importance scale, 1 without it), which must be < δ; m =
  10·s·log(2/β)/δ leaves δ/10 for that floor, so δ⁺(ε) ≤ δ is met near the true ε (Chua et al.
  2025, §5: m ≳ several/δ). At least MIN_SAMPLES.
  """
  _check_common(sigma, num_steps, num_epochs, 1, beta)
  level = _conditioning_level(sigma, num_steps, delta, num_epochs, method)
  scale = max(math.exp(_make_plan(direction, sigma, num_steps, num_epochs, method, level, 100,
                                  1.05).log_scale) for direction in (_REMOVE, _ADD))
  return max(MIN_SAMPLES, math.ceil(SAMPLES_PER_FLOOR * scale * math.log(2 / beta) / delta))


def estimated_seconds(num_samples: int, num_steps: int, num_epochs: int = 1,
                      workers: int = 1) -> float:
  """Rough wall time of `balls_and_bins_epsilon` ('auto'): m × width × E × 2 directions."""
  width = num_steps if num_steps <= _AUTO_EXACT_MAX_STEPS else len(
      order_statistic_ranks(num_steps))
  return SECONDS_PER_COORDINATE * num_samples * width * num_epochs * 2 / max(1, workers)


def balls_and_bins_epsilon(sigma: float, num_steps: int, delta: float, *, num_epochs: int = 1,
                           num_samples: int | None = None, beta: float = 1e-3,
                           method: Method = 'auto', seed: Seed = 0, num_exact_ranks: int = 100,
                           rank_growth: float = 1.05,
                           workers: int | None = None) -> MonteCarloResult:
  """High-probability upper bound on ε(δ) of balls-and-bins DP-SGD (Algorithms 4-6, 11).

  One sample set per direction; ε is found by bisection on the monotone δ⁺(ε). Importance
  sampling conditions once at ε_c = ½ × the max-test lower bound on ε(δ) (`max_test`), below
  every ε the bisection returns, so one conditioned sample set serves them all. Sampling is
  ~95% of the time (T = 1e4, m = 1e5): `workers` processes (None: the available cores) draw
  the chunks, the bisection runs here on the stored losses; the result does not depend on
  `workers`. num_samples None: `default_num_samples(σ, T, δ, β)`.

  Raises:
    ValueError: bad arguments, or num_samples too small for delta (even p̂ = 0 leaves δ⁺ > δ).
  """
  if not (_is_number(delta) and 0 < delta < 1):
    raise ValueError(f'delta must be in (0, 1), got {delta!r}.')
  if num_samples is None:
    num_samples = default_num_samples(sigma, num_steps, delta, beta, num_epochs=num_epochs,
                                      method=method)
  _check_common(sigma, num_steps, num_epochs, num_samples, beta)
  _check_method(method)
  _check_ranks(num_exact_ranks, rank_growth)
  _check_seed(seed)
  workers = available_cores() if workers is None else workers
  _check_workers(workers)
  started = time.monotonic()
  conditioning = _conditioning_level(sigma, num_steps, delta, num_epochs, method)
  plans = [_make_plan(direction, sigma, num_steps, num_epochs, method, conditioning,
                      num_exact_ranks, rank_growth) for direction in (_REMOVE, _ADD)]
  floor = kl_upper_confidence_bound(0.0, num_samples, beta / 2)[0]
  for plan in plans:
    if math.exp(plan.log_scale) * floor >= delta:
      raise ValueError(
          f'num_samples = {num_samples} is too small for delta = {delta} at beta = {beta}: even '
          f'with no positive sample the {plan.direction} upper confidence bound is '
          f'{math.exp(plan.log_scale) * floor:.3g}; need num_samples > '
          f'{math.ceil(math.exp(plan.log_scale) * math.log(2 / beta) / delta)} (default: '
          f'{default_num_samples(sigma, num_steps, delta, beta, num_epochs=num_epochs)}).')
  tasks = [_chunks(plan, seed, (d, 0), num_samples) for d, plan in enumerate(plans)]
  chunks = _run(_sample_chunk, tasks[0] + tasks[1], workers)
  samples = [_LossSamples(plans[0], num_samples, chunks[:len(tasks[0])]),
             _LossSamples(plans[1], num_samples, chunks[len(tasks[0]):])]

  def ucb(eps):
    return max(s.sums(eps).upper_confidence_bound(beta / 2)[0] for s in samples)

  def point(eps):
    return max(s.sums(eps).point_estimate()[0] for s in samples)

  start = _gaussian_epsilon(sigma / math.sqrt(num_epochs), delta)
  used_importance = any(plan.threshold is not None for plan in plans)
  lo = conditioning if used_importance else 0.0
  methods = {plan.direction: plan.method for plan in plans}
  epsilon = _smallest_epsilon(ucb, delta, lo, start)
  epsilon_point = _smallest_epsilon(point, delta, lo, start)
  return MonteCarloResult(
      epsilon=epsilon, epsilon_point=epsilon_point,
      delta=float(delta), confidence=1 - beta, num_samples=num_samples,
      method=f'{method}(P‖Q: {methods[_REMOVE]}, Q‖P: {methods[_ADD]})', seed=seed,
      conditioning_epsilon=conditioning if used_importance else None,
      seconds=time.monotonic() - started)


# ---------------------------------------------------------------------------------------------
# Poisson pair: the acceptance test of the estimator
# ---------------------------------------------------------------------------------------------


def _poisson_loss(x, sigma, q):
  """L = Σ_t log(1 − q + q e^{(2x_t − 1)/(2σ²)})."""
  with np.errstate(divide='ignore'):
    log_1mq = math.log1p(-q) if q < 1 else -math.inf
  return np.sum(np.logaddexp(log_1mq, math.log(q) + (2 * x - 1) / (2 * sigma**2)), axis=1)


def poisson_sums(sigma: float, sampling_probability: float, num_steps: int, epsilons, *,
                 num_samples: int, seed: Seed = 0) -> tuple[HockeyStickSums, HockeyStickSums]:
  """Naive Monte-Carlo sums for the Poisson pair, (P‖Q "remove", Q‖P "add").

  P = Π_t ((1 − q) N(0, σ²) + q N(1, σ²)), Q = N(0, σ² I_T); same estimator as balls-and-bins,
  so agreement with dp_accounting's PLD tests the estimator itself (docs/accounting.md §2).
  """
  _check_common(sigma, num_steps, 1, num_samples, 0.5)
  if not (_is_number(sampling_probability) and 0 < sampling_probability <= 1):
    raise ValueError(f'sampling_probability must be in (0, 1], got {sampling_probability!r}.')
  eps = _check_epsilons(epsilons)
  _check_seed(seed)
  rngs = _direction_rngs(seed)
  chunk = max(1, _CHUNK_ELEMENTS // max(num_steps, len(eps)))
  results = []
  for direction, (rng,) in zip((_REMOVE, _ADD), rngs):
    sum_f = np.zeros_like(eps)
    for start in range(0, num_samples, chunk):
      size = min(chunk, num_samples - start)
      x = sigma * rng.standard_normal((size, num_steps))
      if direction == _REMOVE:
        x += rng.random((size, num_steps)) < sampling_probability
      loss = _poisson_loss(x, sigma, sampling_probability)
      sum_f += _f(direction, loss, np.ones(size), eps).sum(axis=0)
    results.append(HockeyStickSums(eps, sum_f, num_samples, np.zeros_like(eps)))
  return results[0], results[1]


def poisson_delta(sigma: float, sampling_probability: float, num_steps: int, epsilons, *,
                  num_samples: int, beta: float = 1e-3,
                  seed: Seed = 0) -> tuple[np.ndarray, np.ndarray]:
  """Monte-Carlo δ(ε) for Poisson-subsampled DP-SGD: (point estimate, UCB at 1 − β)."""
  _check_common(sigma, num_steps, 1, num_samples, beta)
  remove, add = poisson_sums(sigma, sampling_probability, num_steps, epsilons,
                             num_samples=num_samples, seed=seed)
  return delta_from_sums(remove, add, beta)
