"""η: how far float rounding can move the noised sum beyond C, and the sum that η is about.

DP-SGD's accounting assumes that adding or removing one example moves the sum that is
noised, S = Σ_i w_i·clip_C(g_i), by at most C in L2. dpjax clips every example at C exactly
(min(1, C/‖g_i‖)·g_i) and pays for floating point in ε instead: the accountant takes the
sensitivity C(1 + η), i.e. it accounts the Gaussian mechanism with noise multiplier
σ/(1 + η) while the noise that runs has std σ·C (`accounting.Accountant(sensitivity=1 + η)`).

The bound. Let x_j be example j's contribution as the weighted pass forms it (f_j·ĝ_j, with
f_j = min(1, C/ñ_j) from the computed norm ñ_j), u = 2⁻²⁴ (sums accumulate in float32 in
every precision mode) and γ_n = nu/(1 − nu). One logical step sums at most B rows: a
reduction over each physical batch's rows whose every term passes through at most
h = ⌈log₂ B⌉ additions (plus one rounding for the product f_j·ĝ_j), then a compensated
(Kahan) sum of the K ≤ B physical batches (`accumulator`). Per coordinate (Higham 2002,
"Accuracy and Stability of Numerical Algorithms", Lemma 3.1 and §4.2 for the tree; Knuth,
TAOCP vol. 2, §4.2.2 ex. 19, and Higham §4.3 for Kahan's 2u + O(Ku²), taken as 2u + 8Ku²):

  |Ŝ − Σ_j x_j| ≤ α·Σ_j |x_j|,   α = γ_{h+1} + (2u + 8Ku²)(1 + γ_{h+1}),

so ‖Ŝ − Σ_j x_j‖ ≤ α·Σ_j ‖x_j‖ (triangle inequality over the coordinates' absolute values).
With ‖x_j‖ ≤ C(1 + m), m the per-example margin of the matmul format (`precision.clip_margin`:
float32 9.5e-7, TF32 7.8e-3, bfloat16 6.5e-2), and rows computed the same whatever their
position in the batch, neighbours D and D' = D ∖ {i} (at most B and B − 1 rows) give

  ‖Ŝ(D) − Ŝ(D')‖ ≤ ‖x_i‖ + α(2B − 1)·C(1 + m) ≤ C(1 + η),  1 + η = (1 + m)(1 + α(2B − 1)).

Other neighbouring relations scale alike: every sensitivity k·C of an accounted event
becomes at most k·C(1 + η). η: 7.3e-3 at B = 4,096 in float32 (1.5e-4 at B = 128).

What is a proof and what is a model:
  * A proof in the standard model of IEEE arithmetic (round to nearest, no overflow; the
    gradual-underflow error, ≤ 2⁻¹⁴⁹ per operation, is ignored): the tree, the product, Kahan's
    sum and the triangle inequality, for the vmap path (`tree_row_sum` over the rows of
    per-example gradients; XLA:CPU's own dot accumulates its rows in sequence, depth P).
  * A rounding model: (a) ñ_j is within the margin m of the norm of what the weighted pass
    sums (XLA:CPU reduces a long axis in 32 interleaved sequential chains, whose worst case
    γ_{d/32} for d parameters exceeds κu = 8u: the model takes the typical, not the worst,
    error); (b) ghost clipping's book-kept sums are XLA GEMMs over (rows × positions), which
    accumulate in sequence along that contraction on the CPU, and whose error scales with
    Σ_j f_j·Σ_s‖a_js‖‖δ_js‖ rather than Σ_j‖x_j‖: the model takes the tree's α for them (each
    example's own share of that error is covered by the ghost rules' cancellation
    allowances, per example); (c) with data parallelism, the cross-device all-reduce of the
    ghost path adds its own depth (a ring sums D partial sums in sequence).
  Measured: the excess over C is ~3e-5 at B = 4,096 (tests/privacy/test_sum_sensitivity.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.privacy import precision as precision_lib

UNIT_ROUNDOFF = 2.0**-24  # float32: every mode accumulates in float32.
KAHAN_SECOND_ORDER = 8  # Kahan's error per term: 2u + KAHAN_SECOND_ORDER·K·u².


def gamma(n: int, u: float = UNIT_ROUNDOFF) -> float:
  """γ_n = nu / (1 − nu): the relative error bound of n roundings (Higham 2002, Lemma 3.1)."""
  return n * u / (1 - n * u)


def check_max_rows(max_rows) -> int:
  if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)) or max_rows < 1:
    raise ValueError(f'max_batch_size must be an integer >= 1, got {max_rows!r}.')
  return int(max_rows)


def sum_error_per_row(max_rows: int) -> float:
  """α: |Ŝ − Σ_j x_j| ≤ α·Σ_j|x_j| per coordinate for a logical step of at most B rows."""
  b = check_max_rows(max_rows)
  tree = gamma(math.ceil(math.log2(b)) + 1)  # Depth ⌈log₂ B⌉ ≥ ⌈log₂ P⌉, and the product.
  kahan = 2 * UNIT_ROUNDOFF + KAHAN_SECOND_ORDER * b * UNIT_ROUNDOFF**2
  return tree + kahan * (1 + tree)


def eta(max_rows: int, matmul_format: str) -> float:
  """η with 1 + η = (1 + m)(1 + α(2B − 1)) for the cap B and a matmul format (docstring)."""
  if matmul_format not in precision_lib.UNIT_ROUNDOFF:
    raise ValueError(
      f'matmul format {matmul_format!r}; valid: {", ".join(precision_lib.UNIT_ROUNDOFF)}.'
    )
  b = check_max_rows(max_rows)
  margin = precision_lib.format_margin(matmul_format)
  return (1 + margin) * (1 + sum_error_per_row(b) * (2 * b - 1)) - 1


@dataclasses.dataclass(frozen=True)
class Rounding:
  """The float rounding a run's ε pays for: η of a cap B and a matmul format.

  Attributes:
    max_batch_size: B, the most rows one logical step sums.
    matmul_format: 'float32', 'tf32' or 'bfloat16' (`precision.matmul_format`).
    eta: η; the accountant uses the sensitivity C(1 + η).
  """

  max_batch_size: int
  matmul_format: str
  eta: float

  @classmethod
  def of(
    cls, max_batch_size: int, precision: str = 'default', platform: str | None = None
  ) -> Rounding:
    """The Rounding of a cap B, a precision mode and the platform that runs (None: this one)."""
    fmt = precision_lib.matmul_format(precision, platform)
    return cls(check_max_rows(max_batch_size), fmt, eta(max_batch_size, fmt))

  @property
  def sensitivity(self) -> float:
    """1 + η: the noised sum's L2 sensitivity in units of C."""
    return 1.0 + self.eta

  def describe(self, epsilon_cost: float | None = None) -> str:
    """'η = 7.3e-03 (float rounding of the sum, B = 4096, float32 matmuls) costs Δε = 0.0188'."""
    text = (
      f'η = {self.eta:.2g} (float rounding of the sum, B = {self.max_batch_size}, '
      f'{self.matmul_format} matmuls)'
    )
    return text if epsilon_cost is None else f'{text} costs Δε = {epsilon_cost:.3g}'


def kahan_add(total: Any, compensation: Any, g: Any) -> tuple[Any, Any]:
  """(total + g, its compensation) by Kahan's algorithm (Higham 2002, §4.3): over K additions
  the error is (2u + O(K·u²))·Σ|terms|, not O(K·u). Start from zeros."""

  def add(s, c, x):
    y = x - c
    t = s + y
    return t, (t - s) - y

  pairs = jax.tree.map(add, total, compensation, g)
  outer = jax.tree.structure(total)
  return jax.tree.transpose(outer, jax.tree.structure((0, 0)), pairs)


def tree_row_sum(x: jax.Array) -> jax.Array:
  """Σ_i x[i] over the leading axis as a balanced binary tree of float adds (depth ⌈log₂ n⌉).

  XLA keeps the order of explicit adds (it does not reassociate floating point), so the
  rounding error is ≤ γ_⌈log₂ n⌉·Σ_i|x[i]| whatever the backend; an odd level gets an exact
  zero row.
  """
  while x.shape[0] > 1:
    if x.shape[0] % 2:
      x = jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])
    half = x.shape[0] // 2
    x = x[:half] + x[half:]
  return x[0]


def weighted_row_sum(factor: jax.Array, g: jax.Array, keep: jax.Array) -> jax.Array:
  """Σ_i factor_i · g_i over the leading axis by `tree_row_sum`; rows where keep is False add
  exact zeros (no 0 · NaN)."""
  shape = (-1,) + (1,) * (g.ndim - 1)
  return tree_row_sum(jnp.where(keep.reshape(shape), g, 0.0) * factor.reshape(shape))
