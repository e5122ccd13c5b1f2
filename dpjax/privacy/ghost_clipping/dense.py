"""Norm rules of Dense and DenseGeneral: the linear map of `mixed` at S positions per example."""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from dpjax.privacy.ghost_clipping import mixed
from dpjax.privacy.ghost_clipping.registry import register_norm_rule
from dpjax.privacy.ghost_clipping.util import as_tuple

_KERNEL_AND_BIAS = ({'kernel'}, {'kernel', 'bias'})


def _plain_dot(module: nn.Module) -> str:
  if module.dot_general is not None or module.dot_general_cls is not None:
    return f'{type(module).__name__} with a custom dot_general'
  return ''


def _dense_general_check(module: nn.Module) -> str:
  if as_tuple(module.batch_dims):
    return 'DenseGeneral with batch_dims'
  return _plain_dot(module)


def _dense_form(layer) -> str:
  shape = layer.in_aval.shape
  return mixed.linear_form(math.prod(shape[:-1]), shape[-1], layer.out_aval.shape[-1])


def _contracted(module: nn.Module, ndim: int) -> list[int]:
  """DenseGeneral's contracted axes of one example's ndim-D input, sorted as flax does."""
  return sorted(ax % ndim for ax in as_tuple(module.axis))


def _dense_general_form(layer) -> str:
  shape = layer.in_aval.shape
  axes = _contracted(layer.module, len(shape))
  m = math.prod(shape[i] for i in axes)
  s = math.prod(shape) // m
  return mixed.linear_form(s, m, math.prod(layer.out_aval.shape) // s)


def dense_operands(layer, a, d):
  """(a2 [n, S, m], d2 [n, S, c]) of a Dense call: a [n, *lead, m], d [n, *lead, c], the
  leading axes being the S positions."""
  del layer
  n = a.shape[0]
  return a.astype(jnp.float32).reshape(n, -1, a.shape[-1]), d.reshape(n, -1, d.shape[-1])


@register_norm_rule(
  nn.Dense, name='dense', params=_KERNEL_AND_BIAS, check=_plain_dot, form=_dense_form
)
def dense_sq_norms(layer, theta: dict, a, d):
  """a [n, *lead, m], d [n, *lead, c]: the leading axes are the S positions."""
  a2, d2 = dense_operands(layer, a, d)
  return mixed.linear_norms(theta, a, d, mixed.Blocks(lambda k: a2, 1, a2.shape[-1]), d2)


@register_norm_rule(
  nn.DenseGeneral,
  name='dense_general',
  params=_KERNEL_AND_BIAS,
  check=_dense_general_check,
  form=_dense_general_form,
)
def dense_general_sq_norms(layer, theta: dict, a, d):
  """Contracts the layer's `axis` (sorted, as flax does); the other axes are positions."""
  a2, d2 = dense_general_operands(layer, a, d)
  return mixed.linear_norms(theta, a, d, mixed.Blocks(lambda k: a2, 1, a2.shape[-1]), d2)


def dense_general_operands(layer, a, d):
  """(a2 [n, S, m], d2 [n, S, c]) of a DenseGeneral call: its contracted axes (sorted, as
  flax does) flattened into m, the other input axes into the S positions."""
  n = a.shape[0]
  a = a.astype(jnp.float32)
  ndim = a.ndim - 1
  axes = _contracted(layer.module, ndim)
  rest = [i for i in range(ndim) if i not in axes]
  a2 = jnp.transpose(a, [0] + [1 + i for i in rest + axes])
  m = math.prod(a.shape[1 + i] for i in axes)
  a2 = a2.reshape(n, -1, m)
  return a2, d.reshape(n, a2.shape[1], -1)
