"""Norm rules of convolutions: nn.Conv, and the weight-standardised conv rule models register.

A convolution is the linear map of `mixed` with a = the input patches (one
row per output position), never formed: the input is visited one kernel
offset at a time (`_Blocks`). A weight-standardised conv (W' = T(kernel,
gain), De et al. 2022) has a closed form of T's vjp per output channel
(`_ws_sq_norms`); the model that defines such a layer registers it with
`ws_conv_sq_norms` (dpjax.networks.WSConv does), so this module imports no model.
"""

from __future__ import annotations

from collections.abc import Sequence
import itertools
import math

import flax.linen as nn
from flax.linen import linear as nn_linear
import jax
import jax.numpy as jnp
import numpy as np

from dpjax.ghost_clipping import mixed
from dpjax.ghost_clipping.mixed import _Blocks
from dpjax.ghost_clipping.mixed import _HIGHEST
from dpjax.ghost_clipping.mixed import _per_example_grads
from dpjax.ghost_clipping.mixed import _scan_blocks
from dpjax.ghost_clipping.registry import register_norm_rule
from dpjax.ghost_clipping.util import broadcast as _broadcast

# Convolutions whose patches (all blocks) exceed this are visited by a scan,
# one block at a time; smaller ones are unrolled (faster: no loop overhead).
_UNROLL_BYTES = 16 * 2**20
WS_CONV_PARAMS = ({'kernel', 'gain', 'bias'}, {'kernel', 'gain', 'bias'})


def _conv_check(module: nn.Module) -> str:
  rank = len(module.kernel_size) if not isinstance(module.kernel_size, int) else 1
  padding = nn_linear.canonicalize_padding(module.padding, rank)
  if (module.feature_group_count != 1 or module.mask is not None or
      module.conv_general_dilated is not None or
      module.conv_general_dilated_cls is not None or
      isinstance(padding, str) and padding not in ('SAME', 'VALID') or
      any(d != 1 for d in _broadcast(module.input_dilation, rank))):
    return ('Conv with feature groups, a mask, input dilation, a '
            f'custom conv or padding {module.padding!r}')
  return ''


def _ws_sq_norms(module: nn.Module, theta: dict, blocks: _Blocks,
                 d: jax.Array) -> jax.Array:
  """‖∂kernel‖² + ‖∂gain‖² [n] of a `networks.WSConv` call, without T's vjp.

  networks.WSConv uses W'_o = gain_o · (w_o − μ_o) · r_o per output channel o,
  r_o = rsqrt(max(ρ_o², eps)), ρ_o² = ‖w_o − μ_o‖² (= fan_in · var). With
  g_o = ∂loss/∂W'_o (a column of the conv's per-example gradient, from the
  input blocks and output gradients d) and z_o = (w_o − μ_o)·r_o:
    ∂gain_o = z_o·g_o,
    ‖∂w_o‖² = gain_o² r_o² (‖g_o‖² − (1·g_o)²/m − [ρ_o² > eps] (z_o·g_o)²),
  since ∂w_o = gain_o r_o (P g_o − u_o (u_o·g_o)) with P the centring
  projection and u_o = z_o the unit vector when ρ_o² > eps (and without the
  u term when the eps branch is active). Σ_o gain_o² r_o² ‖g_o‖² is a ghost
  norm with d scaled per channel, so the mixed rule applies. Restates the
  standardisation of networks.WSConv; tests compare with its per-example
  gradients.
  """
  w = theta['kernel']
  n, s, c = d.shape
  m, width = math.prod(w.shape[:-1]), blocks.width
  centred = w.reshape(m, c) - jnp.mean(w.reshape(m, c), axis=0)
  rho2 = jnp.sum(jnp.square(centred), axis=0)
  r = jax.lax.rsqrt(jnp.maximum(rho2, module.eps))
  z = (centred * r).reshape(blocks.count, width, c)  # Rows per block (HWIO).
  kappa = jnp.square(theta['gain'] * r)  # [c].
  if mixed.use_ghost(s, m, c):
    def body(carry, b, k):
      gram, total, proj = carry
      return (gram + jnp.einsum('nsm,ntm->nst', b, b, precision=_HIGHEST),
              total + jnp.sum(b, axis=-1),
              proj + jnp.einsum('nsm,mc->nsc', b, z[k],
                                precision=_HIGHEST)), None
    (gram, total, proj), _ = _scan_blocks(
        blocks, body, (jnp.zeros((n, s, s)), jnp.zeros((n, s)),
                       jnp.zeros((n, s, c))))
    dk = d * jnp.sqrt(kappa)
    g_sq = jnp.sum(gram * jnp.einsum('nsc,ntc->nst', dk, dk,
                                     precision=_HIGHEST), axis=(1, 2))
    ones = jnp.einsum('ns,nsc->nc', total, d, precision=_HIGHEST)
    gain = jnp.sum(proj * d, axis=1)
  else:
    g = _per_example_grads(blocks, d)  # [n, m, c].
    g_sq = jnp.sum(kappa * jnp.sum(jnp.square(g), axis=1), axis=1)
    ones = jnp.sum(g, axis=1)
    gain = jnp.sum(z.reshape(m, c) * g, axis=1)
  kernel_sq = g_sq - jnp.sum(
      kappa * (jnp.square(ones) / m + (rho2 > module.eps) * jnp.square(gain)),
      axis=1)
  # ≥ 0 exactly; clamp rounding (jnp.maximum keeps NaN).
  return jnp.maximum(kernel_sq, 0.0) + jnp.sum(jnp.square(gain), axis=1)


def _conv_blocks(layer, a: jax.Array) -> _Blocks:
  """The input blocks of a (WS)conv call; a: [n, *lead, *spatial, C]."""
  module = layer.module
  kernel_size = _broadcast(module.kernel_size, 1 if isinstance(
      module.kernel_size, int) else len(module.kernel_size))
  rank = len(kernel_size)
  if layer.rule.name == 'wsconv':
    padding, dilation = 'SAME', (1,) * rank
  else:
    padding = nn_linear.canonicalize_padding(module.padding, rank)
    dilation = _broadcast(module.kernel_dilation, rank)
  strides = _broadcast(module.strides, rank)
  n = a.shape[0]
  x = a.reshape(-1, *a.shape[a.ndim - rank - 1:])  # Leading axes -> batch.
  spatial = x.shape[1:-1]
  dilated = [(k - 1) * d + 1 for k, d in zip(kernel_size, dilation)]
  if isinstance(padding, str):
    pads = jax.lax.padtype_to_pads(spatial, dilated, strides, padding)
  else:
    pads = list(padding)
  x = jax.lax.pad(x, jnp.zeros((), x.dtype),  # Negative pads crop, as in lax.
                  [(0, 0, 0)] + [(lo, hi, 0) for lo, hi in pads] + [(0, 0, 0)])
  out = [(size - k) // s + 1 for size, k, s in zip(x.shape[1:-1], dilated,
                                                   strides)]
  span = [(o - 1) * s + 1 for o, s in zip(out, strides)]
  offsets = np.asarray(list(itertools.product(*(range(k)
                                                for k in kernel_size))),
                       np.int32) * np.asarray(dilation, np.int32)

  def get(k):
    offset = offsets[k] if isinstance(k, int) else jnp.asarray(offsets)[k]
    start = [0] + list(offset) + [0]
    window = jax.lax.dynamic_slice(x, start, [x.shape[0], *span, x.shape[-1]])
    block = jax.lax.slice(window, [0] * window.ndim, window.shape,
                          [1, *strides, 1])
    return block.reshape(n, -1, block.shape[-1])
  patches_bytes = 4 * x.shape[0] * math.prod(out) * len(offsets) * x.shape[-1]
  return _Blocks(get, len(offsets), x.shape[-1],
                 unroll=patches_bytes <= _UNROLL_BYTES)


def _patches(x: jax.Array, kernel_size: Sequence[int],
             strides: Sequence[int], padding,
             dilation: Sequence[int]) -> jax.Array:
  """Input patches [N, S, prod(kernel_size)·C] of x [N, *spatial, C] (tests)."""
  module = nn.Conv(1, tuple(kernel_size), tuple(strides), padding,
                   kernel_dilation=tuple(dilation))
  from dpjax.ghost_clipping.coverage import Layer  # pylint: disable=import-outside-toplevel
  from dpjax.ghost_clipping.registry import RULES  # pylint: disable=import-outside-toplevel
  blocks = _conv_blocks(Layer(None, RULES[nn.Conv], module, (), (), None, None),
                        x[:, None])
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
    blocks = _Blocks(lambda k: a2, 1, a2.shape[-1])
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


@register_norm_rule(nn.Conv, name='conv', params=({'kernel'}, {'kernel', 'bias'}),
                    check=_conv_check, form=_conv_form)
def conv_sq_norms(layer, theta: dict, a, d):
  """a [n, *lead, *spatial, C]: the leading axes (e.g. augmult views) join the positions."""
  a = a.astype(jnp.float32)
  blocks, d2 = _blocks_and_d2(layer, a, d)
  # Keep materialised per-example gradients for the clipped sum when they are
  # smaller than the input and output gradient they replace.
  return mixed.linear_norms(theta, a, d, blocks, d2, keep_small_grads=True)


def ws_conv_sq_norms(layer, theta: dict, a, d):
  """The norm rule of a weight-standardised conv with SAME padding (`_ws_sq_norms`).

  Register it for such a layer: `register_norm_rule(WSConv, name='wsconv',
  params=WS_CONV_PARAMS, form=ws_conv_form)(ws_conv_sq_norms)`; the layer must have the attributes
  `kernel_size`, `strides`, `eps` and parameters kernel, gain, bias.
  """
  a = a.astype(jnp.float32)
  blocks, d2 = _blocks_and_d2(layer, a, d)
  bias = jnp.sum(d2, axis=1)
  sq = jnp.sum(jnp.square(bias), axis=1) * ('bias' in theta)
  return sq + _ws_sq_norms(layer.module, theta, blocks, d2), None, None
