"""Norm rule of LoRA-adapted Dense and DenseGeneral layers (Hu et al. 2022, `privacy.lora`).

A targeted layer computes z = a·W' + b with W' = W + s·A·B (W frozen, s = α/r). With a_i
[S, m] its input and δ_i [S, c] its output gradient (`dense.dense_operands`), example i's
gradients are

  ∂A_i = s · a_iᵀ (δ_i Bᵀ)   [m, r],     ∂B_i = s · (a_i A)ᵀ δ_i   [r, c],     ∂b_i = Σ_s δ_s,

i.e. those of two linear maps: input a with output gradient s·δBᵀ, and input s·aA with
output gradient δ. Their squared norms are the linear rule's (`mixed.linear_norms`: the
ghost form Σ_{s,s'} (a_s·a_s')(δ_s·δ_s') of Goodfellow 2015 and Li et al. 2022, "Large
Language Models Can Be Strong Differentially Private Learners", or materialised, whichever
is cheaper, Bu et al. 2022; with the cancellation allowance for S > 1), and the clipped sum
is book-kept from the same operands: Σ_i f_i ∂A_i = aᵀ(f·s·δBᵀ), Σ_i f_i ∂B_i = (s·aA)ᵀ(f·δ).
W is never read: the base may be frozen, sharded, or anything else.

The scale s is the one the coverage analysis recorded for the call (`Layer.lora_scale`,
from `lora.scale_of` while `FineTuneModel.apply` ran); a call reading LoRA factors without
one is refused. This module wraps the Dense and DenseGeneral rules (importing it after
`dense` is what registers it): plain kernels keep their rule.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from dpjax.privacy import lora
from dpjax.privacy.ghost_clipping import dense
from dpjax.privacy.ghost_clipping import mixed
from dpjax.privacy.ghost_clipping.registry import RULES

FACTOR_A, FACTOR_B = 'kernel' + lora.LORA_A, 'kernel' + lora.LORA_B
_LORA_PARAMS = (frozenset({FACTOR_A, FACTOR_B}), frozenset({FACTOR_A, FACTOR_B, 'bias'}))
HIGHEST = mixed.HIGHEST


def lora_sq_norms(operands, layer, theta: dict, a, d):
  """(‖g_i‖² [n], None, weighted_sum) of a LoRA-adapted call (module docstring).

  operands: the layer family's `(layer, a, d) -> (a2 [n, S, m], d2 [n, S, c])`.
  """
  s = layer.lora_scale
  if s is None:
    raise ValueError(
      f'{"/".join(layer.param_path)}: LoRA factors read outside FineTuneModel.apply '
      '(no scale recorded); ghost clipping cannot weigh them.'
    )
  a2, d2 = operands(layer, a, d)
  factor_a, factor_b = theta[FACTOR_A], theta[FACTOR_B]
  d_a = s * jnp.einsum('nsc,rc->nsr', d2, factor_b, precision=HIGHEST)  # Output grad of A.
  a_b = s * jnp.einsum('nsm,mr->nsr', a2, factor_a, precision=HIGHEST)  # Input of B.
  blocks = lambda x: mixed.Blocks(lambda k: x, 1, x.shape[-1])
  sq_a, _, _ = mixed.linear_norms({'kernel': factor_a}, a2, d_a, blocks(a2), d_a)
  theta_b = {'kernel': factor_b, **({'bias': theta['bias']} if 'bias' in theta else {})}
  sq_b, _, _ = mixed.linear_norms(theta_b, a_b, d2, blocks(a_b), d2)

  def weighted_sum(factor, keep) -> dict:
    """Σ_i factor_i · g_i; rows with keep_i False add exactly zero (0·NaN never happens)."""
    rows = keep[:, None, None]
    f = jnp.where(rows, factor[:, None, None], 0.0)
    x, x_b = jnp.where(rows, a2, 0.0), jnp.where(rows, a_b, 0.0)
    ct_a, ct = jnp.where(rows, d_a, 0.0) * f, jnp.where(rows, d2, 0.0) * f
    out = {
      FACTOR_A: jnp.einsum('nsm,nsr->mr', x, ct_a),
      FACTOR_B: jnp.einsum('nsr,nsc->rc', x_b, ct),
    }
    if 'bias' in theta:
      out['bias'] = jnp.sum(ct, axis=(0, 1))
    return out

  return sq_a + sq_b, None, weighted_sum


def _with_lora(rule, operands):
  """The layer family's rule, taking LoRA factors in place of the kernel too."""

  def sq_norms(layer, theta: dict, a, d):
    if FACTOR_A in theta:
      return lora_sq_norms(operands, layer, theta, a, d)
    return rule.sq_norms(layer, theta, a, d)

  def form(layer) -> str:
    text = rule.form(layer)
    return f'LoRA s={layer.lora_scale:g} of {text}' if FACTOR_A in layer.param_names else text

  return dataclasses.replace(rule, sq_norms=sq_norms, form=form, also=rule.also + (_LORA_PARAMS,))


for _type, _operands in (
  (nn.Dense, dense.dense_operands),
  (nn.DenseGeneral, dense.dense_general_operands),
):
  RULES[_type] = _with_lora(RULES[_type], _operands)
