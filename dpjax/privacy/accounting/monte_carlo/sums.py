"""δ estimates of the balls-and-bins and Poisson pairs: sufficient statistics and bounds."""

from __future__ import annotations


import numpy as np

from dpjax.privacy.accounting.monte_carlo import parallel
from dpjax.privacy.accounting.monte_carlo.bounds import HockeyStickSums
from dpjax.privacy.accounting.monte_carlo.bounds import delta_from_sums
from dpjax.privacy.accounting.monte_carlo.parallel import chunk_tasks
from dpjax.privacy.accounting.monte_carlo.parallel import direction_rngs
from dpjax.privacy.accounting.monte_carlo.parallel import sum_chunk
from dpjax.privacy.accounting.monte_carlo.sampling import ADD
from dpjax.privacy.accounting.monte_carlo.sampling import CHUNK_ELEMENTS
from dpjax.privacy.accounting.monte_carlo.sampling import LOG_SCALE_TRIVIAL
from dpjax.privacy.accounting.monte_carlo.sampling import REMOVE
from dpjax.privacy.accounting.monte_carlo.sampling import hockey_stick_terms
from dpjax.privacy.accounting.monte_carlo.sampling import make_plan
from dpjax.privacy.accounting.monte_carlo.sampling import poisson_loss
from dpjax.privacy.accounting.monte_carlo.validation import Method
from dpjax.privacy.accounting.monte_carlo.validation import Seed
from dpjax.privacy.accounting.monte_carlo.validation import check_common
from dpjax.privacy.accounting.monte_carlo.validation import check_epsilons
from dpjax.privacy.accounting.monte_carlo.validation import check_method
from dpjax.privacy.accounting.monte_carlo.validation import check_ranks
from dpjax.privacy.accounting.monte_carlo.validation import check_seed
from dpjax.privacy.accounting.monte_carlo.validation import check_workers
from dpjax.privacy.accounting.monte_carlo.validation import is_finite_number


def _epsilon_groups(eps: np.ndarray, method: Method, conditioning_epsilon: float | None):
  """[(conditioning level, the ε of the grid its sample set serves)]: one sample set per ε
  (importance sampling conditioned on each ε's own event, Alg. 5) when importance sampling
  has no `conditioning_epsilon`, else one set, conditioned at it, for the whole grid."""
  importance = method in ('auto', 'importance', 'importance_order_statistics')
  if conditioning_epsilon is not None:
    if not (is_finite_number(conditioning_epsilon) and 0 <= conditioning_epsilon <= eps.min()):
      raise ValueError(
        f'conditioning_epsilon must be in [0, min(epsilons)] = [0, {eps.min()}], '
        f'got {conditioning_epsilon!r}.'
      )
  if importance and conditioning_epsilon is None:
    return [(float(e), eps[i : i + 1]) for i, e in enumerate(eps)]
  return [(conditioning_epsilon or 0.0, eps)]


def balls_and_bins_sums(
  sigma: float,
  num_steps: int,
  epsilons,
  *,
  num_epochs: int = 1,
  num_samples: int,
  method: Method = 'auto',
  seed: Seed = 0,
  conditioning_epsilon: float | None = None,
  num_exact_ranks: int = 100,
  rank_growth: float = 1.05,
  workers: int = 1,
) -> tuple[HockeyStickSums, HockeyStickSums]:
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
  check_common(sigma, num_steps, num_epochs, num_samples, 0.5)
  eps = check_epsilons(epsilons)
  check_method(method)
  check_ranks(num_exact_ranks, rank_growth)
  check_seed(seed)
  check_workers(workers)
  groups = _epsilon_groups(eps, method, conditioning_epsilon)
  plans = {
    (d, g): make_plan(
      direction, sigma, num_steps, num_epochs, method, level, num_exact_ranks, rank_growth
    )
    for d, direction in enumerate((REMOVE, ADD))
    for g, (level, _) in enumerate(groups)
  }
  tasks, owners = [], []
  for key, plan in plans.items():
    for task in chunk_tasks(plan, seed, key, num_samples):
      tasks.append(task + (groups[key[1]][1],))
      owners.append(key)
  # A trivial plan has no chunks and mean f := 1 (`trivial_sums`).
  sum_f = {
    key: np.full_like(
      groups[key[1]][1], float(num_samples) if plan.log_scale < LOG_SCALE_TRIVIAL else 0.0
    )
    for key, plan in plans.items()
  }
  for key, chunk_sum in zip(owners, parallel.run(sum_chunk, tasks, workers)):
    sum_f[key] += chunk_sum  # in chunk order, whoever computed it
  results = []
  for d in range(2):
    keys = [(d, g) for g in range(len(groups))]
    results.append(
      HockeyStickSums(
        eps,
        np.concatenate([sum_f[key] for key in keys]),
        num_samples,
        np.concatenate([np.full(len(groups[g][1]), plans[d, g].log_scale) for _, g in keys]),
      )
    )
  return results[0], results[1]


def balls_and_bins_delta(
  sigma: float,
  num_steps: int,
  epsilons,
  *,
  num_epochs: int = 1,
  num_samples: int,
  beta: float = 1e-3,
  method: Method = 'auto',
  seed: Seed = 0,
  conditioning_epsilon: float | None = None,
  num_exact_ranks: int = 100,
  rank_growth: float = 1.05,
  workers: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
  """Monte-Carlo δ(ε) of balls-and-bins DP-SGD: (point estimate, UCB at confidence 1 − β).

  The UCB is ≥ the true δ(ε) with probability ≥ 1 − β (for each ε of the grid); the point
  estimate is not a guarantee. Arguments as in `balls_and_bins_sums`.
  """
  check_common(sigma, num_steps, num_epochs, num_samples, beta)
  remove, add = balls_and_bins_sums(
    sigma,
    num_steps,
    epsilons,
    num_epochs=num_epochs,
    num_samples=num_samples,
    method=method,
    seed=seed,
    conditioning_epsilon=conditioning_epsilon,
    num_exact_ranks=num_exact_ranks,
    rank_growth=rank_growth,
    workers=workers,
  )
  return delta_from_sums(remove, add, beta)


def poisson_sums(
  sigma: float,
  sampling_probability: float,
  num_steps: int,
  epsilons,
  *,
  num_samples: int,
  seed: Seed = 0,
) -> tuple[HockeyStickSums, HockeyStickSums]:
  """Naive Monte-Carlo sums for the Poisson pair, (P‖Q "remove", Q‖P "add").

  P = Π_t ((1 − q) N(0, σ²) + q N(1, σ²)), Q = N(0, σ² I_T); same estimator as balls-and-bins,
  so agreement with dp_accounting's PLD tests the estimator itself (docs/accounting.md §2).
  """
  check_common(sigma, num_steps, 1, num_samples, 0.5)
  if not (is_finite_number(sampling_probability) and 0 < sampling_probability <= 1):
    raise ValueError(f'sampling_probability must be in (0, 1], got {sampling_probability!r}.')
  eps = check_epsilons(epsilons)
  check_seed(seed)
  rngs = direction_rngs(seed)
  chunk = max(1, CHUNK_ELEMENTS // max(num_steps, len(eps)))
  results = []
  for direction, (rng,) in zip((REMOVE, ADD), rngs):
    sum_f = np.zeros_like(eps)
    for start in range(0, num_samples, chunk):
      size = min(chunk, num_samples - start)
      x = sigma * rng.standard_normal((size, num_steps))
      if direction == REMOVE:
        x += rng.random((size, num_steps)) < sampling_probability
      loss = poisson_loss(x, sigma, sampling_probability)
      sum_f += hockey_stick_terms(direction, loss, np.ones(size), eps).sum(axis=0)
    results.append(HockeyStickSums(eps, sum_f, num_samples, np.zeros_like(eps)))
  return results[0], results[1]


def poisson_delta(
  sigma: float,
  sampling_probability: float,
  num_steps: int,
  epsilons,
  *,
  num_samples: int,
  beta: float = 1e-3,
  seed: Seed = 0,
) -> tuple[np.ndarray, np.ndarray]:
  """Monte-Carlo δ(ε) for Poisson-subsampled DP-SGD: (point estimate, UCB at 1 − β)."""
  check_common(sigma, num_steps, 1, num_samples, beta)
  remove, add = poisson_sums(
    sigma, sampling_probability, num_steps, epsilons, num_samples=num_samples, seed=seed
  )
  return delta_from_sums(remove, add, beta)
