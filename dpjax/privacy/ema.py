"""Exponential moving average (Polyak averaging) of the parameters.

With decay d > 0 and warm-up (De et al. 2022, "Unlocking High-Accuracy
Differentially Private Image Classification through Scale", §3 and App. C;
the warm-up is that of Tan & Le 2019 / TF's ExponentialMovingAverage with
num_updates):

  d_t = min(d, (1 + t) / (10 + t)),   ema_{t+1} = d_t · ema_t + (1 − d_t) · θ_{t+1},

where t counts the updates (0 for the first) and ema_0 = θ_0. The warm-up keeps
the average from being dominated by the random initialisation early on.

No privacy cost: the EMA is a deterministic function of the sequence of
released parameters θ_1, θ_2, ..., each of which is already a function of the
privatised (noisy) gradients only; by the post-processing property of DP
(Dwork & Roth 2014, Prop. 2.1) it satisfies the same (ε, δ) guarantee as the
parameters and needs no accounting.

Pure functions on a NamedTuple state (optax style), so it jits, shards and
checkpoints like the parameters.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Params = Any


class EmaState(NamedTuple):
  """The average and the number of updates folded into it."""

  params: Params
  count: jax.Array  # int32 scalar: t, the next update's index.


def check_decay(decay: float) -> float:
  """`ema_decay` must be in [0, 1) (0 = off); ValueError naming the field otherwise."""
  d = float(decay) if not isinstance(decay, bool) else math.nan
  if not (0.0 <= d < 1.0):
    raise ValueError(f'ema_decay = {decay!r}: must be a number in [0, 1) (0 = off).')
  return d


def init(params: Params) -> EmaState:
  """ema_0 = θ_0 (float32 copies, so a low-precision θ is averaged exactly enough)."""
  return EmaState(
    jax.tree.map(lambda p: jnp.asarray(p, jnp.result_type(p, jnp.float32)), params),
    jnp.zeros((), jnp.int32),
  )


def decay_at(decay: float, count: jax.Array) -> jax.Array:
  """d_t = min(d, (1 + t) / (10 + t))."""
  t = jnp.asarray(count, float)  # The default float: float64 under jax.enable_x64.
  return jnp.minimum(decay, (1.0 + t) / (10.0 + t))


def update(state: EmaState, params: Params, decay: float) -> EmaState:
  """ema ← d_t · ema + (1 − d_t) · θ with θ the parameters after step t; t ← t + 1.

  Call once per logical DP-SGD step, after the optimiser update.
  """
  d = decay_at(decay, state.count)
  new = jax.tree.map(lambda e, p: (d * e + (1.0 - d) * p).astype(e.dtype), state.params, params)
  return EmaState(new, state.count + 1)
