"""Per-example gradient norms without per-example gradients (ghost clipping).

A layer z = a·W + b applied at S positions of one example (input a_i: S×m,
output gradient δ_i = ∂loss_i/∂z_i: S×c) has the per-example gradient
g_i = a_iᵀ δ_i, hence

  ‖g_i‖² = Σ_{s,s'} (a_s·a_s')(δ_s·δ_s')   (ghost form, cost S²(m + c))
         = ‖a_iᵀ δ_i‖²_F                    (materialised, cost S·m·c)

and ‖∂b‖² = ‖Σ_s δ_s‖². With S = 1 the ghost form is ‖a_i‖²·‖δ_i‖²
(Goodfellow 2015). Li et al. 2022 use the ghost form for sequences; Bu et al.
2022 ("mixed ghost clipping") pick, per layer and statically from its shapes,
whichever of the two is cheaper. A convolution is the same with a = the input
patches (one row per output position; never formed: the input is visited
one kernel offset at a time); an embedding with a = one-hot tokens,
so a_s·a_s' = [tok_s = tok_s']. Norm layers (LayerNorm, GroupNorm, RMSNorm)
have a few parameters per channel: their per-example gradients are
materialised by a vmapped vjp of the layer itself. A weight-standardised conv
(`models.WSConv`) uses W' = T(kernel, gain); the norm of T's vjp applied to
the per-example gradient w.r.t. W' has a closed form per output channel (see
`_ws_sq_norms`), again ghost or materialised.

Capture: `flax.linen.intercept_methods` sees every call of a covered layer,
records its input, and adds a zero perturbation to its output; the gradient of
Σ_i loss_i w.r.t. the perturbations is δ_i for every example at once, since
examples do not interact (one backward pass through the activations, no weight
gradients). The clipped sum Σ_i f_i·g_i (f_i = w_i·min(1, C/‖g_i‖)) is then
book-kept layer by layer from the same (a, δ) (Bu et al. 2023): the vjp of the
layer w.r.t. its parameters at cotangents (f_i·δ_i)_i, i.e. the layer's usual
weight-gradient computation (for Dense the matmul aᵀ(f·δ)), with no second
pass through the network; it keeps every covered layer's input and output
gradient until then (about twice the activations). Rows with f_i = 0 or
non-finite values have their a and δ zeroed first, so 0·NaN cannot reach the
sum.

Coverage is proved at trace time, never assumed: every parameter leaf must be
read by exactly one call of a covered layer, and a dependency analysis of the
jaxpr (with each covered call's input and output replaced by fresh variables)
must show that (1) the call's output depends on exactly that layer's
parameters and (2) the loss depends on no covered parameter except through
covered outputs (tied weights, weight decay inside the loss, `Embed.attend`,
or shared layers make a parameter uncovered). Parameters declared directly in
a module that calls other modules (e.g. a transformer's positional embedding)
get one copy per example, so their per-example gradients are exact
(materialised, memory n × size). Any other parameter is uncovered;
`Coverage.complete` is False and callers must use per-example gradients.

References:
  Goodfellow 2015, "Efficient Per-Example Gradient Computations" (arXiv
    1510.01799).
  Li, Tramèr, Liang & Hashimoto 2022, "Large Language Models Can Be Strong
    Differentially Private Learners" (ICLR): ghost clipping.
  Bu, Mao & Xu 2022, "Scalable and Efficient Training of Large Convolutional
    Neural Networks with Differential Privacy" (NeurIPS): mixed ghost clipping.
  Bu, Wang, Zha & Karypis 2023, "Differentially Private Optimization on Large
    Model at Small Cost" (ICML): book-keeping.
"""

from collections.abc import Callable, Sequence
import collections
import dataclasses
import functools
import itertools
import math
from typing import Any, NamedTuple

import flax.linen as nn
from flax.linen import linear as nn_linear
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np

from dpjax import models

Params = Any
LeafPath = tuple[str, ...]
CallKey = tuple[tuple[str, ...], str, int]  # (module path, method, index).
LossFn = Callable[[Params, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]

# Covered layer types (exact types: a subclass may change the computation).
RULES = {
    nn.Dense: 'dense',
    nn.DenseGeneral: 'dense_general',
    nn.Conv: 'conv',
    nn.Embed: 'embed',
    nn.LayerNorm: 'norm',
    nn.GroupNorm: 'norm',
    nn.RMSNorm: 'norm',
    models.WSConv: 'wsconv',
}
# (required, allowed) parameter names per rule; norm layers take any.
_PARAM_NAMES = {
    'dense': ({'kernel'}, {'kernel', 'bias'}),
    'dense_general': ({'kernel'}, {'kernel', 'bias'}),
    'conv': ({'kernel'}, {'kernel', 'bias'}),
    'embed': ({'embedding'}, {'embedding'}),
    'wsconv': ({'kernel', 'gain', 'bias'}, {'kernel', 'gain', 'bias'}),
}
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Layer:
  """One call of a covered layer."""
  key: CallKey
  rule: str  # A value of RULES.
  module: nn.Module  # Unbound clone: attributes, and re-application.
  param_path: tuple[str, ...]
  param_names: tuple[str, ...]  # Leaves directly under param_path.
  in_aval: jax.ShapeDtypeStruct  # Per-example input.
  out_aval: jax.ShapeDtypeStruct  # Per-example output.


@dataclasses.dataclass(frozen=True)
class Coverage:
  """How each parameter's per-example norm is obtained (static)."""
  layers: tuple[Layer, ...]
  materialised: tuple[LeafPath, ...]  # One copy per example.
  uncovered: tuple[tuple[str, str], ...]  # ('a/b/leaf', reason).

  @property
  def complete(self) -> bool:
    return not self.uncovered

  def describe(self) -> str:
    rules = collections.Counter(l.rule for l in self.layers)
    text = (f'{len(self.layers)} layers by ghost/book-keeping '
            f'({", ".join(f"{r} {k}" for r, k in sorted(rules.items()))})')
    if self.materialised:
      text += ('; per-example copies of '
               + ', '.join('/'.join(p) for p in self.materialised))
    if self.uncovered:
      text += '; UNCOVERED: ' + '; '.join(
          f'{p} ({why})' for p, why in self.uncovered)
    return text


# ----------------------------------------------------------------------------
# Interception: the same call keys in every trace.
# ----------------------------------------------------------------------------


class _Interceptor:
  """Calls `on_call(key, next_fun, args, kwargs, ctx)` for each module call.

  Methods a module calls on itself are part of the enclosing call and are not
  reported. Keys count calls per (path, method), so a second call of a layer
  has a different key.
  """

  def __init__(self, on_call):
    self._on_call = on_call
    self._count = collections.Counter()
    self._stack = []

  def __call__(self, next_fun, args, kwargs, ctx):
    path = tuple(ctx.module.path)
    if ctx.method_name == 'setup' or (self._stack and self._stack[-1] == path):
      return next_fun(*args, **kwargs)
    name = (path, ctx.method_name)
    key = (path, ctx.method_name, self._count[name])
    self._count[name] += 1
    self._stack.append(path)
    try:
      return self._on_call(key, next_fun, args, kwargs, ctx)
    finally:
      self._stack.pop()


def _leaf_paths(tree) -> list[LeafPath]:
  def name(k):
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)
  return [tuple(name(k) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _subtree(params, path):
  for k in path:
    params = params[k]
  return params


def _aval(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _rule_for(module: nn.Module, method: str, args, kwargs) -> tuple[
    str | None, str]:
  """(rule, '') if this call is covered, else (None, reason)."""
  kind = type(module).__name__
  rule = RULES.get(type(module))
  if rule is None:
    return None, f'{kind} has no ghost rule'
  if method != '__call__':
    return None, f'{kind}.{method} is not a covered use'
  if kwargs or len(args) != 1 or not hasattr(args[0], 'shape'):
    return None, f'{kind} called with arguments other than one array'
  if rule in ('dense', 'dense_general') and (
      module.dot_general is not None or module.dot_general_cls is not None):
    return None, f'{kind} with a custom dot_general'
  if rule == 'dense_general' and _as_tuple(module.batch_dims):
    return None, 'DenseGeneral with batch_dims'
  if rule == 'conv':
    rank = (len(module.kernel_size) if not isinstance(module.kernel_size, int)
            else 1)
    padding = nn_linear.canonicalize_padding(module.padding, rank)
    if (module.feature_group_count != 1 or module.mask is not None or
        module.conv_general_dilated is not None or
        module.conv_general_dilated_cls is not None or
        isinstance(padding, str) and padding not in ('SAME', 'VALID') or
        any(d != 1 for d in _broadcast(module.input_dilation, rank))):
      return None, ('Conv with feature groups, a mask, input dilation, a '
                    f'custom conv or padding {module.padding!r}')
  if rule == 'norm' and module.axis_name is not None:
    return None, f'{kind} with axis_name (statistics across devices)'
  return rule, ''


def _as_tuple(value) -> tuple:
  return tuple(value) if isinstance(value, Sequence) else (value,)


def _broadcast(value, rank: int) -> tuple[int, ...]:
  """Conv attribute (int, sequence or None) as a tuple of `rank` ints."""
  if value is None:
    value = 1
  if isinstance(value, int):
    return (value,) * rank
  return tuple(value)


# ----------------------------------------------------------------------------
# Coverage analysis (trace time, abstract values only).
# ----------------------------------------------------------------------------


def _run(loss_fn: LossFn, on_call, params, x, y):
  with nn.intercept_methods(_Interceptor(on_call)):
    return loss_fn(params, x, y)


def _dependencies(closed_jaxpr, num_params: int) -> list[int]:
  """Bitmask of the parameter inputs each output of the jaxpr depends on.

  Conservative (an equation's outputs depend on all its inputs), so it can
  only report too many dependencies, never too few.
  """
  jaxpr = closed_jaxpr.jaxpr
  deps = {v: 1 << i for i, v in enumerate(jaxpr.invars[:num_params])}
  for eqn in jaxpr.eqns:
    d = 0
    for v in eqn.invars:
      if not isinstance(v, jax_core.Literal):
        d |= deps.get(v, 0)
    if d:
      for v in eqn.outvars:
        deps[v] = d
  return [0 if isinstance(v, jax_core.Literal) else deps.get(v, 0)
          for v in jaxpr.outvars]


def analyse_coverage(loss_fn: LossFn, params: Params, x, y) -> Coverage:
  """Which parameters ghost clipping covers, for ONE example (x, y).

  Only abstract traces (shapes), so it may run inside jit (at trace time).

  Args:
    loss_fn: `(params, x_i, y_i) -> (loss_i, logits_i)` for a single example.
    params: parameters (arrays or ShapeDtypeStructs).
    x: one example's input (array or ShapeDtypeStruct).
    y: its label.

  Returns:
    The Coverage: covered layer calls, parameters given per-example copies,
    and uncovered parameters with the reason.
  """
  params = jax.tree.map(_aval, params)
  x, y = _aval(x), _aval(y)
  leaf_paths = _leaf_paths(params)
  calls = []  # (key, module, rule, reason, in_aval, out_aval).
  in_rule = []

  def record(key, next_fun, args, kwargs, ctx):
    rule, reason = _rule_for(ctx.module, ctx.method_name, args, kwargs)
    if any(in_rule):
      rule, reason = None, 'called inside another covered layer'
    in_rule.append(rule is not None)
    try:
      out = next_fun(*args, **kwargs)
    finally:
      in_rule.pop()
    if rule and not hasattr(out, 'shape'):
      rule, reason = None, 'output is not one array'
    calls.append((key, ctx.module.clone(parent=None), rule, reason,
                  _aval(args[0]) if rule else None,
                  _aval(out) if rule else None))
    return out

  jax.eval_shape(functools.partial(_run, loss_fn, record), params, x, y)

  uses = collections.Counter(key[0] for key, *_ in calls)
  kinds = {key[0]: type(module) for key, module, *_ in calls}
  reasons = {}  # Module path -> why its parameters are not covered.
  candidates = []
  for key, module, rule, reason, in_aval, out_aval in calls:
    path = key[0]
    own = [p for p in leaf_paths if p[:len(path)] == path]
    names = {p[-1] for p in own}
    required, allowed = _PARAM_NAMES.get(rule, (set(), names))
    if not rule:
      reasons.setdefault(path, reason)
    elif uses[path] > 1:
      reasons[path] = f'{type(module).__name__} called {uses[path]} times'
    elif any(len(p) != len(path) + 1 for p in own) or not (
        required <= names <= allowed):
      reasons[path] = f'unexpected parameters {sorted(names)}'
    elif own:
      candidates.append(Layer(key, rule, module, path,
                              tuple(p[-1] for p in own), in_aval, out_aval))

  # Proof by dependencies: give every candidate call a fresh input and a fresh
  # output; its output must depend on exactly its own parameters, and the loss
  # on none of them.
  index = {c.key: j for j, c in enumerate(candidates)}

  def substituted(p, fresh_in, fresh_out, x, y):
    outs = [None] * len(candidates)

    def swap(key, next_fun, args, kwargs, ctx):
      del ctx
      j = index.get(key)
      if j is None:
        return next_fun(*args, **kwargs)
      outs[j] = next_fun(fresh_in[j])
      return fresh_out[j]
    loss, _ = _run(loss_fn, swap, p, x, y)
    return loss, outs

  jaxpr = jax.make_jaxpr(substituted)(
      params, [c.in_aval for c in candidates],
      [c.out_aval for c in candidates], x, y)
  deps = _dependencies(jaxpr, len(leaf_paths))
  loss_deps, out_deps = deps[0], deps[1:]
  bit = {p: 1 << i for i, p in enumerate(leaf_paths)}
  layers = []
  for c, d in zip(candidates, out_deps):
    own = sum(bit[c.param_path + (n,)] for n in c.param_names)
    if d != own:
      reasons[c.param_path] = 'output depends on other parameters'
    elif loss_deps & own:
      reasons[c.param_path] = ('parameters also used outside the layer call '
                               '(e.g. tied weights or a loss term)')
    else:
      layers.append(c)

  covered = {c.param_path + (n,) for c in layers for n in c.param_names}
  materialised, uncovered = [], []
  for p in leaf_paths:
    if p in covered:
      continue
    owner = p[:-1]
    has_children = any(len(q) > len(owner) and q[:len(owner)] == owner
                       for q in uses)
    if owner in kinds and kinds[owner] not in RULES and has_children:
      materialised.append(p)  # Declared in a model body, e.g. pos_embedding.
    else:
      uncovered.append(('/'.join(p), reasons.get(
          owner, 'not read by a covered layer call')))
  return Coverage(tuple(layers), tuple(materialised), tuple(uncovered))


# ----------------------------------------------------------------------------
# Per-layer per-example squared norms.
# ----------------------------------------------------------------------------


def _use_ghost(s: int, m: int, c: int) -> bool:
  """Mixed rule: ghost form S²(m + c) cheaper than materialising S·m·c."""
  return s * (m + c) < m * c


class _Blocks(NamedTuple):
  """Column blocks of a layer's input matrix a [n, S, count·width].

  A dense layer has one block (a itself); a convolution has one per kernel
  offset (the input shifted by the offset, strided), whose concatenation is
  the patches matrix in the HWIO kernel's feature order. `get(k)` returns
  block k [n, S, width] for a traced k, so the blocks are visited by a scan
  and the patches (prod(kernel) x the input) never exist in memory.
  """
  get: Callable[[jax.Array | int], jax.Array]
  count: int
  width: int
  unroll: bool = True  # Python loop (fast for small blocks) or lax.scan.


# Convolutions whose patches (all blocks) exceed this are visited by a scan,
# one block at a time; smaller ones are unrolled (faster: no loop overhead).
_UNROLL_BYTES = 16 * 2**20


def _scan_blocks(blocks: _Blocks, body, init):
  """Scan of body(carry, block_k, k) -> (carry, y) over the blocks."""
  if blocks.unroll:
    carry, ys = init, []
    for k in range(blocks.count):
      carry, y = body(carry, blocks.get(k), k)
      ys.append(y)
    return carry, jax.tree.map(lambda *v: jnp.stack(v), *ys)
  return jax.lax.scan(lambda c, k: body(c, blocks.get(k), k), init,
                      jnp.arange(blocks.count))


def _stack_rows(ys: jax.Array) -> jax.Array:
  """Per-block gradients [K, n, width, c] -> [n, K·width, c] (kernel order)."""
  k, n, w, c = ys.shape
  return jnp.moveaxis(ys, 0, 1).reshape(n, k * w, c)


def _linear_sq_norm(blocks: _Blocks, d: jax.Array):
  """‖a_iᵀ d_i‖²_F [n] for a given by `blocks`, d: [n, S, c] (mixed rule).

  Returns (squared norms, the per-example gradients [n, m, c] if they were
  materialised, else None).
  """
  n, s, c = d.shape
  m = blocks.count * blocks.width
  if s == 1:
    a_sq, _ = _scan_blocks(blocks, lambda t, b, k: (
        t + jnp.sum(jnp.square(b), axis=(1, 2)), None), jnp.zeros(n))
    return a_sq * jnp.sum(jnp.square(d), axis=(1, 2)), None
  if _use_ghost(s, m, c):
    gram, _ = _scan_blocks(blocks, lambda t, b, k: (
        t + jnp.einsum('nsm,ntm->nst', b, b, precision=_HIGHEST), None),
                           jnp.zeros((n, s, s)))
    gd = jnp.einsum('nsc,ntc->nst', d, d, precision=_HIGHEST)
    return jnp.sum(gram * gd, axis=(1, 2)), None
  g = _per_example_grads(blocks, d)
  return jnp.sum(jnp.square(g), axis=(1, 2)), g


def _per_example_grads(blocks: _Blocks, d: jax.Array) -> jax.Array:
  """The per-example gradients a_iᵀ d_i [n, m, c] (materialised)."""
  if blocks.unroll and blocks.count > 1:
    # Blocks stacked on a new axis [n, K, S, width]: one batched matmul over
    # S, no concatenation along the (often 1-wide) channel axis, which is
    # slow on the CPU.
    a3 = jnp.stack([blocks.get(k) for k in range(blocks.count)], axis=1)
    g = jnp.einsum('nksw,nsc->nkwc', a3, d, precision=_HIGHEST)
    return g.reshape(d.shape[0], -1, d.shape[-1])
  _, gs = _scan_blocks(blocks, lambda t, b, k: (
      t, jnp.einsum('nsm,nsc->nmc', b, d, precision=_HIGHEST)), 0)
  return _stack_rows(gs)


def _ws_sq_norms(module: nn.Module, theta: dict, blocks: _Blocks,
                 d: jax.Array) -> jax.Array:
  """‖∂kernel‖² + ‖∂gain‖² [n] of a `models.WSConv` call, without T's vjp.

  models.WSConv uses W'_o = gain_o · (w_o − μ_o) · r_o per output channel o,
  r_o = rsqrt(max(ρ_o², eps)), ρ_o² = ‖w_o − μ_o‖² (= fan_in · var). With
  g_o = ∂loss/∂W'_o (a column of the conv's per-example gradient, from the
  input blocks and output gradients d) and z_o = (w_o − μ_o)·r_o:
    ∂gain_o = z_o·g_o,
    ‖∂w_o‖² = gain_o² r_o² (‖g_o‖² − (1·g_o)²/m − [ρ_o² > eps] (z_o·g_o)²),
  since ∂w_o = gain_o r_o (P g_o − u_o (u_o·g_o)) with P the centring
  projection and u_o = z_o the unit vector when ρ_o² > eps (and without the
  u term when the eps branch is active). Σ_o gain_o² r_o² ‖g_o‖² is a ghost
  norm with d scaled per channel, so the mixed rule applies. Restates the
  standardisation of models.WSConv; tests compare with its per-example
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
  if _use_ghost(s, m, c):
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


def _conv_blocks(layer: Layer, a: jax.Array) -> _Blocks:
  """The input blocks of a (WS)conv call; a: [n, *lead, *spatial, C]."""
  module = layer.module
  kernel_size = _broadcast(module.kernel_size, 1 if isinstance(
      module.kernel_size, int) else len(module.kernel_size))
  rank = len(kernel_size)
  if layer.rule == 'wsconv':
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
  blocks = _conv_blocks(Layer(None, 'conv', module, (), (), None, None),
                        x[:, None])
  return jnp.concatenate([blocks.get(k) for k in range(blocks.count)], -1)


def _layer_norms(layer: Layer, theta: dict, a: jax.Array, d: jax.Array):
  """(‖g_i‖² over the layer's parameters [n], grads, operands).

  a: the layer's inputs [n, *in]; d: gradients of Σ loss w.r.t. its outputs
  [n, *out]; theta: its parameters. `grads` are per-example gradients
  {name: [n, *shape]} of small layers (norms, a small vocabulary), else None;
  `operands` are (a2 [n, S, m], d2 [n, S, c]) of a dense layer, whose clipped
  sum is the matmul a2ᵀ(f·d2); else None (use the layer's own vjp).
  """
  n = a.shape[0]
  d = d.astype(jnp.float32)
  if layer.rule == 'norm':  # Few parameters: vmapped vjp of the layer itself.
    def one(a_i, d_i):
      _, vjp = jax.vjp(lambda t: layer.module.apply({'params': t}, a_i), theta)
      return vjp(d_i.astype(layer.out_aval.dtype))[0]
    grads = jax.vmap(one)(a, d)
    return _tree_sq_norms(grads), grads, None

  if layer.rule == 'embed':
    vocab = layer.module.num_embeddings
    tokens = a.reshape(n, -1)
    # jnp.take reads token -k as V - k; tokens out of range give NaN outputs,
    # so their rows are non-finite whatever we compute here. V = 1
    # broadcasts the one row to every token.
    tokens = jnp.where(tokens < 0, tokens + vocab, tokens) * (vocab > 1)
    d = d.reshape(n, tokens.shape[1], -1)
    if vocab <= tokens.shape[1]:  # Materialise [n, V, D].
      g = jnp.einsum('nsv,nsd->nvd', jax.nn.one_hot(tokens, vocab), d,
                     precision=_HIGHEST)
      return jnp.sum(jnp.square(g), axis=(1, 2)), {'embedding': g}, None
    same = tokens[:, :, None] == tokens[:, None, :]
    gd = jnp.einsum('nsd,ntd->nst', d, d, precision=_HIGHEST)
    return jnp.sum(jnp.where(same, gd, 0.0), axis=(1, 2)), None, None

  a = a.astype(jnp.float32)
  if layer.rule in ('conv', 'wsconv'):
    blocks = _conv_blocks(layer, a)
    d2 = d.reshape(n, -1, d.shape[-1])
    m = blocks.count * blocks.width
    if blocks.unroll and (d2.shape[1] == 1 or _use_ghost(d2.shape[1], m,
                                                         d2.shape[-1])):
      # Small, ghost form: one patches matrix, one Gram einsum (and the
      # operands of the book-kept clipped sum).
      a2 = jnp.concatenate([blocks.get(k) for k in range(blocks.count)], -1)
      blocks = _Blocks(lambda k: a2, 1, a2.shape[-1])
  elif layer.rule == 'dense':
    a2, d2 = a.reshape(n, -1, a.shape[-1]), d.reshape(n, -1, d.shape[-1])
  else:  # dense_general: contract `axis` (sorted, as flax does).
    ndim = a.ndim - 1
    axes = sorted(ax % ndim for ax in _as_tuple(layer.module.axis))
    rest = [i for i in range(ndim) if i not in axes]
    a2 = jnp.transpose(a, [0] + [1 + i for i in rest + axes])
    m = math.prod(a.shape[1 + i] for i in axes)
    a2 = a2.reshape(n, -1, m)
    d2 = d.reshape(n, a2.shape[1], -1)
  if layer.rule.startswith('dense'):
    blocks = _Blocks(lambda k: a2, 1, a2.shape[-1])
  bias = jnp.sum(d2, axis=1)  # [n, c].
  sq = jnp.sum(jnp.square(bias), axis=1) * ('bias' in theta)
  if layer.rule == 'wsconv':
    return sq + _ws_sq_norms(layer.module, theta, blocks, d2), None, None
  kernel_sq, g = _linear_sq_norm(blocks, d2)
  sq = sq + kernel_sq
  # Conv: keep materialised per-example gradients for the clipped sum when
  # they are smaller than the input and output gradient they replace.
  if (layer.rule == 'conv' and g is not None and
      theta['kernel'].size <= a[0].size + d[0].size):
    grads = {'kernel': g.reshape(n, *theta['kernel'].shape)}
    if 'bias' in theta:
      grads['bias'] = bias.reshape(n, *theta['bias'].shape)
    return sq, grads, None
  # Dense and small convs: the clipped sum is the matmul a2ᵀ(f·d2) of the
  # same operands. Large convs: the layer's own weight gradient (their
  # patches are never formed).
  return sq, None, (a2, d2) if blocks.count == 1 else None


def _tree_sq_norms(grads) -> jax.Array:
  return sum(jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), axis=1)
             for g in jax.tree.leaves(grads))


def _masked_row_sum(factor: jax.Array, g: jax.Array,
                    keep: jax.Array) -> jax.Array:
  """Σ_i factor_i · g_i, rows where keep is False exactly zero (no 0·NaN)."""
  mask = keep.reshape((-1,) + (1,) * (g.ndim - 1))
  return jnp.tensordot(factor, jnp.where(mask, g, 0.0), axes=1)


# ----------------------------------------------------------------------------
# The ghost pass.
# ----------------------------------------------------------------------------


class GhostPass(collections.namedtuple(
    'GhostPass', 'losses logits sq_norms sq_norms_by_path weighted_sum')):
  """Per-example losses, logits, ‖g_i‖², and `weighted_sum(factor, keep)`.

  `sq_norms_by_path` maps 'module/path' (a covered layer) or
  'module/path/leaf' (a per-example copy) to that part of ‖g_i‖² [n].

  `weighted_sum(factor, keep)` = Σ_i factor_i · g_i over rows with keep_i
  True, with the structure of params (book-keeping from the captured
  tensors); rows with keep_i False contribute exactly zero even if their
  inputs or gradients are not finite.
  """


def ghost_pass(loss_fn: LossFn, params: Params, x: jax.Array, y: jax.Array,
               coverage: Coverage | None = None) -> GhostPass:
  """One forward and one activation-backward pass over a batch x, y.

  Args:
    loss_fn: single-example loss `(params, x_i, y_i) -> (loss_i, logits_i)`.
    params: parameters.
    x: inputs [n, ...].
    y: labels [n] or [n, classes].
    coverage: from `analyse_coverage` (computed if None); must be complete.

  Returns:
    GhostPass with losses [n], logits [n, ...], sq_norms [n] (‖g_i‖² over all
    parameters) and weighted_sum.
  """
  if coverage is None:
    coverage = analyse_coverage(loss_fn, params, x[0], y[0])
  if not coverage.complete:
    raise ValueError('ghost clipping does not cover these parameters: '
                     + coverage.describe())
  n = x.shape[0]
  layers = coverage.layers
  index = {l.key: j for j, l in enumerate(layers)}
  flat = dict(zip(_leaf_paths(params), jax.tree.leaves(params)))
  copies = [jnp.broadcast_to(flat[p], (n, *jnp.shape(flat[p])))
            for p in coverage.materialised]
  zeros = [jnp.zeros((n, *l.out_aval.shape), l.out_aval.dtype) for l in layers]

  def one(copies_i, perturbations_i, x_i, y_i):
    replace = dict(zip(coverage.materialised, copies_i))
    p = jax.tree_util.tree_unflatten(
        jax.tree.structure(params),
        [replace.get(path, leaf) for path, leaf in flat.items()])
    inputs = [None] * len(layers)

    def capture(key, next_fun, args, kwargs, ctx):
      del ctx
      j = index.get(key)
      if j is None:
        return next_fun(*args, **kwargs)
      inputs[j] = args[0]
      return next_fun(*args, **kwargs) + perturbations_i[j]
    loss, logits = _run(loss_fn, capture, p, x_i, y_i)
    return loss, (logits, inputs)

  def batched(copies, perturbations):
    return jax.vmap(one)(copies, perturbations, x, y)

  losses, vjp, (logits, inputs) = jax.vjp(batched, copies, zeros,
                                          has_aux=True)
  copy_grads, deltas = vjp(jnp.ones_like(losses))

  thetas = [_subtree(params, l.param_path) for l in layers]
  parts = [_layer_norms(l, t, a, d)
           for l, t, a, d in zip(layers, thetas, inputs, deltas)]
  by_path = {'/'.join(l.param_path): sq for l, (sq, _, _) in zip(layers, parts)}
  by_path.update({'/'.join(p): _tree_sq_norms(g)
                  for p, g in zip(coverage.materialised, copy_grads)})
  sq_norms = sum(by_path.values())

  def weighted_sum(factor: jax.Array, keep: jax.Array) -> Params:
    out = {}
    rows = lambda v: keep.reshape((-1,) + (1,) * (v.ndim - 1))
    for l, theta, a, d, (_, grads, operands) in zip(layers, thetas, inputs,
                                                    deltas, parts):
      if grads is not None:  # Materialised: Σ_i f_i g_i.
        grads = jax.tree.map(lambda g: _masked_row_sum(factor, g, keep),
                             grads)
      elif operands is not None:  # Linear layer: a2ᵀ (f · d2).
        a2, d2 = operands
        a2 = jnp.where(rows(a2), a2, 0.0)
        ct = jnp.where(rows(d2), factor[:, None, None] * d2, 0.0)
        grads = {'kernel': jnp.einsum('nsm,nsc->mc', a2, ct),
                 'bias': jnp.sum(ct, axis=(0, 1))}
      else:  # The layer's own weight-gradient computation (vjp).
        a = jnp.where(rows(a), a, jnp.zeros((), a.dtype))
        ct = jnp.where(rows(d), factor.reshape(rows(d).shape) * d, 0.0)
        out_, layer_vjp = jax.vjp(lambda t, a=a, l=l: jax.vmap(
            lambda a_i: l.module.apply({'params': t}, a_i))(a), theta)
        # theta is the float32 master copy: under bfloat16 compute the
        # re-applied layer's output (hence its cotangent) is float32.
        grads = layer_vjp(ct.astype(out_.dtype))[0]
      for name in l.param_names:
        out[l.param_path + (name,)] = grads[name].astype(
            theta[name].dtype).reshape(theta[name].shape)
    for path, g in zip(coverage.materialised, copy_grads):
      out[path] = _masked_row_sum(factor, g, keep)
    return jax.tree_util.tree_unflatten(jax.tree.structure(params),
                                        [out[p] for p in flat])

  return GhostPass(losses, logits, sq_norms, by_path, weighted_sum)


def per_example_sq_norms(loss_fn: LossFn, params: Params, x: jax.Array,
                         y: jax.Array) -> jax.Array:
  """‖g_i‖² [n] over all parameters by ghost norms (no per-example grads)."""
  return ghost_pass(loss_fn, params, x, y).sq_norms
