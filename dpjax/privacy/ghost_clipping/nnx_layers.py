"""Ghost clipping for Flax NNX layers: each covered NNX layer is seen as the linen layer it computes.

An `nnx.Linear`, `LinearGeneral`, `Conv`, `Embed`, `LayerNorm`, `GroupNorm` or
`RMSNorm` computes what the linen `Dense`, `DenseGeneral`, `Conv`, `Embed`,
`LayerNorm`, `GroupNorm` or `RMSNorm` with the same attributes computes, with
parameters of the same names and shapes. So the linen rules (`registry`) and the
coverage proof (`coverage`) apply unchanged once a call of the NNX layer is
reported with its linen twin: `translate` builds the twin, or says why the
layer's configuration has none (a custom `dot_general` or `promote_dtype`, a
batch axis, a cross-device axis name), in which case its parameters are
uncovered and 'auto' clipping falls back to per-example gradients.

How calls are seen: while `intercepting(interceptor)` is active, the covered
classes' `__call__` report to the interceptor, but only for modules of a model
registered by `model_paths(root)` (which `dpjax.models.functional` does after it merges
the parameters), so that each call is named by the module's path in the model
graph, the path its parameters have in the parameter dict. Modules that are not
layers (a model's own `nnx.Param`, e.g. a positional embedding) are reported as
containers: their parameters get per-example copies, as in linen.

Register another NNX layer with `@register_nnx_layer(MyLayer)` on a function
returning its linen twin (whose type has a norm rule) or a reason string.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import contextvars
import dataclasses
import inspect
from typing import Any

import flax.linen as nn
from flax import nnx

# NNX layer type -> module -> its linen twin, or why it has none.
TRANSLATORS: dict[type, Callable[[Any], nn.Module | str]] = {}

_ACTIVE = contextvars.ContextVar('dpjax_nnx_interceptor', default=None)
_PATHS = contextvars.ContextVar('dpjax_nnx_paths', default=None)
_ORIGINAL_CALLS: dict[type, Callable] = {}


@dataclasses.dataclass(frozen=True)
class CallContext:
  """What the coverage interceptor reads of one call (linen's InterceptorContext, for NNX)."""

  module: nn.Module | None  # The linen twin (None when reason is set).
  method_name: str
  path: tuple[str, ...]
  reason: str = ''  # Why this layer has no twin ('' when it has one).


def register_nnx_layer(*nnx_types: type):
  """Decorator registering `translate(module) -> linen twin | reason` for NNX layer types."""

  def register(fn):
    for t in nnx_types:
      TRANSLATORS[t] = fn
    return fn

  return register


def translator_for(layer_type: type) -> Callable[[Any], nn.Module | str] | None:
  for base in layer_type.__mro__:
    if base in TRANSLATORS:
      return TRANSLATORS[base]
  return None


def translate(module) -> nn.Module | str:
  """The linen twin of an NNX layer, or why it has none."""
  fn = translator_for(type(module))
  return fn(module) if fn else f'{type(module).__name__} has no ghost rule'


def _default(cls: type, name: str):
  return inspect.signature(cls.__init__).parameters[name].default


def _plain(module, cls: type, *names: str) -> str:
  """'' if the module's hooks (dot_general, promote_dtype, ...) are the class defaults."""
  for name in names:
    value = getattr(module, name, None)
    if value is not None and value is not _default(cls, name):
      return f'{type(module).__name__} with a custom {name}'
  if getattr(module, 'preferred_element_type', None) is not None:
    return f'{type(module).__name__} with preferred_element_type'
  return ''


@register_nnx_layer(nnx.Linear)
def _linear(m) -> nn.Module | str:
  return _plain(m, nnx.Linear, 'dot_general', 'promote_dtype') or nn.Dense(
    features=m.out_features, use_bias=m.use_bias, dtype=m.dtype, precision=m.precision, parent=None
  )


@register_nnx_layer(nnx.LinearGeneral)
def _linear_general(m) -> nn.Module | str:
  reason = _plain(m, nnx.LinearGeneral, 'promote_dtype')
  if m.dot_general is not None or m.dot_general_cls is not None:
    reason = 'LinearGeneral with a custom dot_general'
  if m.batch_axis:
    reason = 'LinearGeneral with batch_axis'
  return reason or nn.DenseGeneral(
    features=tuple(m.out_features),
    axis=m.axis,
    use_bias=m.use_bias,
    dtype=m.dtype,
    precision=m.precision,
    parent=None,
  )


@register_nnx_layer(nnx.Conv)
def _conv(m) -> nn.Module | str:
  return _plain(m, nnx.Conv, 'conv_general_dilated', 'promote_dtype') or nn.Conv(
    features=m.out_features,
    kernel_size=tuple(m.kernel_size),
    strides=m.strides,
    padding=m.padding,
    input_dilation=m.input_dilation,
    kernel_dilation=m.kernel_dilation,
    feature_group_count=m.feature_group_count,
    use_bias=m.use_bias,
    mask=m.mask,
    dtype=m.dtype,
    precision=m.precision,
    parent=None,
  )


@register_nnx_layer(nnx.Embed)
def _embed(m) -> nn.Module | str:
  return _plain(m, nnx.Embed, 'promote_dtype') or nn.Embed(
    num_embeddings=m.num_embeddings, features=m.features, dtype=m.dtype, parent=None
  )


def _norm_reason(m, cls: type) -> str:
  if m.axis_name is not None:
    return f'{type(m).__name__} with axis_name (statistics across devices)'
  return _plain(m, cls, 'promote_dtype')


# Each NNX norm layer -> its linen twin and the hyper-parameters the two share.
_NORM_TWINS = {
  nnx.LayerNorm: (
    nn.LayerNorm,
    (
      'epsilon',
      'dtype',
      'use_bias',
      'use_scale',
      'reduction_axes',
      'feature_axes',
      'use_fast_variance',
    ),
  ),
  nnx.GroupNorm: (
    nn.GroupNorm,
    (
      'num_groups',
      'epsilon',
      'dtype',
      'use_bias',
      'use_scale',
      'reduction_axes',
      'use_fast_variance',
    ),
  ),
  nnx.RMSNorm: (
    nn.RMSNorm,
    ('epsilon', 'dtype', 'use_scale', 'reduction_axes', 'feature_axes', 'use_fast_variance'),
  ),
}


def _norm_translator(nnx_type: type, linen_type: type, names: tuple[str, ...]):
  def translate(m) -> nn.Module | str:
    return _norm_reason(m, nnx_type) or linen_type(**{n: getattr(m, n) for n in names}, parent=None)

  return translate


for _nnx_type, (_linen_type, _names) in _NORM_TWINS.items():
  register_nnx_layer(_nnx_type)(_norm_translator(_nnx_type, _linen_type, _names))


def _patched(original: Callable) -> Callable:
  defaults = {
    name: p.default
    for name, p in inspect.signature(original).parameters.items()
    if p.default is not inspect.Parameter.empty
  }

  def __call__(self, *args, **kwargs):  # pylint: disable=invalid-name
    interceptor, paths = _ACTIVE.get(), _PATHS.get()
    path = paths.get(id(self)) if interceptor is not None and paths else None
    if path is None:  # Not tracing for ghost clipping, or a module outside the model.
      return original(self, *args, **kwargs)
    # Keyword arguments at their defaults (e.g. LinearGeneral's out_sharding=None, passed by
    # MultiHeadAttention) change nothing: the call is the one-array call the rule covers.
    kwargs = {k: v for k, v in kwargs.items() if k not in defaults or v is not defaults[k]}
    twin = translate(self)
    reason = twin if isinstance(twin, str) else ''
    ctx = CallContext(None if reason else twin, '__call__', path, reason)
    return interceptor(lambda *a, **k: original(self, *a, **k), args, kwargs, ctx)

  __call__.dpjax_original = original
  return __call__


@contextlib.contextmanager
def intercepting(interceptor) -> Iterator[None]:
  """Report calls of the registered NNX layers (of `model_paths` models) to `interceptor`.

  `interceptor(next_fun, args, kwargs, ctx)` as `flax.linen.intercept_methods`'s,
  with ctx a `CallContext`. The classes are patched only while some
  `intercepting` is active.
  """
  install = not _ORIGINAL_CALLS
  if install:
    for t in TRANSLATORS:
      _ORIGINAL_CALLS[t] = t.__dict__['__call__']
      t.__call__ = _patched(_ORIGINAL_CALLS[t])
  token = _ACTIVE.set(interceptor)
  try:
    yield
  finally:
    _ACTIVE.reset(token)
    if install:
      for t, original in _ORIGINAL_CALLS.items():
        t.__call__ = original
      _ORIGINAL_CALLS.clear()


@contextlib.contextmanager
def model_paths(root) -> Iterator[None]:
  """Name the calls of `root`'s layers by their graph paths while the block runs."""
  paths, containers = {}, set()
  for path, node in nnx.iter_graph(root):
    if isinstance(node, nnx.Module):
      key = tuple(str(k) for k in path)
      paths[id(node)] = key
      if translator_for(type(node)) is None:
        containers.add(key)
  interceptor = _ACTIVE.get()
  if interceptor is not None and hasattr(interceptor, 'containers'):
    interceptor.containers |= containers
  token = _PATHS.set(paths)
  try:
    yield
  finally:
    _PATHS.reset(token)
