"""Flax NNX models as functions of a parameter dict, which per-example gradients and ghost clipping need.

DP-SGD differentiates each example's loss with respect to the parameters, so a
model must be a function `(params, example) -> loss`. An `nnx.Module` becomes
one by `nnx.split` into a graph definition and its state and `nnx.merge` back
inside the function (the NNX way to use JAX transforms). `Functional` does that
and, while the loss runs, names each layer call by its path in the model, so
the NNX layer rules of ghost clipping (`dpjax.privacy.ghost_clipping.nnx_layers`) see
the layers:

  model = MyCNN(rngs=nnx.Rngs(0))
  fm = dpjax.models.functional.Functional(model)           # trainable: nnx.Param
  loss_fn = fm.loss(lambda m, ex: optax.softmax_cross_entropy_with_integer_labels(
      m(ex['x'][None])[0], ex['y']))
  grad_fn = dpjax.clipped_grad(loss_fn, clip_norm=1.0)
  g, rows = grad_fn(fm.params, examples, weights)
  ...
  fm.update(model, params)                          # write trained parameters back

`wrt` chooses what is trained (an NNX filter, e.g. `nnx.LoRAParam` to train only
LoRA adapters); everything else (frozen parameters, constants) is merged in as
it is. Models must be per-example functions that write no state: no BatchNorm
statistics, no dropout RNG stored in the model (pass each example's dropout key in
the batch: README, "Dropout and BatchNorm in your own loop"); `clipped_grad` says
so (`dpjax.privacy.stateful_layers`) where Flax's error would not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from dpjax.privacy.ghost_clipping import nnx_layers

Params = dict[str, Any]


class Functional:
  """An NNX module split into (graphdef, trainable params as a plain dict, the rest)."""

  def __init__(self, model: nnx.Module, wrt: Any = nnx.Param):
    if not isinstance(model, nnx.Module):
      raise TypeError(f'Functional takes an nnx.Module, got {type(model).__name__}.')
    self._wrt = wrt
    self.graphdef, state, self.rest = nnx.split(model, wrt, ...)
    self._template = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state)
    self.params: Params = string_keys(state.to_pure_dict())

  def merge(self, params: Params) -> nnx.Module:
    """A module with `params` (arrays or tracers) in place of the trainable state."""
    state = jax.tree.map(lambda v: v, self._template)  # A fresh copy to fill in.
    nnx.replace_by_pure_dict(state, _graph_keys(params, state))
    return nnx.merge(self.graphdef, state, self.rest)

  def apply(self, params: Params, *args, **kwargs):
    """model(*args, **kwargs) with `params`, its layer calls named for ghost clipping."""
    model = self.merge(params)
    with nnx_layers.model_paths(model):
      return model(*args, **kwargs)

  def loss(self, fn: Callable[..., Any]) -> Callable[[Params, Any], Any]:
    """`fn(model, example)` as `(params, example) -> fn(merged model, example)`."""

    def loss_fn(params: Params, example):
      model = self.merge(params)
      with nnx_layers.model_paths(model):
        return fn(model, example)

    return loss_fn

  def update(self, model: nnx.Module, params: Params) -> None:
    """Write `params` into `model` (in place), e.g. after training."""
    state = nnx.state(model, self._wrt)
    nnx.replace_by_pure_dict(state, _graph_keys(params, state))
    nnx.update(model, state)


def string_keys(tree: Any) -> Any:
  """The pure dict with every key a string (NNX lists have int keys; checkpoints and
  parameter paths name them as strings)."""
  if isinstance(tree, dict):
    return {str(k): string_keys(v) for k, v in tree.items()}
  return tree


def _graph_keys(params: Any, state: Any) -> Any:
  """`params` with the keys `state` uses (ints where the model has lists)."""
  if not isinstance(params, dict):
    return params
  keys = {str(k): k for k in state.keys()}
  return {keys.get(k, k): _graph_keys(v, state[keys.get(k, k)]) for k, v in params.items()}


class NNXModule:
  """A constructor of an NNX model with linen's `init` / `apply`, for the trainer.

  `init(key, x)` builds the model with `nnx.Rngs(key)` and returns `{'params':
  dict}`; `apply({'params': p}, x)` runs it with p. So every part of the trainer
  that takes a linen module (the DP step, evaluation, checkpoints) takes an NNX
  model unchanged. Hashable by identity (the jitted evaluation keys on it).
  """

  def __init__(self, make: Callable[[nnx.Rngs], nnx.Module], name: str = ''):
    self.make = make
    self.name = name or getattr(make, '__name__', 'nnx model')
    self._functional = None

  def _fm(self) -> Functional:
    if self._functional is None:  # The graph and constants (its parameters are replaced).
      self._functional = Functional(self.make(nnx.Rngs(0)))
    return self._functional

  def init(self, key: jax.Array, *unused_args, **unused_kwargs) -> dict[str, Params]:
    model = self.make(nnx.Rngs(params=key))
    return {'params': string_keys(nnx.state(model, nnx.Param).to_pure_dict())}

  def apply(self, variables: dict[str, Params], *args, **kwargs):
    return self._fm().apply(variables['params'], *args, **kwargs)

  def __repr__(self) -> str:
    return f'NNXModule({self.name})'
