"""Several logical DP-SGD steps per compiled call: one dispatch for S steps.

A logical step of a small model runs in a fraction of a millisecond, less than
what the host spends dispatching it (argument handling, the launch, the
sampler): the device then waits on Python. `MultiStep` runs up to S logical
steps as one program — a `lax.fori_loop` over `count` ≤ S slots of a stacked
buffer [S, K_max, P] — each slot exactly `DPStep.train_step`'s body (K
physical batches accumulated, noise from noise_key(seed, t) drawn inside the
program, the optax update), followed, when `ema_decay` > 0, by the EMA update
(`dpjax.privacy.ema`), so the EMA costs no dispatch either. `count` is data: the last
call before a log, eval or checkpoint runs fewer steps with no recompilation,
so a run compiles this program once and every step of it runs the same
compiled code whatever its slot — a resume from any checkpoint reproduces the
uninterrupted run bit for bit. What a step computes does not depend on S;
privacy is untouched (same batches, same noise, same σ and C).

The same loop over hosts' physical-batch dispatches serves the DP step's
'host' loop mode (XLA:CPU convolutions, see `DPStep.physical_loop`): there
`__call__` runs the slots as K + 1 dispatches each, and the EMA beside them.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.privacy import dp_step
from dpjax.privacy import ema as ema_lib

AUTO_STEPS_PER_CALL = 16  # S when config.steps_per_call = 0 and the loop runs on the device.


def steps_per_call(requested: int, loop_mode: str, data_on_device: bool) -> int:
  """S: `requested` if > 0; else 16 with the loop and the data on the device, else 1.

  Host-gathered buffers hold the rows themselves (S·B of them per call): there
  the prefetch thread, not a longer program, hides the host.
  """
  if requested > 0:
    return int(requested)
  return AUTO_STEPS_PER_CALL if loop_mode == 'device' and data_on_device else 1


def schedule(start: int, stop: int, size: int, periods, limit=None):
  """Yields (first step, count) of each call covering the 0-based steps [start, stop).

  At most `size` steps a call (and at most `limit()` when given: `CallPacer`); a call ends
  where the host needs the parameters: after the first step of the run (compilation is
  timed apart), after every step count that is a multiple of one of `periods` (logs,
  evals, checkpoints; 0 = never) and at `stop`. A generator: O(1) memory at any length.
  """
  periods = [int(p) for p in periods if p > 0]
  first = start
  while first < stop:
    most = size if limit is None else max(1, min(size, int(limit())))
    end = min(
      [first + most, stop]
      + [(first // p + 1) * p for p in periods]
      + ([start + 1] if first == start else [])
    )
    yield first, end - first
    first = end


class CallPacer:
  """How many steps the next call may run: few enough that a call lasts about `target_seconds`.

  A signal is seen between calls, and `dispatched` returns once at most `max_in_flight` = 2
  calls are unfinished, so a signal finds the call running and at most two queued (the
  latest dispatched while the loop waited): a call of one slow step lets SIGTERM stop the run
  within about three steps (measured from outside by test_train_survival). Without that
  bound jax's asynchronous dispatch ran ahead of the device: a run of ~0.3 s steps had
  queued ~35 more when SIGTERM came, and saving waited for all of them. (Where the host
  loop stacks a call's metrics, the last slot's EMA update may still run when they are
  ready: the bound is then one short update looser.) Adaptive: `limit()` is 1 until a
  step's duration is known (`observe`), then max(1, min(S, target / step time)); otherwise
  S. Which steps run, and their results, do not depend on it.
  """

  def __init__(
    self, size: int, target_seconds: float = 0.5, adaptive: bool = True, max_in_flight: int = 2
  ):
    self.size, self.target, self.adaptive = int(size), float(target_seconds), adaptive
    self._limit = 1 if adaptive else self.size
    self.observed = not adaptive
    self.max_in_flight = int(max_in_flight)
    self._in_flight = collections.deque()

  def dispatched(self, outputs: Any) -> None:
    """Notes a call just dispatched (`outputs`: arrays it returns and nothing donates);
    waits until at most `max_in_flight` calls are unfinished."""
    self._in_flight.append(outputs)
    while len(self._in_flight) > self.max_in_flight:
      jax.block_until_ready(self._in_flight.popleft())

  def limit(self) -> int:
    return self._limit

  def observe(self, steps: int, seconds: float) -> None:
    if self.adaptive and steps > 0 and seconds > 0:
      self._limit = max(1, min(self.size, int(self.target * steps / seconds)))
      self.observed = True


@dataclasses.dataclass
class Chunk:
  """The host side of one call: its logical batches and the stacked device buffer."""

  first_step: int
  logicals: list
  buffer: dict  # [S, K_max, rows, ...]
  num_batches: np.ndarray  # int32 [S]: K of each slot (0 past count).
  steps: np.ndarray  # uint32 [S]
  count: np.int32

  @property
  def last_step(self) -> int:
    return self.first_step + int(self.count) - 1


def stack(first_step: int, prepared: list, size: int) -> Chunk:
  """A `Chunk` of `prepared` = [(logical, buffer [K_max, rows, ...], K)] for consecutive steps
  from `first_step`, padded to `size` slots with zero buffers (never read: count < size)."""
  count = len(prepared)
  buffers = [b for _, b, _ in prepared]
  buffer = {
    name: np.zeros((size,) + buffers[0][name].shape, buffers[0][name].dtype) for name in buffers[0]
  }
  for j, b in enumerate(buffers):
    for name, value in b.items():
      buffer[name][j] = value
  num_batches = np.zeros(size, np.int32)
  num_batches[:count] = [k for _, _, k in prepared]
  steps = np.zeros(size, np.uint32)
  steps[:count] = np.arange(first_step, first_step + count)
  return Chunk(first_step, [l for l, _, _ in prepared], buffer, num_batches, steps, np.int32(count))


class MultiStep:
  """Runs a `Chunk` of logical steps of a `DPStep` (and the EMA) as one call.

  `step_fns(...)` → (params, opt_state, ema, metrics) with each metric stacked [S] (slots past
  count are zero). ema is a `dpjax.privacy.ema.EmaState`, or None when ema_decay = 0.
  """

  def __init__(
    self,
    step_fns: dp_step.DPStep,
    size: int,
    ema_decay: float = 0.0,
    mesh: jax.sharding.Mesh | None = None,
  ):
    if size < 1:
      raise ValueError(f'steps per call must be >= 1, got {size}.')
    self.step_fns, self.size, self.ema_decay = step_fns, int(size), float(ema_decay)
    self.traces = 0
    self._program = jax.jit(
      self._steps, donate_argnums=(0, 1, 2), **dp_step.program_shardings(mesh, 'ssscsssss')
    )
    self._update_ema = jax.jit(
      lambda ema, params: step_fns.placed(ema_lib.update(ema, params, self.ema_decay), params)
    )

  def compile_count(self) -> int:
    """Compilations of the multi-step program (1 in a healthy run, whatever the counts)."""
    return self.traces

  def __call__(self, params, opt_state, ema, chunk: Chunk, dataset=None):
    if self.step_fns.loop_mode(params) == 'device':
      return self._program(
        params,
        opt_state,
        ema,
        chunk.buffer,
        chunk.num_batches,
        chunk.steps,
        chunk.count,
        dataset,
        self.step_fns.keys,
      )
    metrics = []  # 'host' loop mode: each slot as train_step's K + 1 dispatches.
    for j in range(int(chunk.count)):
      logical = jax.tree.map(lambda a, j=j: a[j], chunk.buffer)
      params, opt_state, m = self.step_fns.train_step(
        params, opt_state, logical, int(chunk.num_batches[j]), chunk.steps[j], dataset
      )
      if ema is not None:
        ema = self._update_ema(ema, params)
      metrics.append(m)
    metrics = jax.tree.map(lambda *m: jnp.stack(m), *metrics)
    pad = self.size - int(chunk.count)
    return (
      params,
      opt_state,
      ema,
      jax.tree.map(
        lambda m: jnp.concatenate([m, jnp.zeros((pad,) + m.shape[1:], m.dtype)]), metrics
      ),
    )

  def _steps(self, params, opt_state, ema, buffer, num_batches, steps, count, dataset, keys):
    self.traces += 1
    take = lambda tree, j: jax.tree.map(
      lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), tree
    )
    one = lambda p, o, j: self.step_fns.logical_step(
      p, o, take(buffer, j), num_batches[j], steps[j], dataset, keys
    )
    shapes = jax.eval_shape(one, params, opt_state, 0)[2]
    metrics = jax.tree.map(lambda s: jnp.zeros((self.size,) + s.shape, s.dtype), shapes)

    def body(j, carry):
      params, opt_state, ema, metrics = carry
      params, opt_state, m = one(params, opt_state, j)
      if ema is not None:
        ema = ema_lib.update(ema, params, self.ema_decay)
      metrics = jax.tree.map(lambda all_, v: all_.at[j].set(v), metrics, m)
      return params, opt_state, ema, metrics

    count = jnp.clip(jnp.asarray(count, jnp.int32), 0, self.size)
    out = jax.lax.fori_loop(0, count, body, (params, opt_state, ema, metrics))
    return self.step_fns.placed(out, params)


def rows_of(metrics: dict[str, Any], count: int) -> list[dict[str, Any]]:
  """The per-step metric dicts of a fetched call (the first `count` slots)."""
  return [{k: v[j] for k, v in metrics.items()} for j in range(int(count))]
