"""Numeric precision of the DP step (`config.precision`) and its per-example margin.

Modes:
  'default': the backend's default matmul precision for float32 (float32 on
    the CPU, TF32 on recent NVIDIA GPUs, one bfloat16 pass on TPUs).
  'highest': float32 matmuls everywhere (`jax.default_matmul_precision`).
  'bfloat16': mixed precision: float32 master weights and optimiser state;
    the forward and backward passes compute in bfloat16 (parameters and inputs
    cast on entry to the loss, logits back to float32 for the loss).

The per-example margin, in every mode: each example is clipped at C exactly, f_i = min(1,
C/ñ_i), and its contribution as summed may exceed C by the margin m of the mode, which the
accountant pays for in ε (`dpjax.privacy.rounding`: 1 + η = (1 + m)(1 + the sum's rounding)).
Clipping divides by a norm computed by one computation (the ghost norms, or the norm of the
materialised per-example gradient) and scales a gradient formed by another (the weighted
backward pass: the book-kept weight gradient aᵀ(f·δ), or the rows Σ_i f_i g_i), each rounded
in the mode's precision. With ĝ_i the contribution as the weighted pass forms it and ñ_i
the computed norm, the summed contribution is f_i·ĝ_i, so

  ‖f_i·ĝ_i‖ ≤ C · ‖ĝ_i‖ / ñ_i.

Rounding model (Higham 2002, "Accuracy and Stability of Numerical Algorithms", §3.1: a
computed result carries relative error ≤ γ_k = ku/(1−ku) per chain of k roundings with unit
roundoff u): both computations start from the same captured activations a and output
gradients δ of each layer (or the same materialised g_i), and differ by the roundings of one
matmul / reduction each, so ‖ĝ_i‖ ≤ (1 + κu)‖g_i‖ and ñ_i ≥ (1 − κu)‖g_i‖ with g_i the exact
function of those captured operands. Hence ‖f_i·ĝ_i‖ ≤ C(1 + m),

  m = (1 + κu) / (1 − κu) − 1 = 2κu / (1 − κu).

u is the unit roundoff of the mode's matmul inputs (float32 2^-24, TF32 2^-11, bfloat16
2^-8); κ = KAPPA = 8 allows for the roundings of the inputs, the products and the
accumulation. This is a rounding model, not a worst-case proof (XLA:CPU reduces a long axis
in 32 interleaved sequential chains, whose worst case for d terms is γ_{d/32}): massive
cancellation inside one per-example gradient (‖Σ_s a_sᵀδ_s‖ ≪ Σ_s‖a_s‖‖δ_s‖) would exceed
it, so the ghost rules add an allowance proportional to Σ_s‖a_s‖‖δ_s‖ for it, per example
(`ghost_clipping.mixed.with_allowance`, `conv.ws_allowance`; a weight-standardised conv
computes the examples where its allowance would be loose exactly, `mixed.exact_rows`);
tests/privacy/ghost_clipping/test_ghost_adversarial.py checks every rule at adversarial
parameter states and tests/privacy/test_precision.py measures the worst ratio on real models
in bfloat16 against the margin.

Margins: float32 9.5e-7, TF32 7.8e-3, bfloat16 6.5e-2. Measured on the CPU in bfloat16 (MLP
and CNN, ghost and vmap, 32 clipped examples each): the worst ‖f_i·ĝ_i‖ / C − 1 is 1.3e-7,
because both computations read the same bfloat16 activations and output gradients and
reduce them in float32; the margin is there for backends whose weighted pass rounds its
matmul inputs (TF32 / bfloat16 passes on GPUs and TPUs).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp

PRECISIONS = ('default', 'highest', 'bfloat16')
KAPPA = 8
UNIT_ROUNDOFF = {'float32': 2.0**-24, 'tf32': 2.0**-11, 'bfloat16': 2.0**-8}


def check_precision(precision: str) -> str:
  if precision not in PRECISIONS:
    raise ValueError(f'config.precision = {precision!r}; valid: {", ".join(PRECISIONS)}.')
  return precision


def matmul_format(precision: str, platform: str | None = None) -> str:
  """The number format float32 matmuls effectively use: 'float32', 'tf32' or 'bfloat16'."""
  check_precision(precision)
  if precision == 'bfloat16':
    return 'bfloat16'
  if precision == 'highest':
    return 'float32'
  platform = platform or jax.default_backend()
  return {'cpu': 'float32', 'gpu': 'tf32', 'cuda': 'tf32', 'rocm': 'tf32'}.get(
    platform, 'bfloat16'
  )  # TPU: one bfloat16 pass by default.


def platform_of_format(matmul_format_name: str) -> str:
  """A platform whose 'default' mode uses this matmul format ('float32': cpu, 'tf32': gpu,
  'bfloat16': tpu): each mode then gives the format a run recorded (`matmul_format`)."""
  platforms = {'float32': 'cpu', 'tf32': 'gpu', 'bfloat16': 'tpu'}
  if matmul_format_name not in platforms:
    raise ValueError(f'matmul format {matmul_format_name!r}; valid: {", ".join(platforms)}.')
  return platforms[matmul_format_name]


def traced_matmul_format(dtype: Any = jnp.float32, platform: str | None = None) -> str:
  """The format a matmul of `dtype` operands traced here uses: 'float32', 'tf32' or 'bfloat16'.

  From the dtype (fewer mantissa bits than float32: 'bfloat16', whose u bounds
  float16's too) and jax's default matmul precision at trace time (what
  `matmul_precision` / `jax.default_matmul_precision` set): 'highest',
  'float32' and the F32/F64 dot algorithms give float32; 'high',
  'tensorfloat32' and the TF32 or multi-pass bfloat16 algorithms TF32 (an upper
  bound for the latter); unset, 'default' and 'bfloat16' the platform's
  default (`matmul_format('default')`); any other algorithm bfloat16.
  """
  if jnp.finfo(dtype).nmant < jnp.finfo(jnp.float32).nmant:
    return 'bfloat16'
  setting = jax.config.jax_default_matmul_precision
  setting = None if setting is None else str(setting).upper()
  if setting in ('HIGHEST', 'FLOAT32', 'F32_F32_F32', 'F64_F64_F64'):
    return 'float32'
  if setting in (
    'HIGH',
    'TENSORFLOAT32',
    'TF32_TF32_F32',
    'TF32_TF32_F32_X3',
    'BF16_BF16_F32_X3',
    'BF16_BF16_F32_X6',
    'BF16_BF16_F32_X9',
  ):
    return 'tf32'
  if setting in (None, 'DEFAULT', 'BFLOAT16'):
    return matmul_format('default', platform)
  return 'bfloat16'


def format_margin(matmul_format: str) -> float:
  """m = 2κu / (1 − κu) for a matmul format's unit roundoff u (module docstring)."""
  ku = KAPPA * UNIT_ROUNDOFF[matmul_format]
  return 2 * ku / (1 - ku)


def clip_margin(precision: str, platform: str | None = None) -> float:
  """The per-example margin m of a precision mode on a platform (None: this one)."""
  return format_margin(matmul_format(precision, platform))


def matmul_precision(precision: str):
  """A context manager fixing jax's default matmul precision while a step is traced."""
  check_precision(precision)
  if precision == 'highest':
    return jax.default_matmul_precision('highest')
  return contextlib.nullcontext()


def compute_dtype(precision: str) -> Any:
  """dtype of the forward and backward computation (parameters stay float32)."""
  return jnp.bfloat16 if check_precision(precision) == 'bfloat16' else jnp.float32


def cast_floats(tree: Any, dtype: Any) -> Any:
  """Floating-point leaves of `tree` cast to dtype; integer leaves (tokens, labels) unchanged."""
  return jax.tree.map(
    lambda v: v.astype(dtype) if jnp.issubdtype(jnp.result_type(v), jnp.floating) else v, tree
  )
