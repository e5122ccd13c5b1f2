"""Norm rule of LayerNorm, GroupNorm and RMSNorm: a few parameters per channel, so their
per-example gradients are materialised by a vmapped vjp of the layer itself."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dpjax.privacy.ghost_clipping.registry import register_norm_rule


def _local_statistics(module: nn.Module) -> str:
  if module.axis_name is not None:
    return f'{type(module).__name__} with axis_name (statistics across devices)'
  return ''


@register_norm_rule(
  nn.LayerNorm,
  nn.GroupNorm,
  nn.RMSNorm,
  name='norm',
  check=_local_statistics,
  form=lambda layer: 'per-example vjp',
)
def norm_sq_norms(layer, theta: dict, a, d):
  """Per-example gradients by the layer's vjp, kept: the clipped sum adds these tensors.

  Recomputed in float32 (theta is the float32 master copy) from the captured
  input, bfloat16 under mixed precision: the cotangent takes the dtype of the
  recomputed output, not the forward's (`layer.out_aval`).
  """
  a = a.astype(jnp.promote_types(a.dtype, jnp.float32))

  def one(a_i, d_i):
    out, vjp = jax.vjp(lambda t: layer.module.apply({'params': t}, a_i), theta)
    return vjp(d_i.astype(out.dtype))[0]

  grads = jax.vmap(one)(a, d)
  return tree_sq_norms(grads), grads, None


def tree_sq_norms(grads) -> jax.Array:
  """Σ over the leaves of each example's squared norm [n]."""
  return sum(
    jax.numpy.sum(jax.numpy.square(g.reshape(g.shape[0], -1)), axis=1)
    for g in jax.tree.leaves(grads)
  )
