"""Input validation of the Monte-Carlo accountant's arguments (one clear ValueError each)."""

from __future__ import annotations

import math
from typing import Literal, Sequence, Union

import numpy as np

from dpjax.privacy import checks

Method = Literal['auto', 'naive', 'importance', 'order_statistics', 'importance_order_statistics']
METHODS = ('auto', 'naive', 'importance', 'order_statistics', 'importance_order_statistics')
Seed = Union[int, Sequence[int]]


# ---------------------------------------------------------------------------------------------


def is_finite_number(value) -> bool:
  """`checks.is_number` (a real number, not a bool) and finite."""
  return checks.is_number(value) and math.isfinite(value)


def check_common(sigma, num_steps, num_epochs, num_samples, beta):
  """σ > 0 finite; T, E, m integers ≥ 1; β ∈ (0, 1)."""
  if not (is_finite_number(sigma) and sigma > 0):
    raise ValueError(f'sigma (noise multiplier) must be a finite number > 0, got {sigma!r}.')
  checks.check_int('num_steps', num_steps, 1)
  checks.check_int('num_epochs', num_epochs, 1)
  checks.check_int('num_samples', num_samples, 1)
  if not (is_finite_number(beta) and 0 < beta < 1):
    raise ValueError(f'beta (failure probability) must be in (0, 1), got {beta!r}.')


def check_epsilons(epsilons) -> np.ndarray:
  """The ε grid as a non-empty 1-d float64 array of finite values ≥ 0."""
  eps = np.atleast_1d(np.asarray(epsilons, dtype=np.float64))
  if eps.ndim != 1 or eps.size == 0 or not np.all(np.isfinite(eps)) or np.any(eps < 0):
    raise ValueError(
      f'epsilons must be a non-empty 1-d array of finite values >= 0, got {epsilons!r}.'
    )
  return eps


def check_seed(seed):
  """An integer ≥ 0 or a non-empty sequence of them (a SeedSequence entropy)."""
  values = [seed] if isinstance(seed, (int, np.integer)) else seed
  try:
    ok = len(values) > 0 and all(
      isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in values
    )
  except TypeError:
    ok = False
  if not ok:
    raise ValueError(f'seed must be an integer >= 0 or a sequence of them, got {seed!r}.')


def check_workers(workers):
  """An integer ≥ 1."""
  checks.check_int('workers', workers, 1)


def check_method(method):
  """One of METHODS."""
  if method not in METHODS:
    raise ValueError(f'method must be one of {METHODS}, got {method!r}.')


def check_ranks(num_exact_ranks, rank_growth):
  """num_exact_ranks an integer ≥ 1, rank_growth finite > 1 (`order_statistic_ranks`)."""
  checks.check_int('num_exact_ranks', num_exact_ranks, 1)
  if not (is_finite_number(rank_growth) and rank_growth > 1):
    raise ValueError(f'rank_growth must be a finite number > 1, got {rank_growth!r}.')
