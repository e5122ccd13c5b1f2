"""The noise mechanisms a `PrivacyPlan` runs: DP-SGD's Gaussian and BandMF's banded correlated
noise (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization"): the strategy's
coefficients, the `noise.Privatizer` that runs them, and their fields in the fingerprint.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from dpjax.privacy import correlated_noise
from dpjax.privacy import noise as noise_lib
from dpjax.privacy.correlated import bandmf
from dpjax.privacy.correlated import expected_error

# BandMF's coefficients are optimised over at most this many steps: the n × n workload matrix
# of the optimiser (`correlated.expected_error.lag_gram`) is then ≤ 32 MB, and a b-banded
# Toeplitz strategy's coefficients settle as n grows (McKenna 2024, "Scaling up the amplified
# banded matrix factorization mechanism"). Any unit-norm coefficients are private alike.
MAX_OPTIMISED_STEPS = 2048


@functools.lru_cache(maxsize=32)
def banded_coefficients(num_steps: int, num_bands: int) -> tuple[float, ...]:
  """BandMF's c_0..c_{b−1}: the b-banded Toeplitz strategy minimising the prefix-sum error
  over min(T, MAX_OPTIMISED_STEPS) steps (`correlated.bandmf.optimize`), unit ℓ2 norm (each
  participation's column has norm 1); () for one band (DP-SGD, C = I)."""
  if num_bands == 1:
    return ()
  steps = min(int(num_steps), MAX_OPTIMISED_STEPS)
  if num_bands > steps:
    raise ValueError(f"num_bands = {num_bands} must be <= the run's steps T = {num_steps}.")
  coefs = np.asarray(bandmf.optimize(steps, num_bands), dtype=np.float64)
  return tuple(float(c) for c in coefs / np.sqrt(np.sum(coefs**2)))


def fingerprint(noise: str, num_bands: int, num_steps: int) -> dict[str, Any]:
  """The fingerprint's fields of the noise mechanism: none for DP-SGD's Gaussian (as before
  correlated noise existed), else its name, bands and coefficients."""
  if noise == 'gaussian':
    return {}
  return {
    'privacy.noise': noise,
    'privacy.num_bands': num_bands,
    'privacy.noise_coefficients': list(banded_coefficients(num_steps, num_bands)),
  }


def coefficients(noise: str, num_steps: int, num_bands: int) -> tuple[float, ...]:
  """The run's strategy coefficients: BandMF's (`banded_coefficients`), () for DP-SGD."""
  return banded_coefficients(num_steps, num_bands) if noise == 'bandmf' else ()


def privatizer(
  coefs: tuple[float, ...],
  noise_multiplier: float,
  clip_norm: float,
  expected_batch_size: float,
  seed: int,
  noise_impl: str = 'threefry',
) -> noise_lib.Privatizer:
  """BandMF's `correlated_noise.BandedPrivatizer` for coefficients, else DP-SGD's Gaussian."""
  args = (noise_multiplier, clip_norm, expected_batch_size, seed)
  if coefs:
    return correlated_noise.BandedPrivatizer.banded(coefs, *args, noise_impl)
  return noise_lib.GaussianPrivatizer.gaussian(*args, noise_impl)


def describe(noise: str, coefs: tuple[float, ...], num_steps: int, num_params: int) -> str:
  """One line for the start of a run: the mechanism, its state's bytes, and the expected
  squared error of the released iterates (prefix sums over min(T, MAX_OPTIMISED_STEPS) steps)
  relative to DP-SGD's at the same σ (`correlated.expected_error`)."""
  if not coefs:
    return f"{noise}: DP-SGD's independent Gaussian noise (one band), no state"
  n = min(int(num_steps), MAX_OPTIMISED_STEPS)
  ratio = expected_error.toeplitz_expected_error(
    coefs, n, 1.0
  ) / expected_error.dp_sgd_expected_error(n)
  state = (len(coefs) - 1) * num_params * 4
  return (
    f'BandMF, {len(coefs)} bands (banded matrix factorisation, Choquette-Choo et al. 2023): '
    f'state {len(coefs) - 1} x {num_params:,} parameters x 4 B = {state / 1e6:.3g} MB; '
    f"expected error of the released iterates {ratio:.3g}x DP-SGD's at the same sigma "
    f'(prefix sums over {n} steps)'
  )


def record(privatizer: noise_lib.Privatizer) -> dict[str, Any]:
  """The mechanism a step ran, for checkpoints and the privacy card: its name, and BandMF's
  bands and coefficients."""
  if isinstance(privatizer, correlated_noise.BandedPrivatizer):
    return {
      'name': 'bandmf',
      'bands': privatizer.bands,
      'coefficients': list(privatizer.coefficients),
    }
  return {'name': 'gaussian'}
