"""Input validation of the Monte-Carlo accountant's arguments (one clear ValueError each)."""

from __future__ import annotations

import math
from typing import Literal, Sequence, Union

import numpy as np

from dpjax import _checks



Method = Literal['auto', 'naive', 'importance', 'order_statistics', 'importance_order_statistics']
METHODS = ('auto', 'naive', 'importance', 'order_statistics', 'importance_order_statistics')
Seed = Union[int, Sequence[int]]


# ---------------------------------------------------------------------------------------------


def _is_number(value) -> bool:
  return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
          and math.isfinite(value))


def _check_common(sigma, num_steps, num_epochs, num_samples, beta):
  if not (_is_number(sigma) and sigma > 0):
    raise ValueError(f'sigma (noise multiplier) must be a finite number > 0, got {sigma!r}.')
  _checks.check_int('num_steps', num_steps, 1)
  _checks.check_int('num_epochs', num_epochs, 1)
  _checks.check_int('num_samples', num_samples, 1)
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
  _checks.check_int('workers', workers, 1)


def _check_method(method):
  if method not in METHODS:
    raise ValueError(f'method must be one of {METHODS}, got {method!r}.')


def _check_ranks(num_exact_ranks, rank_growth):
  _checks.check_int('num_exact_ranks', num_exact_ranks, 1)
  if not (_is_number(rank_growth) and rank_growth > 1):
    raise ValueError(f'rank_growth must be a finite number > 1, got {rank_growth!r}.')
