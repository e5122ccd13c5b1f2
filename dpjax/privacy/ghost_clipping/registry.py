"""The ghost-clipping norm rules, by layer type (Opacus' `register_grad_sampler`, for norms).

A rule says, for one layer family, which parameters a call reads and how to
compute each example's squared gradient norm over them from the call's input
a [n, *in] and output gradient d [n, *out] (the ghost form or materialised,
`dpjax.privacy.ghost_clipping.mixed`), and which configurations of the layer it
covers. Register one with

  @register_norm_rule(nn.Dense, name='dense', params=({'kernel'}, {'kernel', 'bias'}))
  def dense_sq_norms(layer, theta, a, d): ...   # -> (sq [n], grads or None, operands or None)

`rule_for(type)` matches a registered type exactly, or a subclass that does
not override `__call__` (a user's `class MyDense(nn.Dense)` changing only a
default); a subclass that overrides `__call__` may compute something else and
is reported by name as uncovered.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

import flax.linen as nn


@dataclasses.dataclass(frozen=True)
class NormRule:
  """How one layer family's per-example squared gradient norms are computed."""

  name: str
  sq_norms: Callable[..., tuple[Any, Any, Any]]  # (layer, theta, a, d) -> (sq, grads, operands).
  required: frozenset[str] | None = None  # Parameter names a call must read (None: any).
  allowed: frozenset[str] | None = None  # ... and may read.
  check: Callable[[nn.Module], str] | None = None  # '' if covered, else why not.
  form: Callable[[Any], str] | None = None  # Layer -> the form its norm takes (logs).
  also: tuple[tuple[frozenset[str], frozenset[str]], ...] = ()  # Other (required, allowed).

  def accepts(self, names: set[str]) -> bool:
    """Whether one call may read exactly these parameter names (any, when required is None)."""
    if self.required is None:
      return True
    pairs = ((self.required, self.allowed), *self.also)
    return any(required <= names <= allowed for required, allowed in pairs)


# Registered layer types -> their rule (see `register_norm_rule`).
RULES: dict[type, NormRule] = {}


def register_norm_rule(
  *layer_types: type,
  name: str,
  params: tuple[set[str], set[str]] | None = None,
  check: Callable[[nn.Module], str] | None = None,
  form: Callable[[Any], str] | None = None,
):
  """Decorator registering `fn(layer, theta, a, d)` as the norm rule of `layer_types`.

  Args:
    layer_types: flax module classes the rule covers (subclasses that keep
      `__call__` are matched too).
    name: the rule's name (logs, coverage summaries).
    params: (required, allowed) parameter names of one call; None: any
      parameters directly under the layer (normalisation layers).
    check: `module -> reason` ('' when this configuration is covered).
    form: `layer -> text`, the form the rule takes for this call's static
      shapes (e.g. 'ghost (S=64, m=144, c=32)'), logged per layer at start.
  """

  def register(fn):
    rule = NormRule(
      name,
      fn,
      None if params is None else frozenset(params[0]),
      None if params is None else frozenset(params[1]),
      check,
      form,
    )
    for layer_type in layer_types:
      RULES[layer_type] = rule
    return fn

  return register


def rule_for(layer_type: type) -> tuple[NormRule | None, str]:
  """(rule, '') for a layer class, or (None, why it is not covered)."""
  if layer_type in RULES:
    return RULES[layer_type], ''
  for base in layer_type.__mro__[1:]:
    if base in RULES:
      if layer_type.__call__ is base.__call__:
        return RULES[base], ''
      return None, (
        f'{layer_type.__name__} subclasses {base.__name__} but overrides '
        '__call__ (it may compute something else)'
      )
  return None, f'{layer_type.__name__} has no ghost rule'
