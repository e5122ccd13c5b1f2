"""Norm rules of convolutions: nn.Conv, and the weight-standardised conv rule models register.

A convolution is the linear map of `mixed` with a = the input patches (one
row per output position), never formed: the input is visited one kernel
offset at a time (`Blocks`). A weight-standardised conv (W' = T(kernel,
gain), Qiao et al. 2019, De et al. 2022) applies T's vjp to the materialised
per-example gradients, or in the ghost form uses a closed form per output
channel with a cancellation allowance where it is tight and exact per-example
gradients where it is not (`ws_conv_sq_norms`); the model that defines
such a layer registers it with `ws_conv_sq_norms` (dpjax.models.layers.WSConv
does), so this module imports no model.
"""

from __future__ import annotations

from collections.abc import Sequence
import itertools
import math
from typing import NamedTuple

import flax.linen as nn
from flax.linen import linear as nn_linear
import jax
import jax.numpy as jnp
import numpy as np

from dpjax.privacy import precision
from dpjax.privacy import rounding
from dpjax.privacy.ghost_clipping import mixed
from dpjax.privacy.ghost_clipping.mixed import Blocks
from dpjax.privacy.ghost_clipping.mixed import HIGHEST
from dpjax.privacy.ghost_clipping.mixed import per_example_grads
from dpjax.privacy.ghost_clipping.mixed import scan_blocks
from dpjax.privacy.ghost_clipping.normalization import tree_sq_norms
from dpjax.privacy.ghost_clipping.registry import register_norm_rule
from dpjax.privacy.ghost_clipping.util import broadcast as _broadcast

# Convolutions whose patches (all blocks) exceed this are visited by a scan,
# one block at a time; smaller ones are unrolled (faster: no loop overhead).
_UNROLL_BYTES = 16 * 2**20
WS_CONV_PARAMS = ({'kernel', 'gain', 'bias'}, {'kernel', 'gain', 'bias'})


def _conv_check(module: nn.Module) -> str:
  rank = len(module.kernel_size) if not isinstance(module.kernel_size, int) else 1
  padding = nn_linear.canonicalize_padding(module.padding, rank)
  if (
    module.feature_group_count != 1
    or module.mask is not None
    or module.conv_general_dilated is not None
    or module.conv_general_dilated_cls is not None
    or isinstance(padding, str)
    and padding not in ('SAME', 'VALID')
    or any(d != 1 for d in _broadcast(module.input_dilation, rank))
  ):
    return (
      'Conv with feature groups, a mask, input dilation, a '
      f'custom conv or padding {module.padding!r}'
    )
  return ''


def ws_standardise(kernel: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
  """W' = gain · (w − μ) · rsqrt(max(fan_in · var, eps)) per output channel (last axis).

  The operations of dpjax.models.layers.WSConv, so `jax.vjp` of this is the vjp autodiff
  takes through that layer (and vmap's per-example gradients).
  """
  axes = tuple(range(kernel.ndim - 1))
  mean = jnp.mean(kernel, axis=axes, keepdims=True)
  var = jnp.var(kernel, axis=axes, keepdims=True)
  fan_in = math.prod(kernel.shape[:-1])
  return (kernel - mean) * jax.lax.rsqrt(jnp.maximum(var * fan_in, eps)) * gain


# A WS-conv row whose bound Σ_o κ_o‖g_o‖² exceeds this multiple of its norm² (the allowance
# would be loose: g_o nearly in span{1, z_o}) is computed exactly, per example.
LOOSE_RATIO = 2.0


def ws_allowance() -> float:
  """η of `_ws_norms`: 2ε + ε² + ε', ε = KAPPA(u + 2u₃₂), ε' = 4·KAPPA·u₃₂.

  ε bounds the error of the book-kept sum's kernel part relative to its scale √κ_o‖g_o‖ (its
  conv weight gradient rounds in the traced format u of float32 operands,
  `precision.traced_matmul_format`; the centring and projection in float32), ε' that of the
  closed form's terms (float32, HIGHEST).
  """
  u = precision.UNIT_ROUNDOFF[precision.traced_matmul_format(jnp.float32)]
  u32 = precision.UNIT_ROUNDOFF['float32']
  eps_sum = precision.KAPPA * (u + 2 * u32)
  return 2 * eps_sum + eps_sum**2 + 4 * precision.KAPPA * u32


class _WSNorms(NamedTuple):
  kernel_sq: jax.Array  # [n] Σ_o ‖∂w_o‖²: exact if materialised, else the clipped closed form.
  exact: bool  # kernel_sq is the norm of per-example gradients.
  gain: jax.Array  # [n, c] ∂gain_o = z_o·g_o per example (what the clipped sum adds).
  bound: jax.Array | None  # [n] Σ_o κ_o‖g_o‖² ≥ Σ_o ‖∂w_o‖²; None when grads are kept.
  grads: dict | None  # Per-example {kernel, gain} when kept for the sum.


def _ws_norms(
  module: nn.Module, theta: dict, blocks: Blocks, d: jax.Array, keep_grads: bool
) -> _WSNorms:
  """The per-example norms of a `dpjax.models.layers.WSConv` call's kernel and gain.

  dpjax.models.layers.WSConv uses W'_o = gain_o · (w_o − μ_o) · r_o per output channel o,
  r_o = rsqrt(max(ρ_o², eps)), ρ_o² = ‖w_o − μ_o‖² (= fan_in · var). With
  g_o = ∂loss/∂W'_o (a column of the conv's per-example gradient, from the
  input blocks and output gradients d), z_o = (w_o − μ_o)·r_o and
  κ_o = gain_o² r_o²:
    ∂gain_o = z_o·g_o,   ∂w_o = gain_o r_o (P g_o − [ρ_o² > eps] z_o (z_o·g_o)),
    ‖∂w_o‖² = κ_o (‖g_o‖² − (1·g_o)²/m − [ρ_o² > eps] (z_o·g_o)²),
  P the centring projection. ∂gain_o is computed per example (from the same tensors the
  clipped sum adds: exact). The kernel's closed form is a difference of squares: when g_o
  lies nearly in span{1, z_o} (an input nearly constant across channels, e.g. after a norm
  layer with a large bias) ‖∂w_o‖ ≪ ‖g_o‖, and both its rounding and the book-kept sum's
  (the kernel vjp at Σ_i f_i g_i, exact to ~u·√κ_o‖g_o‖, not ~u·‖∂w_o‖) can exceed ‖∂w_o‖.

  Materialised (mixed rule, Bu et al. 2022): ∂w_i = J_Tᵀ g_i by a vmapped vjp of
  `ws_standardise`, its norm taken directly; with keep_grads the clipped sum adds these very
  tensors (norm and sum agree, as with vmap). Otherwise (ghost, or gradients too large to
  keep) the sum is book-kept (`_ws_weighted_sum`) and the kernel's estimate is rigorous up to
  an allowance: per channel, with B_o = κ_o‖g_o‖² ≥ ‖∂w_o‖² (the projection shrinks norms,
  ‖z_o‖ ≤ 1), n̂_o² = clip(closed form or direct norm², 0, B_o) + η B_o, and with the sum's
  error ≤ ε√B_o and the norm's ≤ ε'B_o (`ws_allowance`), n̂_o ≥ ‖∂w_o‖ + ε√B_o ≥ the norm of
  what the sum adds (the rounding model of dpjax.privacy.precision, Higham 2002 §3.1, for
  g_o itself). `ws_conv_sq_norms` adds it where it is tight, and computes the other rows
  exactly.
  """
  w = theta['kernel']
  n, s, c = d.shape
  m = math.prod(w.shape[:-1])
  centred = w.reshape(m, c) - jnp.mean(w.reshape(m, c), axis=0)
  rho2 = jnp.sum(jnp.square(centred), axis=0)
  r = jax.lax.rsqrt(jnp.maximum(rho2, module.eps))
  kappa = jnp.square(theta['gain'] * r)  # [c].
  if not mixed.use_ghost(s, m, c):
    g = per_example_grads(blocks, d)  # [n, m, c].
    _, t_vjp = jax.vjp(lambda k, gn: ws_standardise(k, gn, module.eps), w, theta['gain'])
    dw, dgain = jax.vmap(t_vjp)(g.reshape(n, *w.shape))
    kernel_sq, dgain = tree_sq_norms([dw]), dgain.reshape(n, c)
    if keep_grads:
      return _WSNorms(kernel_sq, True, dgain, None, {'kernel': dw, 'gain': dgain})
    bound = jnp.sum(kappa * jnp.sum(jnp.square(g), axis=1), axis=1)
    return _WSNorms(kernel_sq, True, dgain, bound, None)
  z = (centred * r).reshape(blocks.count, blocks.width, c)  # Rows per block (HWIO).

  def body(carry, b, k):
    gram, total, proj = carry
    return (
      gram + jnp.einsum('nsm,ntm->nst', b, b, precision=HIGHEST),
      total + jnp.sum(b, axis=-1),
      proj + jnp.einsum('nsm,mc->nsc', b, z[k], precision=HIGHEST),
    ), None

  (gram, total, proj), _ = scan_blocks(
    blocks, body, (jnp.zeros((n, s, s)), jnp.zeros((n, s)), jnp.zeros((n, s, c)))
  )
  g_sq = jnp.sum(d * jnp.einsum('nst,ntc->nsc', gram, d, precision=HIGHEST), axis=1)
  ones = jnp.einsum('ns,nsc->nc', total, d, precision=HIGHEST)  # 1·g_o.
  gain = jnp.sum(proj * d, axis=1)  # z_o·g_o.
  ws = kappa * (g_sq - jnp.square(ones) / m - (rho2 > module.eps) * jnp.square(gain))
  # jnp.minimum / maximum keep NaN (the row is then dropped as non-finite).
  ws = jnp.minimum(jnp.maximum(ws, 0.0), kappa * g_sq)
  return _WSNorms(jnp.sum(ws, axis=1), False, gain, jnp.sum(kappa * g_sq, axis=1), None)


def _ws_kernel_grad(module: nn.Module, theta: dict):
  """`(x, ct) -> Σ_rows J_Tᵀ(the conv's weight gradient)`, the kernel part of the WS layer's
  vjp: x [rows, *spatial, C_in] the inputs, ct [rows, *out, c] the cotangents (SAME)."""
  w = theta['kernel']
  rank = w.ndim - 2
  spatial = 'HWD'[:rank]
  numbers = ('N' + spatial + 'C', spatial + 'IO', 'N' + spatial + 'C')
  strides = tuple(_broadcast(module.strides, rank))
  _, t_vjp = jax.vjp(lambda k, gn: ws_standardise(k, gn, module.eps), w, theta['gain'])

  def kernel_grad(x, ct):
    conv = lambda k: jax.lax.conv_general_dilated(x, k, strides, 'SAME', dimension_numbers=numbers)
    return t_vjp(jax.vjp(conv, jnp.zeros_like(w))[1](ct)[0])[0]

  return kernel_grad


def _rows(v: jax.Array, rank: int) -> jax.Array:
  """[n, *lead, *spatial, C] -> [n·lead, *spatial, C] (leading axes join the batch)."""
  return v.reshape(-1, *v.shape[v.ndim - rank - 1 :])


def _ws_weighted_sum(
  kernel_grad,
  theta: dict,
  a: jax.Array,
  d: jax.Array,
  gain: jax.Array,
  bias: jax.Array,
  loose: jax.Array,
  loose_kernel_sq: jax.Array,
):
  """`weighted_sum(factor, keep)` of a WS conv: the kernel by its vjp at the book-kept rows'
  cotangents plus the loose rows' per-example gradients (`mixed.exact_rows`), each scaled to
  at most the norm that clipped it (`loose_kernel_sq`: the recomputation may round otherwise);
  gain and bias from their per-example gradients (`rounding.weighted_row_sum`)."""
  rank = theta['kernel'].ndim - 2
  per_row = lambda v, on: on.reshape((-1,) + (1,) * (v.ndim - 1))

  def example(i):
    g = kernel_grad(
      _rows(jax.lax.dynamic_index_in_dim(a, i), rank),
      _rows(jax.lax.dynamic_index_in_dim(d, i), rank),
    )
    norm = jnp.sqrt(jnp.sum(jnp.square(g)))
    return g * jnp.where(norm > 0, jnp.minimum(1.0, jnp.sqrt(loose_kernel_sq[i]) / norm), 1.0)

  def weighted_sum(factor: jax.Array, keep: jax.Array) -> dict:
    f = jnp.where(keep, factor, 0.0)
    book = keep & ~loose
    ct = jnp.where(per_row(d, book), f.reshape(per_row(d, book).shape) * d, 0.0)
    kernel = kernel_grad(_rows(jnp.where(per_row(a, book), a, 0.0), rank), _rows(ct, rank))
    kernel = kernel + mixed.exact_rows(loose & keep, example, kernel.shape, sum_factor=f)
    out = {'kernel': kernel, 'gain': rounding.weighted_row_sum(factor, gain, keep)}
    if 'bias' in theta:
      out['bias'] = rounding.weighted_row_sum(factor, bias, keep)
    return out

  return weighted_sum


def _conv_blocks(layer, a: jax.Array) -> Blocks:
  """The input blocks of a (WS)conv call; a: [n, *lead, *spatial, C]."""
  module = layer.module
  kernel_size = _broadcast(
    module.kernel_size, 1 if isinstance(module.kernel_size, int) else len(module.kernel_size)
  )
  rank = len(kernel_size)
  if layer.rule.name == 'wsconv':
    padding, dilation = 'SAME', (1,) * rank
  else:
    padding = nn_linear.canonicalize_padding(module.padding, rank)
    dilation = _broadcast(module.kernel_dilation, rank)
  strides = _broadcast(module.strides, rank)
  n = a.shape[0]
  x = a.reshape(-1, *a.shape[a.ndim - rank - 1 :])  # Leading axes -> batch.
  spatial = x.shape[1:-1]
  dilated = [(k - 1) * d + 1 for k, d in zip(kernel_size, dilation)]
  if isinstance(padding, str):
    pads = jax.lax.padtype_to_pads(spatial, dilated, strides, padding)
  else:
    pads = list(padding)
  x = jax.lax.pad(
    x,
    jnp.zeros((), x.dtype),  # Negative pads crop, as in lax.
    [(0, 0, 0)] + [(lo, hi, 0) for lo, hi in pads] + [(0, 0, 0)],
  )
  out = [(size - k) // s + 1 for size, k, s in zip(x.shape[1:-1], dilated, strides)]
  span = [(o - 1) * s + 1 for o, s in zip(out, strides)]
  offsets = np.asarray(
    list(itertools.product(*(range(k) for k in kernel_size))), np.int32
  ) * np.asarray(dilation, np.int32)

  def get(k):
    offset = offsets[k] if isinstance(k, int) else jnp.asarray(offsets)[k]
    start = [0] + list(offset) + [0]
    window = jax.lax.dynamic_slice(x, start, [x.shape[0], *span, x.shape[-1]])
    block = jax.lax.slice(window, [0] * window.ndim, window.shape, [1, *strides, 1])
    return block.reshape(n, -1, block.shape[-1])

  patches_bytes = 4 * x.shape[0] * math.prod(out) * len(offsets) * x.shape[-1]
  return Blocks(get, len(offsets), x.shape[-1], unroll=patches_bytes <= _UNROLL_BYTES)


def patches(
  x: jax.Array, kernel_size: Sequence[int], strides: Sequence[int], padding, dilation: Sequence[int]
) -> jax.Array:
  """Input patches [N, S, prod(kernel_size)·C] of x [N, *spatial, C] (tests)."""
  module = nn.Conv(1, tuple(kernel_size), tuple(strides), padding, kernel_dilation=tuple(dilation))
  from dpjax.privacy.ghost_clipping.coverage import Layer  # pylint: disable=import-outside-toplevel
  from dpjax.privacy.ghost_clipping.registry import RULES  # pylint: disable=import-outside-toplevel

  blocks = _conv_blocks(Layer(None, RULES[nn.Conv], module, (), (), None, None), x[:, None])
  return jnp.concatenate([blocks.get(k) for k in range(blocks.count)], -1)


def _blocks_and_d2(layer, a, d):
  n = a.shape[0]
  blocks = _conv_blocks(layer, a)
  d2 = d.reshape(n, -1, d.shape[-1])
  m = blocks.count * blocks.width
  if blocks.unroll and (d2.shape[1] == 1 or mixed.use_ghost(d2.shape[1], m, d2.shape[-1])):
    # Small, ghost form: one patches matrix, one Gram einsum (and the
    # operands of the book-kept clipped sum).
    a2 = jnp.concatenate([blocks.get(k) for k in range(blocks.count)], -1)
    blocks = Blocks(lambda k: a2, 1, a2.shape[-1])
  return blocks, d2


def _shapes(layer) -> tuple[int, int, int]:
  """(S output positions, m = prod(kernel)·C_in, c) of one example's call."""
  kernel_size = layer.module.kernel_size
  kernel = math.prod((kernel_size,) if isinstance(kernel_size, int) else kernel_size)
  out = layer.out_aval.shape
  return math.prod(out[:-1]), kernel * layer.in_aval.shape[-1], out[-1]


def _conv_form(layer) -> str:
  return mixed.linear_form(*_shapes(layer))


def ws_conv_form(layer) -> str:
  """The form `ws_conv_sq_norms` takes for this call (ghost or materialised, by the mixed rule)."""
  return mixed.linear_form(*_shapes(layer), rank_one=False)


@register_norm_rule(
  nn.Conv, name='conv', params=({'kernel'}, {'kernel', 'bias'}), check=_conv_check, form=_conv_form
)
def conv_sq_norms(layer, theta: dict, a, d):
  """a [n, *lead, *spatial, C]: the leading axes (e.g. augmult views) join the positions."""
  a = a.astype(jnp.float32)
  blocks, d2 = _blocks_and_d2(layer, a, d)
  # Keep materialised per-example gradients for the clipped sum when they are
  # smaller than the input and output gradient they replace.
  return mixed.linear_norms(theta, a, d, blocks, d2, keep_small_grads=True)


def ws_conv_sq_norms(layer, theta: dict, a, d):
  """The norm rule of a weight-standardised conv with SAME padding (`_ws_norms`).

  Rows whose kernel allowance is tight (Σ_o κ_o‖g_o‖² ≤ LOOSE_RATIO · their norm²: it
  over-clips by at most LOOSE_RATIO·`ws_allowance()` / 2 ≈ 4.8e-6 in float32) are book-kept;
  the others are computed exactly, one example at a time (`mixed.exact_rows`), whatever the
  parameters: each example's clipped contribution is within that factor of its exact clip.
  Register it for such a layer: `register_norm_rule(WSConv, name='wsconv',
  params=WS_CONV_PARAMS, form=ws_conv_form)(ws_conv_sq_norms)`; the layer must have the attributes
  `kernel_size`, `strides`, `eps` and parameters kernel, gain, bias, and standardise as
  `ws_standardise` does.
  """
  a = a.astype(jnp.float32)
  blocks, d2 = _blocks_and_d2(layer, a, d)
  bias = jnp.sum(d2, axis=1)
  # Per-example gradients kept for the clipped sum when no larger than the input and
  # output gradient they replace (as for nn.Conv).
  keep = theta['kernel'].size <= a[0].size + d[0].size
  norms = _ws_norms(layer.module, theta, blocks, d2, keep_grads=keep)
  other = jnp.sum(jnp.square(norms.gain), axis=1)  # ∂gain and ∂bias: exact per example.
  if 'bias' in theta:
    other = other + jnp.sum(jnp.square(bias), axis=1)
  sq = norms.kernel_sq + other
  if norms.grads is not None:
    grads = dict(norms.grads)
    if 'bias' in theta:
      grads['bias'] = bias.reshape(bias.shape[0], *theta['bias'].shape)
    return sq, grads, None
  loose = norms.bound > LOOSE_RATIO * sq  # False for NaN: the row is dropped anyway.
  kernel_grad, rank = _ws_kernel_grad(layer.module, theta), theta['kernel'].ndim - 2
  kernel_sq = (
    norms.kernel_sq
    if norms.exact
    else mixed.exact_rows(
      loose,
      lambda i: kernel_grad(
        _rows(jax.lax.dynamic_index_in_dim(a, i), rank),
        _rows(jax.lax.dynamic_index_in_dim(d, i), rank),
      ),
      theta['kernel'].shape,
    )
  )
  weighted_sum = _ws_weighted_sum(kernel_grad, theta, a, d, norms.gain, bias, loose, kernel_sq)
  sq = jnp.where(loose, other + kernel_sq, sq + ws_allowance() * norms.bound)
  return sq, None, weighted_sum
