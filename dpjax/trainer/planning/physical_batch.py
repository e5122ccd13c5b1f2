"""Automatic physical batch size (`sampler.physical_batch_size = 0`): the largest P that fits.

The cap B enters ε and is resolved before P (`batching.resolve_max_batch_size`
with P = 0 resolves it to the row); P only sizes the compiled logical step's
buffer [ceil(B/P), P, ...]. Its memory comes from XLA's analysis of the
compiled program (arguments + outputs + temporaries − donated bytes), so
nothing runs while P is chosen. `resolve_physical_batch_size` returns the plan
with P resolved, before the loop starts.
"""

from __future__ import annotations

import dataclasses
import os

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax.data import sources as data
from dpjax.privacy.dp_step import Batch
from dpjax.privacy.dp_step import DPStep
from dpjax.privacy.dp_step import Params
from dpjax.privacy import sharding
from dpjax.trainer.planning import plan as plan_lib


def compiled_step_bytes(
  step: DPStep,
  params: Params,
  opt_state: optax.OptState,
  example: Batch,
  physical_batch_size: int,
  max_batch_size: int,
  dataset=None,
) -> int:
  """Device bytes of `step.train_step` at P (XLA's memory analysis; nothing runs).

  arguments + outputs + temporaries − donated (aliased) bytes of the program
  over a buffer [ceil(B/P), P, ...] shaped like `example` (one row: {'x': [...],
  'y': [...]}, or {'index': []} with `dataset`). Compiles (once per shape and
  step); does not execute.
  """
  k_max = -(-max_batch_size // physical_batch_size)
  spec = lambda v: jax.ShapeDtypeStruct(
    (k_max, physical_batch_size, *jnp.shape(v)), jnp.result_type(v)
  )
  logical = {name: spec(value) for name, value in example.items() if name != 'weight'}
  logical['weight'] = jax.ShapeDtypeStruct((k_max, physical_batch_size), jnp.float32)
  return step.compiled_bytes(params, opt_state, logical, dataset)


def device_memory_bytes(device: jax.Device | None = None) -> int:
  """Memory of one device: its allocator's limit, or on the CPU half the host's RAM."""
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() if device.platform != 'cpu' else None
  if stats and stats.get('bytes_limit'):
    return int(stats['bytes_limit'])
  return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 2


def choose_physical_batch_size(
  step: DPStep,
  params: Params,
  opt_state: optax.OptState,
  example: Batch,
  max_batch_size: int,
  num_devices: int = 1,
  memory_bytes: int | None = None,
  dataset=None,
  fraction: float = 0.9,
  log=print,
  first: int = 1,
) -> int:
  """`sampler.physical_batch_size = 0`: the largest P = D·2^k whose step fits the device.

  Tries P = D·2^k upwards, from the largest such P ≤ max(D, `first`) (D =
  num_devices, so every device gets P/D rows; `first` saves compiling tiny
  programs: the trainer starts at 32·D) up to the first power-of-two multiple
  of D ≥ B, compiling the logical-step program for each (`compiled_step_bytes`,
  nothing runs) and keeping the largest with bytes ≤ fraction · memory_bytes
  (default: the device's memory; with `step.mesh` the analysis is of one
  device's share). Memory grows with P, so the search stops at the first P
  that does not fit; if the first tried does not fit, it halves P down to D.
  B (which enters ε) is an input, resolved from (N, b, steps) before P; P
  only sizes the buffer [ceil(B/P), P, ...] (ceil(B/P)·P ≥ B rows: the extra
  rows are padding of weight 0). ValueError if even P = D does not fit.
  """
  for name, value, low in (
    ('max_batch_size', max_batch_size, 1),
    ('num_devices', num_devices, 1),
    ('first', first, 1),
  ):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ValueError(f'{name} must be an int >= {low}, got {value!r}.')
  if not 0 < fraction <= 1:
    raise ValueError(f'fraction must be in (0, 1], got {fraction!r}.')
  budget = fraction * (device_memory_bytes() if memory_bytes is None else memory_bytes)

  def fits(p: int) -> bool:
    # With step.mesh the program is SPMD and its analysis is per device (P/D rows).
    used = compiled_step_bytes(step, params, opt_state, example, p, max_batch_size, dataset)
    log(f'physical batch size {p}: {used / 2**20:.1f} MiB of {budget / 2**20:.0f} MiB per device')
    return used <= budget

  top = num_devices
  while top < max_batch_size:
    top *= 2
  p = num_devices
  while p * 2 <= min(max(first, num_devices), top):
    p *= 2
  best = None
  if fits(p):
    best = p
    while p < top and fits(p * 2):
      p *= 2
      best = p
  else:
    while p > num_devices:
      p //= 2
      if fits(p):
        best = p
        break
  if best is None:
    raise ValueError(
      f'sampler.physical_batch_size = {num_devices} (the smallest) needs '
      f'more than the {budget:.0f} bytes available on the device; use a smaller '
      'model.'
    )
  log(f'sampler.physical_batch_size = 0: chose P = {best}.')
  return best


def _example(train_source: data.DataSource, dataset) -> Batch:
  """One row of the logical buffer: an index into the dataset on the device, or the source's
  row with its index."""
  example = {'index': np.int32(0)}
  if dataset is None:
    example.update({k: v[0] for k, v in train_source.gather(np.zeros(1, np.int64)).items()})
  return example


def resolve_physical_batch_size(
  plan: plan_lib.RunPlan,
  step: DPStep,
  params: Params,
  opt_state: optax.OptState,
  train_source: data.DataSource,
  dataset,
  mesh: jax.sharding.Mesh,
  log=print,
) -> plan_lib.RunPlan:
  """The plan with P resolved: itself when P > 0; for P = 0, the largest P that fits.

  `choose_physical_batch_size` over the mesh's example groups D = data × fsdp (the devices
  that hold different rows) from P = 32·D, for a logical buffer of indices (`dataset`: the
  training set on the device) or of the source's rows. B is already resolved (to the row,
  without P): P only sizes the [ceil(B/P), P] buffer. The choice is printed with `log`.
  """
  if plan.perf.physical_batch_size:
    return plan
  groups = sharding.example_groups(mesh)
  chosen = choose_physical_batch_size(
    step,
    params,
    opt_state,
    _example(train_source, dataset),
    plan.max_batch_size,
    num_devices=groups,
    dataset=dataset,
    first=32 * groups,
    log=lambda line: logging.info('%s', line),
  )
  log(
    f'sampler.physical_batch_size = 0: P = {chosen}, the largest power-of-two multiple of '
    f'data × fsdp = {groups} whose step fits the device (XLA memory analysis).'
  )
  return dataclasses.replace(plan, perf=dataclasses.replace(plan.perf, physical_batch_size=chosen))


def step_temporaries(
  plan: plan_lib.RunPlan,
  step: DPStep,
  params: Params,
  opt_state: optax.OptState,
  train_source: data.DataSource,
  dataset,
) -> int:
  """Bytes of the temporary buffers (activations, per-example norms) one device holds while
  the logical step at the plan's P runs: XLA's memory analysis (`temp_size_in_bytes`) of the
  program `compiled_step_bytes` sizes P with (cached when P was chosen; nothing runs)."""
  compiled_step_bytes(
    step,
    params,
    opt_state,
    _example(train_source, dataset),
    plan.perf.physical_batch_size,
    plan.max_batch_size,
    dataset,
  )
  return step.sizing.last_temporaries
