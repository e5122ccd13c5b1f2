"""The run of a resolved plan: what `dpjax.train` calls once the config is validated, the
plan resolved (`dpjax.trainer.planning.plan`) and the workdir locked.

  model, params → the DP step (`build`) → the state placed on the mesh, refused if it cannot
  fit a device (`state_layout`) → P resolved (`physical_batch`) → `build.restore_or_init` → the start lines (`run_report.announce`)
  → `loop.Loop(...).run(state)` → the final result (`run_report.finish`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from dpjax.data import device as device_data
from dpjax.data import sources as data
from dpjax.privacy import param_sharding
from dpjax.privacy import sharding
from dpjax.trainer.loop import build
from dpjax.trainer.workdir import checkpoints
from dpjax.trainer.loop import training_loop as loop_lib
from dpjax.trainer.loop import loop_parts
from dpjax.trainer.planning import optimizers
from dpjax.trainer.planning import physical_batch
from dpjax.trainer.planning import plan as plan_lib
from dpjax.trainer.loop import run_report
from dpjax.trainer.loop import state_layout


def run(
  plan: plan_lib.RunPlan,
  workdir: str,
  train_source: data.DataSource,
  test_source: data.DataSource,
  model,
  mesh: jax.sharding.Mesh,
) -> dict[str, Any]:
  """The run of a plan, in a locked workdir; returns the final metrics and parameters."""
  log = print if sharding.is_primary_process() else lambda *args, **kwargs: None
  optimizer = optimizers.make_optimizer(plan.recipe.optimizer, plan.num_steps)
  model, params = build.init_params(plan, model, train_source.input_shape)
  auditor = build.Auditor(plan, params, workdir) if plan.audit.num_canaries else None
  step_fns = build.build_step(plan, model, optimizer, mesh, auditor)
  device_memory = physical_batch.device_memory_bytes()
  build.check_noise_state_fits(step_fns, params, device_memory)
  rules = plan.perf.rules
  memory = state_layout.state_memory(step_fns, params, mesh, rules)
  state_layout.check_state_fits(memory, device_memory, param_sharding.describe(mesh, rules))
  # Same seed, same values on every host; each keeps its devices' shards.
  state = state_layout.initial_state(step_fns, params, mesh, rules)
  # The training set on the device when it fits (the sampler sends indices only); else
  # host-gathered rows, prefetched on a thread.
  dataset = (
    device_data.put_on_device(train_source, sharding.replicated(mesh))
    if device_data.fits_on_device(train_source)
    else None
  )
  # XLA's temporaries of the step: free when P is sized (its program is compiled then), and
  # worth one more lowering when the state is split; a replicated run with P set skips it.
  split = mesh.devices.size > sharding.mesh_axis_size(mesh, sharding.DATA_AXIS)
  measure = split or not plan.perf.physical_batch_size
  plan = physical_batch.resolve_physical_batch_size(
    plan, step_fns, state.params, state.opt_state, train_source, dataset, mesh, log
  )
  temporaries = (
    physical_batch.step_temporaries(
      plan, step_fns, state.params, state.opt_state, train_source, dataset
    )
    if measure
    else None
  )
  evaluate = build.make_evaluator(plan, model, test_source, mesh)
  manager = checkpoints.make_manager(workdir, plan.schedule.keep_checkpoints)
  restored_step, state = build.restore_or_init(manager, state, plan, workdir, log)
  run_report.announce(plan, workdir, train_source, mesh, params, log)
  log(f'{param_sharding.describe(mesh, rules)}.')
  log(f'{dataclasses.replace(memory, temporaries=temporaries).describe()}.')
  parts = loop_parts.from_plan(
    plan, workdir, step_fns, state.params, train_source, dataset, mesh, manager, restored_step
  )
  loop = loop_lib.Loop(
    parts.settings,
    parts.steps,
    parts.chunks,
    evaluate,
    parts.writer,
    parts.checkpointer,
    plan.privacy.accountant if plan.private else None,
    auditor,
    log=log,
  )
  state = loop.run(state)
  return run_report.finish(plan, state, loop.last, evaluate, auditor, loop.compilations(), log)
