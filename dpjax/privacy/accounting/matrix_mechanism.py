"""Correlated noise without amplification: one Gaussian mechanism of the strategy's sensitivity.

docs/accounting.md §9, "No amplification". Everything a matrix-factorisation run releases up to
step t is post-processing of C_t·X + Z (C_t the leading t × t block of the strategy C, lower-
triangular, so the first t releases read only the first t rows; Z ~ N(0, σ²C²)): the Gaussian
mechanism on X ↦ C_t·X, whose sensitivity is Δ_t = max_π ‖C_t·1_π‖ over the participation
patterns π the sampler can produce in the first t steps (Choquette-Choo, McMahan, Rush,
Thakurta, "Multi-epoch matrix factorization mechanisms for private machine learning"). So ε
after t steps is that of `GaussianDpEvent(σ/Δ_t)`, once (exact: Balle & Wang's closed form via
dp_accounting; RDP when asked). A sampler's randomness is ignored, not exploited: given the
pattern the release is such a Gaussian with shift ‖C_t·1_π‖ <= Δ_t, and by joint convexity a
mixture over patterns is no less private than its worst member.

Patterns (`Sampler.mf_patterns`, the sampler states them; `sensitivity` computes Δ):

* 'every_epoch' (deterministic): π = {s, s + T, s + 2T, ...}, T steps per epoch.
* 'one_per_epoch' (shuffle): one step anywhere in each epoch, two adjacent ones included.
* 'every_group_step' (cyclic Poisson, for a strategy it does not amplify: BLT, or more bands
  than groups): π ⊆ {g, g + k, ...}, so the full set of each group's steps (adding a step
  never lowers Σ|M_st|, so subsets are covered).

Δ is `Sensitivity(value, exact)`: `exact` False means an upper bound (a valid, looser ε), never a
lower one. Poisson, balls-and-bins and fixed-size samplers are refused: their patterns are
unbounded (any step) or not analysed here.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from dp_accounting import dp_event

from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import rdp_steps
from dpjax.privacy.accounting.accountant_view import Accountant
from dpjax.privacy.accounting.report import PrivacyReport
from dpjax.privacy.correlated import sensitivity as sensitivity_lib
from dpjax.privacy.correlated import strategy as strategy_lib
from dpjax.privacy.correlated import toeplitz

NAME = 'matrix_mechanism'  # Its key in `analyses.ANALYSES`.
PATTERNS = {
  'every_epoch': 'pi = {s, s + T, ...}: one fixed step per epoch of T steps',
  'one_per_epoch': 'one step anywhere in each epoch of T steps (adjacent ones included)',
  'every_group_step': "pi within {g, g + k, ...}: the steps of the example's group",
}
MF_SAMPLERS = 'deterministic, shuffle or cyclic_poisson'
# The expected error beside ε builds n × n float64 matrices: skipped above this n (~0.3 GB).
MAX_ERROR_STEPS = 4096
# A strategy for `check_noise` to route with before one is optimised (its values are unused).
_PLACEHOLDER = strategy_lib.Strategy('bandmf', 1, coefs=(1.0,))


def amplified(sampler, noise: str, num_bands: int) -> bool:
  """BandMF with at most as many bands as the sampler's participations are apart, on a sampler
  that amplifies it (cyclic Poisson): `analyses.cyclic_poisson_subsampling` accounts it."""
  return (
    noise == 'bandmf'
    and sampler.amplifies_banded_noise
    and num_bands <= getattr(sampler, 'num_groups', 0)
  )


def check_noise(sampler, noise: str, num_bands: int, strategy=None) -> str:
  """The analysis that accounts this mechanism with this sampler: the sampler's own (DP-SGD's
  noise, one band, or amplified BandMF), or NAME; one-line ValueError when none does."""
  if strategy is not None and not isinstance(strategy, strategy_lib.Strategy):
    raise ValueError(f'strategy must be a correlated.strategy.Strategy, got {type(strategy)}.')
  if noise == 'gaussian' or (num_bands == 1 and noise == 'bandmf'):
    return sampler.analysis  # C = I: DP-SGD whatever the name.
  if amplified(sampler, noise, num_bands):
    return sampler.analysis
  what = f"noise = '{noise}'" + (f' with {num_bands} bands' if noise == 'bandmf' else '')
  if sampler.mf_patterns is None:
    raise ValueError(
      f'{what} is accounted for sampler cyclic_poisson (num_groups >= num_bands, amplified) '
      f'or, given its strategy, {MF_SAMPLERS} (by its sensitivity); the {sampler.name} '
      "sampler's participation patterns are unbounded or not analysed for correlated noise."
    )
  if strategy is None:
    if sampler.amplifies_banded_noise and noise == 'bandmf':
      raise ValueError(
        f"num_bands = {num_bands} must be <= the cyclic_poisson sampler's num_groups = "
        f'{sampler.num_groups} (participations closer than the bands overlap in C), or give '
        'the strategy (strategy=) to account it by its sensitivity, without amplification.'
      )
    raise ValueError(
      f'{what} with the {sampler.name} sampler is accounted by the sensitivity of its '
      'strategy: give it (AccountingOptions.strategy, correlated.strategy.make).'
    )
  return NAME


def strategy_for(sampler, noise: str, num_steps: int, num_bands: int = 1, num_buffers=None):
  """The strategy of `noise` optimised for `num_steps` (`correlated.strategy.make`) where this
  analysis reads it (BLT, or BandMF the sampler does not amplify), else None; a sampler whose
  patterns are not analysed is refused first (`check_noise`), before any optimisation."""
  if sampler.mf_patterns is None:
    check_noise(sampler, noise, num_bands)
  if check_noise(sampler, noise, num_bands, _PLACEHOLDER) != NAME:
    return None
  if noise == 'blt':
    if num_buffers is None:
      raise ValueError('noise = blt needs num_buffers (the BLT buffers, an integer >= 1).')
    return strategy_lib.for_run('blt', num_steps, num_buffers=num_buffers)
  return strategy_lib.for_run('bandmf', num_steps, num_bands=num_bands)


def check_combination(sampler, noise: str, num_bands: int) -> None:
  """One-line ValueError, before any strategy is optimised, when no analysis accounts this
  mechanism with this sampler even given its strategy."""
  check_noise(sampler, noise, num_bands, _PLACEHOLDER)


def check_accountant(acct: Accountant) -> None:
  """What the matrix-mechanism analysis does not cover, refused before any computation."""
  if acct.group_size > 1:
    raise ValueError(
      f'group_size = {acct.group_size} > 1 is not analysed for correlated noise without '
      'amplification (group_size = 1 only).'
    )
  if acct.prior_runs:
    raise ValueError('prior_runs: composing a correlated-noise run with others is not analysed.')
  n = acct.strategy.num_steps
  if acct.num_steps is not None and acct.num_steps > n:
    raise ValueError(
      f"num_steps = {acct.num_steps} must be <= the strategy's num_steps = {n} (C is "
      'normalised for n steps; make the strategy for the run).'
    )


def _monotone(c: np.ndarray) -> bool:
  return bool(np.all(c >= 0) and np.all(np.diff(c) <= 0))


@functools.lru_cache(maxsize=256)
def sensitivity(strategy, patterns: str, period: int, steps: int) -> sensitivity_lib.Sensitivity:
  """Δ_t of the first `steps` steps of `strategy` for the sampler's `patterns` (PATTERNS),
  `period` = T steps per epoch or k groups.

  Periodic patterns of non-increasing coefficients c_0 >= c_1 >= ... >= 0 take
  `toeplitz_min_separation` (the pattern {0, period, ...} is the worst, exact, O(k²·t)); other
  coefficients a dense t × t Gram matrix (`every_period`, `one_per_epoch`: O(t³))."""
  if patterns not in PATTERNS:
    raise ValueError(f'patterns must be one of {", ".join(PATTERNS)}, got {patterns!r}.')
  c = strategy.toeplitz_coefs()[:steps]
  if patterns == 'one_per_epoch':
    return sensitivity_lib.one_per_epoch(toeplitz.dense(c, steps), period)
  if _monotone(c):
    return sensitivity_lib.toeplitz_min_separation(c, steps, -(-steps // period), period)
  return sensitivity_lib.every_period(toeplitz.dense(c, steps), period)


def _period(sampler) -> int:
  patterns = sampler.mf_patterns
  return sampler.num_groups if patterns == 'every_group_step' else sampler.steps_per_epoch


def _dp_sgd_participations(sampler, steps: int) -> int:
  """At most how many of the first `steps` steps one example joins (DP-SGD's Δ² unamplified)."""
  return -(-steps // _period(sampler))


def matrix_mechanism(acct: Accountant, steps: int, estimates: bool) -> PrivacyReport:
  """ε after `steps` steps: `GaussianDpEvent(σ/Δ_t)` once (module docstring)."""
  strategy, sampler = acct.strategy, acct.sampler
  if steps > strategy.num_steps:
    raise ValueError(
      f"step {steps} is past the strategy's num_steps = {strategy.num_steps} (C is normalised "
      'for n steps; the privatizer refuses later steps).'
    )
  delta_t = sensitivity(strategy, sampler.mf_patterns, _period(sampler), steps)
  sigma = acct.accounted_noise_multiplier / delta_t.value
  if acct.accountant == 'rdp':
    eps = float(rdp_steps.composed_rdp(dp_event.GaussianDpEvent(sigma), 1).get_epsilon(acct.delta))
    method = 'rdp(gaussian, sigma / strategy sensitivity)'
  else:
    eps = balls_and_bins.deterministic_epsilon(sigma, 1, acct.delta)
    method = 'gaussian(sigma / strategy sensitivity), exact (no amplification)'
  details: dict[str, Any] = {
    'method': method,
    'noise': acct.noise,
    'strategy_sensitivity': delta_t.value,
    'strategy_sensitivity_exact': delta_t.exact,
    'strategy_sensitivity_note': 'an upper bound'
    if not delta_t.exact
    else 'the max over the patterns',
    'participation_patterns': PATTERNS[sampler.mf_patterns],
    'strategy_steps': strategy.num_steps,
    'state_vectors': strategy.state_vectors,
  }
  if acct.noise == 'bandmf':
    details['num_bands'] = strategy.bands
  else:
    details['num_buffers'] = strategy.state_vectors
  n = strategy.num_steps
  if estimates and n > MAX_ERROR_STEPS:
    details['expected_error_vs_dp_sgd'] = f'not computed (n = {n} > {MAX_ERROR_STEPS})'
  elif estimates:
    full = sensitivity(strategy, sampler.mf_patterns, _period(sampler), n)
    details['expected_error_vs_dp_sgd'] = strategy.expected_error(
      sensitivity=full.value, dp_sgd_sensitivity=math.sqrt(_dp_sgd_participations(sampler, n))
    )
    details['expected_error_note'] = (
      f'over the n = {n} steps, relative to DP-SGD (C = I) with the same participations, '
      'unamplified, at the same sigma / sensitivity (the same epsilon)'
    )
  return acct.report(steps, eps, details)
