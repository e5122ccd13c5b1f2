"""How an `Accountant` accounts, as one type: `AccountingOptions`.

  options = AccountingOptions(max_batch_size=B, num_steps=T, monte_carlo_estimate=True)
  acct = Accountant(sampler, noise_multiplier, delta, options)
  acct = Accountant(sampler, noise_multiplier, delta, num_steps=T)  # the same, by field

The fields are public (σ, δ and the sampler are `Accountant`'s own arguments); the sampler's
seed never enters them. Every check that needs no sampler runs here, when the options are
made; those that need N (the group size, δ < 1/N, the cap B, the accountant a sampler
supports) run in `Accountant`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from dpjax.privacy import names
from dpjax.privacy.accounting import cap
from dpjax.privacy.accounting import composition
from dpjax.privacy.accounting import sampler_events
from dpjax.privacy.accounting.random_allocation import RANDOM_ALLOCATION_TIMEOUT
from dpjax.privacy.accounting.step_pld import MAX_GRID_POINTS
from dpjax.privacy.correlated import strategy as strategy_lib


@dataclasses.dataclass(frozen=True)
class AccountingOptions:
  """Which analysis an accountant runs, on which grid, with which estimates beside it.

  Attributes:
    accountant: 'auto', 'pld', 'rdp' or 'monte_carlo' (the sampler class's `accountants`).
    max_batch_size: B, the batcher's cap (required where it truncates: `cap`); None = no cap.
    group_size: k >= 1 (add/remove up to k examples).
    num_steps: the planned run length (used by `final_report`), optional.
    monte_carlo_samples: samples per direction of the Monte-Carlo estimate; None = chosen
      from δ and β so that an estimate exists (`monte_carlo.default_num_samples`).
    beta: the Monte-Carlo failure probability (confidence 1 − β).
    monte_carlo_seed: its seed (fixed, so reports are reproducible).
    monte_carlo_workers: processes drawing its samples (this one included; the estimate does
      not depend on it); None = the available cores, as many as the samples pay to start.
    monte_carlo_estimate: also compute the Monte-Carlo estimate beside the provable balls-
      and-bins ε with `estimates` (opt-in: its samples grow as 1/δ; always for 'monte_carlo').
    random_allocation: force (True, no time limit) / skip (False) random-allocation PLD for
      balls-and-bins; None = attempt it within `random_allocation_timeout` seconds per new
      one-epoch PLD (cached on disk), else the labelled deterministic fallback.
    value_discretization_interval: a fixed PLD grid; None = the grid follows ε (`pld_grid`,
      refined until ε moves by < 0.1 %; the grid is in the report's details).
    pld_coarsening: > 1 stops the grid's refinement at its first jump, unconfirmed
      (calibration searches with 10: a looser valid bound), or multiplies a fixed grid.
    exact_truncation: for Poisson with a cap B, also compute dp_accounting's exact truncated
      event (costly) when the TV penalty is not negligible; False (forced when N bounds
      `sampler.num_rows`): the TV penalty (looser).
    random_allocation_timeout: seconds for a random-allocation PLD; None = no limit.
    max_grid_points: refuse (GridTooLargeError, before allocating) a per-step PLD of more
      grid points × mixture components (`estimate_pld_grid_points`).
    allow_large_delta: accept δ >= 1/N (refused by default: it allows releasing a record).
    prior_runs: the runs whose release this one starts from: ε of the composition.
    sensitivity: 1 + η, the noised sum's sensitivity / C (`dpjax.privacy.rounding`): the
      analyses use σ/(1 + η) (`accounted_noise_multiplier`); reports keep σ.
    noise: the mechanism, 'gaussian' (DP-SGD), 'bandmf' (correlated noise of a banded
      Toeplitz strategy with unit column norms, `dpjax.privacy.correlated_noise`) or 'blt'
      (a buffered linear Toeplitz strategy).
    num_bands: the strategy's bands (1 for 'gaussian'; 'bandmf' is accounted with a sampler
      that amplifies it, `Sampler.amplifies_banded_noise`, when its participations are at
      least num_bands steps apart). With a strategy: its bands (1, the default, reads them).
    strategy: the `correlated.strategy.Strategy` that runs (its kind is `noise`): required
      for 'blt', and for 'bandmf' with a sampler that does not amplify it (accounted by its
      sensitivity, `matrix_mechanism`); the one source of its bands and buffers.
  """

  accountant: str = 'auto'
  max_batch_size: int | None = cap.CAP_NOT_GIVEN
  group_size: int = 1
  num_steps: int | None = None
  monte_carlo_samples: int | None = None
  beta: float = 1e-3
  monte_carlo_seed: int = 0
  monte_carlo_workers: int | None = None
  monte_carlo_estimate: bool = False
  random_allocation: bool | None = None
  value_discretization_interval: float | None = None
  pld_coarsening: float = 1.0
  exact_truncation: bool = True
  random_allocation_timeout: float | None = RANDOM_ALLOCATION_TIMEOUT
  max_grid_points: int = MAX_GRID_POINTS
  allow_large_delta: bool = False
  prior_runs: Sequence[composition.PriorRun] = ()
  sensitivity: float = 1.0
  noise: str = 'gaussian'
  num_bands: int = 1
  strategy: strategy_lib.Strategy | None = None

  def __post_init__(self):
    """ValueError (one line, naming the option) for any option out of its range."""
    for name in ('num_steps', 'monte_carlo_samples', 'monte_carlo_workers'):
      value = getattr(self, name)
      if value is not None:
        sampler_events.check_positive_int(name, value)
    if not (isinstance(self.beta, (int, float)) and 0 < self.beta < 1):
      raise ValueError(f'beta must be in (0, 1), got {self.beta!r}.')
    check_pld_options(
      self.random_allocation_timeout, self.value_discretization_interval, self.pld_coarsening
    )
    sampler_events.check_positive_int('max_grid_points', self.max_grid_points)
    sampler_events.check_sensitivity(self.sensitivity)
    object.__setattr__(self, 'num_bands', check_noise(self.noise, self.num_bands, self.strategy))
    object.__setattr__(self, 'prior_runs', composition.check_prior_runs(self.prior_runs))

  def given(self) -> dict[str, Any]:
    """The fields that differ from their defaults, as `Accountant` keyword arguments."""
    return {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if getattr(self, f.name) != f.default
    }

  def replace(self, **changes: Any) -> AccountingOptions:
    """These options with `changes` (checked again)."""
    return dataclasses.replace(self, **changes)


def check_noise(noise: str, num_bands: int, strategy=None) -> int:
  """The bands: noise one of NOISES; num_bands an int >= 1, 1 for 'gaussian' and 'blt'; a
  strategy (required for 'blt') of kind `noise` whose bands agree with num_bands (1 reads
  them from it)."""
  if noise not in names.NOISES:
    raise ValueError(f'noise = {noise!r} is unknown; valid: {", ".join(names.NOISES)}.')
  sampler_events.check_positive_int('num_bands', num_bands)
  if noise != 'bandmf' and num_bands != 1:
    raise ValueError(
      f"num_bands = {num_bands} needs noise = 'bandmf' ({noise} noise has no bands to set)."
    )
  if strategy is None:
    if noise == 'blt':
      raise ValueError("noise = 'blt' needs its strategy (strategy=, correlated.strategy.make).")
    return num_bands
  if not isinstance(strategy, strategy_lib.Strategy):
    raise ValueError(f'strategy must be a correlated.strategy.Strategy, got {type(strategy)}.')
  if strategy.kind != noise:
    raise ValueError(f'strategy.kind = {strategy.kind!r} must be noise = {noise!r}.')
  if noise == 'bandmf' and num_bands not in (1, strategy.bands):
    raise ValueError(f"num_bands = {num_bands} must be the strategy's bands = {strategy.bands}.")
  return strategy.bands if noise == 'bandmf' else 1


def check_pld_options(
  random_allocation_timeout, value_discretization_interval, pld_coarsening
) -> None:
  """Timeout None or > 0; discretisation None or a float in (0, 0.1]; coarsening in [1, 100]."""
  if random_allocation_timeout is not None and not (
    isinstance(random_allocation_timeout, (int, float)) and random_allocation_timeout > 0
  ):
    raise ValueError(
      f'random_allocation_timeout must be None (no limit) or seconds > 0, got '
      f'{random_allocation_timeout!r}.'
    )
  if value_discretization_interval is not None and not (
    isinstance(value_discretization_interval, float) and 0 < value_discretization_interval <= 0.1
  ):
    raise ValueError(
      'value_discretization_interval must be None or a float in (0, 0.1], '
      f'got {value_discretization_interval!r}.'
    )
  if not (isinstance(pld_coarsening, (int, float)) and 1 <= pld_coarsening <= 100):
    raise ValueError(f'pld_coarsening must be in [1, 100], got {pld_coarsening!r}.')
