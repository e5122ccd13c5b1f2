"""BatchNorm and Dropout inside a per-example loss: Flax's error, told as what to do instead.

DP-SGD differentiates one example's loss at a time, so the model must be a function of that
example alone, with no state written during the call:

* BatchNorm normalises with statistics of the batch: an example's output depends on the
  others in its batch, so it has no per-example gradient, and a change of one example moves
  every other example's gradient, which clipping does not bound. It is not DP-compatible
  across examples. GroupNorm and LayerNorm normalise within one example (ghost clipping covers
  both); a BatchNorm with frozen statistics (`use_running_average=True`, statistics fixed or
  from public data) is a per-example affine map.
* Dropout is per-example, but its key must come with the example. An NNX `Dropout` built
  with `rngs` advances an RNG counter stored in the model, which a traced per-example loss
  cannot write; a linen `Dropout` without a 'dropout' RNG has none. Pass each example's key in
  the batch and give it to the call (README, "Dropout and BatchNorm in your own loop").

Flax reports the first as a `TraceContextError` ("Cannot mutate BatchStat / RngCount from a
different trace level") in NNX, or as a missing collection or RNG in linen, without saying
why. `explained(loss_fn)` is `loss_fn`, with those errors raised again as `StatefulLayerError`
naming the fix (Flax's error is its `__cause__`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from flax import errors as flax_errors

README = 'README, "Dropout and BatchNorm in your own loop"'
BATCH_NORM_FIX = (
  "BatchNorm normalises with statistics of the batch, so one example's output depends on "
  'the others: it has no per-example gradient and is not DP-compatible across examples. Use '
  'GroupNorm or LayerNorm (per example; ghost clipping covers both), or frozen statistics: '
  'BatchNorm(use_running_average=True) with statistics fixed or computed on public data.'
)
NNX_DROPOUT_FIX = (
  'nnx.Dropout built with rngs draws from a counter stored in the model, which a per-example '
  'loss cannot advance. Give each example its own key in the batch and pass it to the call: '
  'build nnx.Dropout(rate) without rngs, call self.drop(h, rngs=key), and in the loss '
  "m(example['x'][None], example['dropout_key']); make the keys of a physical batch as "
  'jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(root, step), i))(idx) '
  f'({README}).'
)
LINEN_DROPOUT_FIX = (
  "linen Dropout needs a 'dropout' RNG. Give each example its own key in the batch and pass "
  "it to the call: model.apply({'params': params}, example['x'][None], rngs={'dropout': "
  f"example['dropout_key']}}) ({README})."
)
NNX_STATE_FIX = (
  'the model writes NNX state (a Variable other than its parameters) during the call, which a '
  'per-example loss cannot do: DP-SGD needs a pure function of the parameters and one example.'
)


class StatefulLayerError(ValueError):
  """A layer keeps state that a per-example loss cannot use (BatchNorm statistics, a Dropout
  RNG stored in the model); the message names the fix."""


def fix_for(error: Exception) -> str | None:
  """What to do instead, for a Flax error raised by such a layer; None for any other error."""
  text = str(error)
  if isinstance(error, flax_errors.TraceContextError):
    if 'BatchStat' in text:
      return 'nnx.' + BATCH_NORM_FIX
    return NNX_DROPOUT_FIX if 'Rng' in text else NNX_STATE_FIX
  if isinstance(error, flax_errors.InvalidRngError) and 'dropout' in text:
    return LINEN_DROPOUT_FIX
  if isinstance(error, flax_errors.ScopeCollectionNotFound) and 'batch_stats' in text:
    return 'linen ' + BATCH_NORM_FIX
  return None


def explained(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
  """`loss_fn`, raising `StatefulLayerError` (with the fix) where a stateful layer fails."""

  @functools.wraps(loss_fn)
  def per_example_loss(*args, **kwargs):
    try:
      return loss_fn(*args, **kwargs)
    except (
      flax_errors.TraceContextError,
      flax_errors.InvalidRngError,
      flax_errors.ScopeCollectionNotFound,
    ) as e:
      fix = fix_for(e)
      if fix is None:
        raise
      raise StatefulLayerError(f'the per-example loss: {fix}') from e

  return per_example_loss
