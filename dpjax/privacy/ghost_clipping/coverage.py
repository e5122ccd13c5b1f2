"""Which parameters ghost clipping covers: proved at trace time from the model's calls.

Every parameter leaf must be read by exactly one call of a layer with a
registered norm rule (`registry`), and a dependency analysis of the jaxpr
(each covered call's input and output replaced by fresh variables) must show
that the call's output depends on exactly that layer's parameters and the
loss on none of them except through covered outputs. Parameters declared
directly in a module that calls other modules get one copy per example.
"""

from __future__ import annotations

from collections.abc import Callable
import collections
import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp

from dpjax.privacy import lora
from dpjax.privacy.ghost_clipping import mixed
from dpjax.privacy.ghost_clipping import nnx_layers
from dpjax.privacy.ghost_clipping.registry import NormRule
from dpjax.privacy.ghost_clipping.registry import rule_for

Params = Any
LeafPath = tuple[str, ...]
CallKey = tuple[tuple[str, ...], str, int]  # (module path, method, index).
LossFn = Callable[[Params, Any], tuple[jax.Array, Any]]  # (params, example) -> (loss, aux).


@dataclasses.dataclass(frozen=True)
class Layer:
  """One call of a covered layer."""

  key: CallKey
  rule: NormRule  # Its registered rule (registry.RULES).
  module: nn.Module  # Unbound clone: attributes, and re-application.
  param_path: tuple[str, ...]
  param_names: tuple[str, ...]  # Leaves directly under param_path.
  in_aval: jax.ShapeDtypeStruct  # Per-example input.
  out_aval: jax.ShapeDtypeStruct  # Per-example output.
  lora_scale: float | None = None  # s = α/r if its kernel is LoRA-adapted (`privacy.lora`).


def layer_form(layer: Layer) -> str:
  """The form the layer's norm takes (its rule's `form`, under `mixed.chosen_forms`)."""
  with mixed.layer_scope(layer.key):
    return layer.rule.form(layer)


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
    rules = collections.Counter(l.rule.name for l in self.layers)
    text = (
      f'{len(self.layers)} layers by ghost/book-keeping '
      f'({", ".join(f"{r} {k}" for r, k in sorted(rules.items()))})'
    )
    if self.materialised:
      text += '; per-example copies of ' + ', '.join('/'.join(p) for p in self.materialised)
    if self.uncovered:
      text += '; UNCOVERED: ' + '; '.join(f'{p} ({why})' for p, why in self.uncovered)
    return text

  def layer_forms(self) -> list[str]:
    """One line per covered call: its parameters, rule and the form of its norm.

    The form follows from the call's static shapes (the mixed rule of Bu et
    al. 2022 for linear maps): e.g. 'Conv_0: conv materialised (S=256, m=27,
    c=16)'; parameters with per-example copies are listed last.
    """
    lines = [
      f'{"/".join(l.param_path) or "(root)"}: {l.rule.name}'
      + (f' {layer_form(l)}' if l.rule.form else '')
      for l in self.layers
    ]
    return lines + [f'{"/".join(p)}: per-example copy' for p in self.materialised]


class Interceptor:
  """Calls `on_call(key, next_fun, args, kwargs, ctx)` for each module call.

  Methods a module calls on itself are part of the enclosing call and are not
  reported. Keys count calls per (path, method), so a second call of a layer
  has a different key.
  """

  def __init__(self, on_call):
    self._on_call = on_call
    self._count = collections.Counter()
    self._stack = []
    self.containers = set()  # Paths of NNX modules that are not layers (`nnx_layers`).

  def __call__(self, next_fun, args, kwargs, ctx):
    path = tuple(ctx.path) if hasattr(ctx, 'path') else tuple(ctx.module.path)
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


def leaf_paths(tree) -> list[LeafPath]:
  """Each leaf's path as strings (dict keys, attribute names, indices), in tree order."""

  def name(k):
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)

  return [tuple(name(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def subtree(params, path):
  """params at a leaf or module path of `leaf_paths`."""
  for k in path:  # NNX lists have int keys; leaf paths name them as strings.
    params = params[k] if k in params else params[int(k)]
  return params


def _aval(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _rule_for(module: nn.Module, method: str, args, kwargs) -> tuple[NormRule | None, str]:
  """(rule, '') if this call is covered, else (None, reason)."""
  kind = type(module).__name__
  rule, reason = rule_for(type(module))
  if rule is None:
    return None, reason
  if method != '__call__':
    return None, f'{kind}.{method} is not a covered use'
  if kwargs or len(args) != 1 or not hasattr(args[0], 'shape'):
    return None, f'{kind} called with arguments other than one array'
  reason = rule.check(module) if rule.check else ''
  return (None, reason) if reason else (rule, '')


def run_intercepted(loss_fn: LossFn, interceptor: Interceptor, params, example):
  """loss_fn(params, example) with every linen and NNX layer call seen by `interceptor`."""
  with nn.intercept_methods(interceptor), nnx_layers.intercepting(interceptor):
    return loss_fn(params, example)


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
  return [0 if isinstance(v, jax_core.Literal) else deps.get(v, 0) for v in jaxpr.outvars]


def analyse_coverage(loss_fn: LossFn, params: Params, example) -> Coverage:
  """Which parameters ghost clipping covers, for ONE example.

  Only abstract traces (shapes), so it may run inside jit (at trace time).

  Args:
    loss_fn: `(params, example) -> (loss, aux)` for a single example.
    params: parameters (arrays or ShapeDtypeStructs).
    example: one example (a pytree of arrays or ShapeDtypeStructs).

  Returns:
    The Coverage: covered layer calls, parameters given per-example copies,
    and uncovered parameters with the reason.
  """
  params = jax.tree.map(_aval, params)
  example = jax.tree.map(_aval, example)
  paths = leaf_paths(params)
  calls, containers, scales = _record_calls(loss_fn, params, example)
  candidates, reasons = _candidates(calls, paths, scales)
  layers = _proved(loss_fn, params, example, candidates, paths, reasons)
  materialised, uncovered = _leftover_leaves(paths, layers, calls, containers, reasons)
  return Coverage(tuple(layers), tuple(materialised), tuple(uncovered))


def _record_calls(loss_fn: LossFn, params, example) -> tuple[list[tuple], set, dict]:
  """Every module call of one abstract forward pass, the NNX containers' paths, and the
  LoRA scale s of each adapted layer's module path (`lora.scale_of` during the call).

  A call is (key, module, rule, reason, in_aval, out_aval): rule None (with the
  reason) unless the call is covered, avals only for covered calls.
  """
  calls = []
  in_rule = []
  scales = {}

  def record(key, next_fun, args, kwargs, ctx):
    reason = getattr(ctx, 'reason', '')  # An NNX layer dpjax cannot see as a linen one.
    rule, reason = (
      (None, reason) if reason else _rule_for(ctx.module, ctx.method_name, args, kwargs)
    )
    if any(in_rule):
      rule, reason = None, 'called inside another covered layer'
    in_rule.append(rule is not None)
    if lora.scale_of(key[0]) is not None:
      scales[key[0]] = lora.scale_of(key[0])
    try:
      out = next_fun(*args, **kwargs)
    finally:
      in_rule.pop()
    if rule and not hasattr(out, 'shape'):
      rule, reason = None, 'output is not one array'
    calls.append(
      (
        key,
        ctx.module.clone(parent=None) if ctx.module else None,
        rule,
        reason,
        _aval(args[0]) if rule else None,
        _aval(out) if rule else None,
      )
    )
    return out

  recorder = Interceptor(record)
  jax.eval_shape(functools.partial(run_intercepted, loss_fn, recorder), params, example)
  return calls, recorder.containers, scales


def _candidates(
  calls: list[tuple], paths: list[LeafPath], scales: dict
) -> tuple[list[Layer], dict]:
  """Covered calls that read exactly their rule's parameters, once; and {module path: why not}."""
  uses = collections.Counter(key[0] for key, *_ in calls)
  reasons = {}  # Module path -> why its parameters are not covered.
  candidates = []
  for key, module, rule, reason, in_aval, out_aval in calls:
    path = key[0]
    own = [p for p in paths if p[: len(path)] == path]
    names = {p[-1] for p in own}
    if not rule:
      reasons.setdefault(path, reason)
    elif uses[path] > 1:
      reasons[path] = f'{type(module).__name__} called {uses[path]} times'
    elif any(len(p) != len(path) + 1 for p in own) or not rule.accepts(names):
      reasons[path] = f'unexpected parameters {sorted(names)}'
    elif own:
      candidates.append(
        Layer(
          key, rule, module, path, tuple(p[-1] for p in own), in_aval, out_aval, scales.get(path)
        )
      )
  return candidates, reasons


def _proved(
  loss_fn: LossFn, params, example, candidates: list[Layer], paths: list[LeafPath], reasons: dict
) -> list[Layer]:
  """The candidates whose coverage the jaxpr's dependencies prove; `reasons` gets the others'.

  Every candidate call gets a fresh input and a fresh output; its output must
  depend on exactly its own parameters, and the loss on none of them.
  """
  index = {c.key: j for j, c in enumerate(candidates)}

  def substituted(p, fresh_in, fresh_out, example):
    outs = [None] * len(candidates)

    def swap(key, next_fun, args, kwargs, ctx):
      del ctx
      j = index.get(key)
      if j is None:
        return next_fun(*args, **kwargs)
      outs[j] = next_fun(fresh_in[j])
      return fresh_out[j]

    loss, _ = run_intercepted(loss_fn, Interceptor(swap), p, example)
    return loss, outs

  jaxpr = jax.make_jaxpr(substituted)(
    params, [c.in_aval for c in candidates], [c.out_aval for c in candidates], example
  )
  deps = _dependencies(jaxpr, len(paths))
  loss_deps, out_deps = deps[0], deps[1:]
  bit = {p: 1 << i for i, p in enumerate(paths)}
  layers = []
  for c, d in zip(candidates, out_deps):
    own = sum(bit[c.param_path + (n,)] for n in c.param_names)
    if d != own:
      reasons[c.param_path] = 'output depends on other parameters'
    elif loss_deps & own:
      reasons[c.param_path] = (
        'parameters also used outside the layer call (e.g. tied weights or a loss term)'
      )
    else:
      layers.append(c)
  return layers


def _leftover_leaves(
  paths: list[LeafPath], layers: list[Layer], calls: list[tuple], containers: set, reasons: dict
) -> tuple[list, list]:
  """(materialised, uncovered) among the leaves no proved layer covers.

  A leaf declared directly in a module that calls other modules (e.g. a
  positional embedding in a model body) gets one copy per example.
  """
  uses = collections.Counter(key[0] for key, *_ in calls)
  kinds = {key[0]: type(module) for key, module, *_ in calls}
  covered = {c.param_path + (n,) for c in layers for n in c.param_names}
  materialised, uncovered = [], []
  for p in paths:
    if p in covered:
      continue
    owner = p[:-1]
    has_children = any(len(q) > len(owner) and q[: len(owner)] == owner for q in uses)
    container = (owner in kinds and rule_for(kinds[owner])[0] is None) or owner in containers
    if container and has_children:
      materialised.append(p)  # Declared in a model body, e.g. pos_embedding.
    else:
      uncovered.append(('/'.join(p), reasons.get(owner, 'not read by a covered layer call')))
  return materialised, uncovered
