"""The ghost pass: one forward and one activation-backward pass, then norms and the clipped sum.

`flax.linen.intercept_methods` sees every call of a covered layer, records its
input, and adds a zero perturbation to its output; the gradient of Σ_i loss_i
w.r.t. the perturbations is δ_i for every example at once. Each layer's rule
turns (a, δ) into ‖g_i‖² over its parameters; the clipped sum Σ_i f_i·g_i is
book-kept layer by layer from the same tensors (Bu et al. 2023).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

from dpjax.privacy.ghost_clipping import mixed
from dpjax.privacy.rounding import weighted_row_sum
from dpjax.privacy.ghost_clipping.coverage import leaf_paths
from dpjax.privacy.ghost_clipping.coverage import Interceptor
from dpjax.privacy.ghost_clipping.coverage import run_intercepted
from dpjax.privacy.ghost_clipping.coverage import subtree
from dpjax.privacy.ghost_clipping.coverage import analyse_coverage
from dpjax.privacy.ghost_clipping.coverage import Coverage
from dpjax.privacy.ghost_clipping.coverage import Layer
from dpjax.privacy.ghost_clipping.coverage import LossFn
from dpjax.privacy.ghost_clipping.coverage import Params
from dpjax.privacy.ghost_clipping.normalization import tree_sq_norms


def layer_norms(layer: Layer, theta: dict, a: jax.Array, d: jax.Array):
  """(‖g_i‖² over the layer's parameters [n], grads, operands), by the layer's rule.

  a: the layer's inputs [n, *in]; d: gradients of Σ loss w.r.t. its outputs
  [n, *out]; theta: its parameters. `grads` are per-example gradients
  {name: [n, *shape]} of small layers (norms, a small vocabulary), else None;
  `operands` are a rule's own `weighted_sum(factor, keep) -> {param: sum}` (WSConv), or
  (a2 [n, S, m], d2 [n, S, c]) of a dense layer, whose clipped
  sum is the matmul a2ᵀ(f·d2); else None (use the layer's own vjp).
  """
  with mixed.layer_scope(layer.key):  # Its form: `mixed.chosen_forms`, else the FLOP rule.
    return layer.rule.sq_norms(layer, theta, a, d.astype(jnp.float32))


def layer_weighted_sum(
  layer: Layer, theta: dict, a: jax.Array, d: jax.Array, part, factor: jax.Array, keep: jax.Array
) -> dict:
  """Σ_i factor_i · g_i {param name: sum} of one layer (rows with keep_i False add exactly
  zero), from its captured (a, δ) and `part` = its `layer_norms` (Bu et al. 2023)."""
  _, grads, operands = part
  rows = lambda v: keep.reshape((-1,) + (1,) * (v.ndim - 1))
  if grads is not None:  # Materialised: Σ_i f_i g_i.
    return jax.tree.map(lambda g: weighted_row_sum(factor, g, keep), grads)
  if callable(operands):  # The rule's own weighted sum (e.g. WSConv's).
    return operands(factor, keep)
  if operands is not None:  # Linear layer: a2ᵀ (f · d2).
    a2, d2 = operands
    a2 = jnp.where(rows(a2), a2, 0.0)
    ct = jnp.where(rows(d2), factor[:, None, None] * d2, 0.0)
    return {'kernel': jnp.einsum('nsm,nsc->mc', a2, ct), 'bias': jnp.sum(ct, axis=(0, 1))}
  # The layer's own weight-gradient computation (vjp).
  a = jnp.where(rows(a), a, jnp.zeros((), a.dtype))
  if jnp.issubdtype(a.dtype, jnp.floating):  # Not Embed's tokens.
    a = a.astype(jnp.promote_types(a.dtype, jnp.float32))
  ct = jnp.where(rows(d), factor.reshape(rows(d).shape) * d, 0.0)
  out_, layer_vjp = jax.vjp(
    lambda t: jax.vmap(lambda a_i: layer.module.apply({'params': t}, a_i))(a), theta
  )
  # theta is the float32 master copy: under bfloat16 compute the captured input is cast to
  # float32 too (layers that do not promote dtypes, e.g. WSConv's lax.conv, reject mixed
  # ones), so the re-applied layer's output (hence its cotangent) is float32.
  return layer_vjp(ct.astype(out_.dtype))[0]


# ----------------------------------------------------------------------------
# The ghost pass.
# ----------------------------------------------------------------------------


class GhostPass(
  collections.namedtuple('GhostPass', 'losses aux sq_norms sq_norms_by_path weighted_sum')
):
  """Per-example losses, the loss's aux, ‖g_i‖², and `weighted_sum(factor, keep)`.

  `sq_norms_by_path` maps 'module/path' (a covered layer) or
  'module/path/leaf' (a per-example copy) to that part of ‖g_i‖² [n].

  `weighted_sum(factor, keep)` = Σ_i factor_i · g_i over rows with keep_i
  True, with the structure of params (book-keeping from the captured
  tensors); rows with keep_i False contribute exactly zero even if their
  inputs or gradients are not finite.
  """


def ghost_pass(
  loss_fn: LossFn, params: Params, examples, coverage: Coverage | None = None
) -> GhostPass:
  """One forward and one activation-backward pass over a batch of examples.

  Args:
    loss_fn: single-example loss `(params, example) -> (loss_i, aux_i)`.
    params: parameters.
    examples: the rows (a pytree, every leaf with a leading axis n).
    coverage: from `analyse_coverage` (computed if None); must be complete.

  Returns:
    GhostPass with losses [n], aux (rows stacked), sq_norms [n] (‖g_i‖² over all
    parameters) and weighted_sum.
  """
  if coverage is None:
    coverage = analyse_coverage(loss_fn, params, jax.tree.map(lambda l: l[0], examples))
  if not coverage.complete:
    raise ValueError('ghost clipping does not cover these parameters: ' + coverage.describe())
  flat = dict(zip(leaf_paths(params), jax.tree.leaves(params)))
  losses, aux, inputs, deltas, copy_grads = _capture(loss_fn, params, flat, examples, coverage)
  layers = coverage.layers
  thetas = [subtree(params, l.param_path) for l in layers]
  parts = [layer_norms(l, t, a, d) for l, t, a, d in zip(layers, thetas, inputs, deltas)]
  by_path = {'/'.join(l.param_path): sq for l, (sq, _, _) in zip(layers, parts)}
  by_path.update({'/'.join(p): tree_sq_norms(g) for p, g in zip(coverage.materialised, copy_grads)})
  sq_norms = sum(by_path.values())
  weighted_sum = _book_keeping(params, flat, coverage, thetas, inputs, deltas, parts, copy_grads)
  return GhostPass(losses, aux, sq_norms, by_path, weighted_sum)


def _capture(loss_fn: LossFn, params: Params, flat: dict, examples, coverage: Coverage):
  """(losses [n], aux, inputs a, output gradients δ, per-example copies' gradients).

  Each covered call's input is recorded and a zero perturbation added to its
  output; the gradient of Σ_i loss_i w.r.t. the perturbations is δ_i for every
  example at once (examples do not interact). flat: {leaf path: leaf} of params.
  """
  n = jax.tree.leaves(examples)[0].shape[0]
  layers = coverage.layers
  index = {l.key: j for j, l in enumerate(layers)}
  copies = [jnp.broadcast_to(flat[p], (n, *jnp.shape(flat[p]))) for p in coverage.materialised]
  zeros = [jnp.zeros((n, *l.out_aval.shape), l.out_aval.dtype) for l in layers]

  def one(copies_i, perturbations_i, example):
    replace = dict(zip(coverage.materialised, copies_i))
    p = jax.tree_util.tree_unflatten(
      jax.tree.structure(params), [replace.get(path, leaf) for path, leaf in flat.items()]
    )
    inputs = [None] * len(layers)

    def capture(key, next_fun, args, kwargs, ctx):
      del ctx
      j = index.get(key)
      if j is None:
        return next_fun(*args, **kwargs)
      inputs[j] = args[0]
      return next_fun(*args, **kwargs) + perturbations_i[j]

    loss, aux = run_intercepted(loss_fn, Interceptor(capture), p, example)
    return loss, (aux, inputs)

  def batched(copies, perturbations):
    return jax.vmap(one)(copies, perturbations, examples)

  losses, vjp, (aux, inputs) = jax.vjp(batched, copies, zeros, has_aux=True)
  copy_grads, deltas = vjp(jnp.ones_like(losses))
  return losses, aux, inputs, deltas, copy_grads


def _book_keeping(
  params: Params, flat: dict, coverage: Coverage, thetas, inputs, deltas, parts, copy_grads
):
  """`weighted_sum(factor, keep)` = Σ_i factor_i·g_i from the captured (a, δ) (Bu et al. 2023)."""

  def weighted_sum(factor: jax.Array, keep: jax.Array) -> Params:
    out = {}
    for l, theta, a, d, part in zip(coverage.layers, thetas, inputs, deltas, parts):
      grads = layer_weighted_sum(l, theta, a, d, part, factor, keep)
      for name in l.param_names:
        out[l.param_path + (name,)] = (
          grads[name].astype(theta[name].dtype).reshape(theta[name].shape)
        )
    for path, g in zip(coverage.materialised, copy_grads):
      out[path] = weighted_row_sum(factor, g, keep)
    return jax.tree_util.tree_unflatten(jax.tree.structure(params), [out[p] for p in flat])

  return weighted_sum


def per_example_sq_norms(loss_fn: LossFn, params: Params, examples) -> jax.Array:
  """‖g_i‖² [n] over all parameters by ghost norms (no per-example grads)."""
  return ghost_pass(loss_fn, params, examples).sq_norms
