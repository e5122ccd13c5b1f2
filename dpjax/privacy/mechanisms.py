"""The noise mechanisms a `PrivacyPlan` runs: DP-SGD's Gaussian, or correlated noise of a
matrix-factorisation strategy (BandMF: Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
Factorization"; BLT: Dvijotham et al. 2024, "Efficient and near-optimal noise generation for
streaming differential privacy"): the run's `correlated.strategy.Strategy`, the privatizer that
runs it, its fields in the fingerprint and in checkpoints, and its line at the start of a run.

The strategy is made once per run (`strategy`) and handed to both the accountant
(`AccountingOptions.strategy`) and the step (`PrivacyPlan.mechanism`), so they cannot disagree.
"""

from __future__ import annotations

from typing import Any

from dpjax.privacy import correlated_noise
from dpjax.privacy import noise as noise_lib
from dpjax.privacy.correlated import strategy as strategy_lib


def strategy(
  noise: str, num_steps: int, num_bands: int = 1, num_buffers: int = 1
) -> strategy_lib.Strategy | None:
  """The run's strategy for T = num_steps steps (`correlated.strategy.for_run`): None for
  DP-SGD (Gaussian, or BandMF with one band: C = I)."""
  if noise == 'gaussian' or (noise == 'bandmf' and num_bands == 1):
    return None
  if noise == 'bandmf':
    return strategy_lib.for_run('bandmf', num_steps, num_bands=num_bands)
  return strategy_lib.for_run('blt', num_steps, num_buffers=num_buffers)


def fingerprint(noise: str, run_strategy: strategy_lib.Strategy | None) -> dict[str, Any]:
  """The fingerprint's fields of the mechanism: none for DP-SGD's Gaussian (as before correlated
  noise existed), else its name and its strategy's parameters."""
  if noise == 'gaussian':
    return {}
  return {'privacy.noise': noise, 'privacy.noise_strategy': describe_strategy(run_strategy)}


def describe_strategy(run_strategy: strategy_lib.Strategy | None) -> dict[str, Any]:
  """The strategy's public parameters (JSON): kind, n and coefficients or buffers."""
  if run_strategy is None:
    return {'kind': 'identity (DP-SGD)'}
  s = run_strategy
  if s.kind == 'bandmf':
    return {
      'kind': 'bandmf',
      'num_steps': s.num_steps,
      'bands': s.bands,
      'coefficients': list(s.coefs),
    }
  return {
    'kind': 'blt',
    'num_steps': s.num_steps,
    'buffers': len(s.decays),
    'decays': list(s.decays),
    'weights': list(s.weights),
    'scale': s.scale,
  }


def privatizer(
  run_strategy: strategy_lib.Strategy | None,
  noise_multiplier: float,
  clip_norm: float,
  expected_batch_size: float,
  seed: int,
  noise_impl: str = 'threefry',
) -> noise_lib.Privatizer:
  """The strategy's privatizer (`Strategy.privatizer`), or DP-SGD's Gaussian for None."""
  args = (noise_multiplier, clip_norm, expected_batch_size, seed, noise_impl)
  if run_strategy is None:
    return noise_lib.GaussianPrivatizer.gaussian(*args)
  return run_strategy.privatizer(*args)


def record(privatizer_: noise_lib.Privatizer) -> dict[str, Any]:
  """The mechanism a step ran, for checkpoints and the privacy card, read from its privatizer."""
  if isinstance(privatizer_, correlated_noise.BandedPrivatizer):
    return {
      'name': 'bandmf',
      'bands': privatizer_.bands,
      'coefficients': list(privatizer_.coefficients),
    }
  if isinstance(privatizer_, correlated_noise.BLTPrivatizer):
    return {
      'name': 'blt',
      'num_steps': privatizer_.num_steps,
      'decays': list(privatizer_.decays),
      'weights': list(privatizer_.weights),
      'scale': privatizer_.scale,
    }
  return {'name': 'gaussian'}


def describe(run_strategy: strategy_lib.Strategy | None, num_params: int) -> str:
  """One line for the start of a run: the mechanism, its state's bytes, and the expected squared
  error of the released iterates (prefix sums) relative to DP-SGD's at the same σ."""
  if run_strategy is None:
    return "DP-SGD's independent Gaussian noise (C = I), no state"
  s = run_strategy
  name = f'BandMF, {s.bands} bands' if s.kind == 'bandmf' else f'BLT, {len(s.decays)} buffers'
  vectors = s.state_vectors
  line = (
    f'{name} (matrix factorisation, {s.num_steps} steps): state {vectors} x {num_params:,} '
    f'parameters x 4 B = {vectors * num_params * 4 / 1e6:.3g} MB'
  )
  if s.num_steps <= strategy_lib.MAX_OPTIMISED_STEPS:
    line += f"; expected error of the released iterates {s.expected_error():.3g}x DP-SGD's at the same sigma"
  return line


def state_setting(privatizer_: noise_lib.Privatizer) -> tuple[str, int, int]:
  """(the config field that sizes a correlated-noise state, its value, the parameter-sized
  arrays the state holds): BandMF ('privacy.num_bands', b, b − 1), BLT ('privacy.num_buffers',
  d, d)."""
  if isinstance(privatizer_, correlated_noise.BLTPrivatizer):
    return 'privacy.num_buffers', len(privatizer_.decays), len(privatizer_.decays)
  return 'privacy.num_bands', privatizer_.bands, privatizer_.bands - 1
