"""A strategy as one typed object: what the privatizer runs and what the accountant reads.

  s = strategy.make('bandmf', num_steps=400, num_bands=4)   # or make('blt', 400, num_buffers=3)
  s.toeplitz_coefs()       # c_0..c_{n−1} of the C that runs (max column norm 1)
  s.privatizer(σ, C, b, seed)                             # the matching noise.Privatizer
  AccountingOptions(noise=s.kind, strategy=s)             # the accountant reads the same C

Normalisation: C has unit max column norm, ‖C[:, t]‖ <= 1 with equality at t = 0 (a Toeplitz
column j holds c_0..c_{n−1−j}, so the norms do not increase). One participation then has
sensitivity exactly 1, which is what both analyses of docs/accounting.md §9 need:
amplified accounting (cyclic Poisson with k >= bands groups; Choquette-Choo, Ganesh, McMahan,
Rush, Thakurta, Xu 2023, "(Amplified) banded matrix factorization", Thm. 4) composes
Poisson-subsampled Gaussians at σ itself, valid only when each participation's column has norm
<= 1; the accounting without amplification reads Δ = max_π ‖C·1_π‖ of this same C (Δ >= 1 for
any participation), so its Gaussian is `GaussianDpEvent(σ/Δ)`. The strategies are optimised
for single participation (`bandmf.optimize`, `blt.optimize` with k = 1), whose sensitivity is
this normalisation: the objective Δ²·‖A C⁻¹‖_F² is then the expected error of what runs.

BandMF: `coefs` c_0..c_{b−1}, ‖c‖₂ = 1. BLT: C = scale·C_blt, C_blt of `decays` θ and `weights`
ω (c_0 = 1, c_t = Σ_i ω_i θ_i^(t−1)); scale = 1/‖(c_0..c_{n−1})‖, so C is normalised for the n
steps it was made for (a longer run would grow its first column: the privatizer refuses steps
>= n). Everything is public: no data enters a strategy.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from dpjax.privacy import checks
from dpjax.privacy.correlated import bandmf
from dpjax.privacy.correlated import blt
from dpjax.privacy.correlated import expected_error as error_lib
from dpjax.privacy.correlated import toeplitz

KINDS = ('bandmf', 'blt')
# `for_run` optimises over at most this many steps: the optimisers' n × n workload matrix
# (`expected_error.lag_gram`) is then ≤ 32 MB, and the coefficients of a banded or buffered
# Toeplitz strategy settle as n grows (McKenna 2024, "Scaling up the amplified banded matrix
# factorization mechanism"). Any coefficients are private alike: only the normalisation over
# the run's T steps (unit max column norm) enters ε, and it is exact.
MAX_OPTIMISED_STEPS = 2048
UNIT_NORM_TOLERANCE = 1e-9  # |max column norm − 1| allowed (float64 normalisation).


def _floats(name: str, values) -> tuple[float, ...]:
  array = np.asarray(values, dtype=np.float64)
  if array.ndim != 1 or not np.all(np.isfinite(array)):
    raise ValueError(f'{name} must be a 1-d sequence of finite numbers, got {values!r}.')
  return tuple(float(v) for v in array)


@dataclasses.dataclass(frozen=True)
class Strategy:
  """A lower-triangular Toeplitz strategy C of n steps with unit max column norm (module
  docstring). Build it with `make` (optimised) or directly (validated).

  Attributes:
    kind: 'bandmf' or 'blt'.
    num_steps: n, the steps it was made (and normalised) for.
    coefs: BandMF's c_0..c_{b−1} (unit ℓ2 norm); () for BLT.
    decays: BLT's θ_i in (0, 1); () for BandMF.
    weights: BLT's ω_i >= 0; () for BandMF.
    scale: BLT's 1/‖(c_0..c_{n−1})‖ of C_blt; 1 for BandMF.
  """

  kind: str
  num_steps: int
  coefs: tuple[float, ...] = ()
  decays: tuple[float, ...] = ()
  weights: tuple[float, ...] = ()
  scale: float = 1.0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f'kind must be one of {", ".join(KINDS)}, got {self.kind!r}.')
    checks.check_int('num_steps', self.num_steps, 1)
    for name in ('coefs', 'decays', 'weights'):
      object.__setattr__(self, name, _floats(name, getattr(self, name)))
    if self.kind == 'bandmf':
      if self.decays or self.weights or self.scale != 1.0:
        raise ValueError('decays, weights and scale are BLT parameters: bandmf takes coefs only.')
      c = toeplitz.check_coefs(self.coefs)
      if c.size > self.num_steps:
        raise ValueError(f'coefs must hold <= num_steps = {self.num_steps} bands, got {c.size}.')
    else:
      if self.coefs:
        raise ValueError('coefs is a BandMF parameter: blt takes decays, weights and scale.')
      blt.check_blt(self.decays, self.weights)
      checks.check_number('scale', self.scale, low=0.0)
    norm = float(np.linalg.norm(self.toeplitz_coefs()))
    if abs(norm - 1.0) > UNIT_NORM_TOLERANCE:
      what = 'coefs' if self.kind == 'bandmf' else 'scale'
      raise ValueError(f'{what} must give C unit max column norm, got {norm!r}.')

  @property
  def bands(self) -> int:
    """b for BandMF; n for BLT (not banded)."""
    return len(self.coefs) if self.kind == 'bandmf' else self.num_steps

  @property
  def state_vectors(self) -> int:
    """Parameter-sized arrays the privatizer keeps: b − 1 (BandMF) or d buffers (BLT)."""
    return len(self.coefs) - 1 if self.kind == 'bandmf' else len(self.decays)

  def toeplitz_coefs(self) -> np.ndarray:
    """c_0..c_{n−1} of the normalised C (float64; its first column)."""
    if self.kind == 'bandmf':
      return toeplitz.padded(self.coefs, self.num_steps)
    return self.scale * blt.coefs(
      blt.BLT(np.array(self.decays), np.array(self.weights)), self.num_steps
    )

  def dense(self) -> np.ndarray:
    """The n × n C (float64)."""
    return toeplitz.dense(self.toeplitz_coefs(), self.num_steps)

  def expected_error(
    self, workload=None, *, sensitivity: float = 1.0, dp_sgd_sensitivity: float = 1.0
  ) -> float:
    """Δ²·‖A C⁻¹‖_F² / (Δ_SGD²·‖A‖_F²): the expected squared error of the released iterates
    relative to DP-SGD's at the same σ/Δ, so at the same ε (`expected_error`; workload A
    default prefix sums). Defaults: single participation (Δ = 1 for both)."""
    n = self.num_steps
    mf = error_lib.toeplitz_expected_error(self.toeplitz_coefs(), n, sensitivity, workload)
    return mf / error_lib.expected_error(np.eye(n), dp_sgd_sensitivity, workload)

  def privatizer(
    self,
    noise_multiplier: float,
    clip_norm: float,
    expected_batch_size: float,
    seed: int,
    noise_impl: str = 'threefry',
  ):
    """The `noise.Privatizer` that runs this C: `BandedPrivatizer` or `BLTPrivatizer`."""
    from dpjax.privacy import correlated_noise  # pylint: disable=g-import-not-at-top

    if self.kind == 'bandmf':
      return correlated_noise.BandedPrivatizer.banded(
        self.coefs, noise_multiplier, clip_norm, expected_batch_size, seed, noise_impl
      )
    return correlated_noise.BLTPrivatizer.blt(
      self.decays,
      self.weights,
      self.scale,
      self.num_steps,
      noise_multiplier,
      clip_norm,
      expected_batch_size,
      seed,
      noise_impl,
    )


def make(
  kind: str,
  num_steps: int,
  *,
  num_bands: int | None = None,
  num_buffers: int | None = None,
  workload=None,
) -> Strategy:
  """The strategy of `kind` optimised for n = num_steps steps and single participation (the
  normalisation of the module docstring), for the workload A (default prefix sums).

  BandMF needs num_bands b in [1, n] (b = 1 is DP-SGD, C = I); BLT needs num_buffers d >= 1
  and n >= 2. The other count must be left out.
  """
  if kind not in KINDS:
    raise ValueError(f'kind must be one of {", ".join(KINDS)}, got {kind!r}.')
  n = checks.check_int('num_steps', num_steps, 1)
  if kind == 'bandmf':
    if num_buffers is not None:
      raise ValueError(f'num_buffers is a BLT count; bandmf takes num_bands, got {num_buffers!r}.')
    if num_bands is None:
      raise ValueError('num_bands must be given for bandmf (an integer in [1, num_steps]).')
    b = checks.check_int('num_bands', num_bands, 1, n)
    c = bandmf.optimize(n, b, workload)
    return Strategy('bandmf', n, coefs=tuple(c / np.linalg.norm(c)))
  if num_bands is not None:
    raise ValueError(f'num_bands is a BandMF count; blt takes num_buffers, got {num_bands!r}.')
  if num_buffers is None:
    raise ValueError('num_buffers must be given for blt (an integer >= 1).')
  d = checks.check_int('num_buffers', num_buffers, 1)
  checks.check_int('num_steps', n, 2)
  found = blt.optimize(n, d, workload)
  scale = 1.0 / math.sqrt(float(np.sum(blt.coefs(found, n) ** 2)))
  return Strategy('blt', n, decays=tuple(found.decays), weights=tuple(found.weights), scale=scale)


@functools.lru_cache(maxsize=32)
def for_run(
  kind: str, num_steps: int, *, num_bands: int | None = None, num_buffers: int | None = None
) -> Strategy:
  """The strategy a run of T = num_steps steps runs and is accounted with: `make` over
  min(T, MAX_OPTIMISED_STEPS) steps (prefix sums), then normalised for all T steps (BandMF's
  unit-norm coefficients hold for any T >= b; BLT's scale is recomputed over T). Equal to
  `make(kind, T, ...)` for T <= MAX_OPTIMISED_STEPS."""
  n = checks.check_int('num_steps', num_steps, 1)
  if n <= MAX_OPTIMISED_STEPS:
    return make(kind, n, num_bands=num_bands, num_buffers=num_buffers)
  small = make(kind, MAX_OPTIMISED_STEPS, num_bands=num_bands, num_buffers=num_buffers)
  if kind == 'bandmf':
    return Strategy('bandmf', n, coefs=small.coefs)
  found = blt.BLT(np.array(small.decays), np.array(small.weights))
  scale = 1.0 / math.sqrt(float(np.sum(blt.coefs(found, n) ** 2)))
  return Strategy('blt', n, decays=small.decays, weights=small.weights, scale=scale)


def iterate_error(run_strategy: Strategy | None, num_steps: int, noise_std: float) -> float | None:
  """The mean squared error per coordinate of the released SGD iterates (prefix sums of the
  noisy mean gradients) for noise std `noise_std` on each mean (σ·C/b): noise_std²·‖A C⁻¹‖²/n,
  (n + 1)/2 for DP-SGD (None: C = I), that × `expected_error()` for a strategy of n steps (None
  above MAX_OPTIMISED_STEPS steps: its n × n matrices). Compares mechanisms at a target ε."""
  n = checks.check_int('num_steps', num_steps, 1)
  dp_sgd = noise_std**2 * (n + 1) / 2
  if run_strategy is None:
    return dp_sgd
  return dp_sgd * run_strategy.expected_error() if n <= MAX_OPTIMISED_STEPS else None
