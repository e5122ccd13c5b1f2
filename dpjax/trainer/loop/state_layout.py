"""Where the training state lives on the mesh, and how much of it one device holds.

  memory = state_layout.state_memory(step, params, mesh, rules)   # shapes only, nothing runs
  state_layout.check_state_fits(memory, device_memory_bytes)       # before any step compiles
  state = state_layout.initial_state(step, params, mesh, rules)    # placed by the rules

Every array of the state (parameters, optimiser state — a correlated privatizer's noise
state first — and the EMA) is placed by `dpjax.privacy.param_sharding`'s one rule: replicated
over 'data', split over 'fsdp' (Rajbhandari et al. 2020, "ZeRO" stage 3) and, with tensor
parallelism, over 'tensor'; the counters are replicated. The layout changes where a value is
computed, never the value, so it is no part of the privacy fingerprint; a checkpoint records
it (`sharding.layout_name`) and restores onto any other (`checkpoints.restore_latest` takes the
shardings of the state built here).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from dpjax.privacy import ema as ema_lib
from dpjax.privacy import param_sharding
from dpjax.trainer.loop import training_loop
from dpjax.trainer.planning import privacy_resolution

FIT_FRACTION = 0.9  # Of a device's memory: what the state alone may take (as P's search).


def size(num_bytes: int) -> str:
  """Bytes in words: '3.2 GiB', '14.0 MiB', '68.5 KiB' (one decimal, the largest unit >= 1)."""
  for unit, scale in (('GiB', 2**30), ('MiB', 2**20)):
    if num_bytes >= scale:
      return f'{num_bytes / scale:.1f} {unit}'
  return f'{num_bytes / 2**10:.1f} KiB'


@dataclasses.dataclass(frozen=True)
class StateMemory:
  """Bytes one device holds (the most loaded one): its shards of the parameters, the optimiser
  state and the EMA, and XLA's largest temporary buffer of the compiled step (None: not known).
  """

  params: int
  opt_state: int
  ema: int
  temporaries: int | None = None

  @property
  def state(self) -> int:
    return self.params + self.opt_state + self.ema

  def describe(self) -> str:
    """One line of the start: what each part takes on the most loaded device."""
    temp = (
      f', temporary buffers of the step {size(self.temporaries)} (XLA memory analysis)'
      if self.temporaries is not None
      else ''
    )
    return (
      f'Per device: parameters {size(self.params)}, optimizer state {size(self.opt_state)}, '
      f'EMA {size(self.ema)}{temp}'
    )


def _state(step, params, ema):
  return training_loop.TrainState(
    step=np.int32(0),
    params=params,
    opt_state=step.init_opt_state(params),
    num_truncated=np.int32(0),
    ema=ema,
  )


def abstract_state(step, params) -> training_loop.TrainState:
  """The state's shapes and dtypes (`jax.eval_shape`: nothing is allocated or compiled)."""
  return jax.eval_shape(lambda p: _state(step, p, ema_lib.init(p)), params)


def state_memory(
  step, params, mesh: jax.sharding.Mesh, rules: param_sharding.ShardingRules
) -> StateMemory:
  """Bytes per device of the parameters, optimiser state and EMA on `mesh` (shapes only)."""
  state = abstract_state(step, params)
  where = param_sharding.state_shardings(state, params, mesh, rules)
  count = lambda part: param_sharding.bytes_per_device(getattr(state, part), getattr(where, part))
  return StateMemory(count('params'), count('opt_state'), count('ema'))


def check_state_fits(memory: StateMemory, memory_bytes: int, layout: str) -> None:
  """PlanError (one line, with the numbers, before any step compiles) when the state alone
  takes more than `FIT_FRACTION` of one device's memory: no physical batch can run."""
  if memory.state > FIT_FRACTION * memory_bytes:
    raise privacy_resolution.PlanError(
      f'the training state needs {size(memory.state)} per device (parameters '
      f'{size(memory.params)}, optimizer state {size(memory.opt_state)}, EMA '
      f"{size(memory.ema)}) on {layout}, more than {FIT_FRACTION:.0%} of the device's "
      f'{size(memory_bytes)}: raise mesh.fsdp (each large array split over more devices) or '
      'use a smaller model.'
    )


def initial_state(
  step, params, mesh: jax.sharding.Mesh, rules: param_sharding.ShardingRules
) -> training_loop.TrainState:
  """The state at step 0, each array placed by the rules (every process passes the same
  parameters, from the same seed, and keeps its own devices' shards). The optimiser state and
  the EMA are made on the devices in their layout: no device holds a whole copy."""
  where = param_sharding.state_shardings(abstract_state(step, params), params, mesh, rules)
  placed = param_sharding.place(params, where.params)
  make = jax.jit(lambda p: _state(step, p, ema_lib.init(p)), out_shardings=where)
  return make(placed)
