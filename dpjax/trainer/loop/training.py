"""The run of a resolved plan: what `dpjax.train` calls once the config is validated, the
plan resolved (`dpjax.trainer.planning.plan`) and the workdir locked.

  model, params → the DP step (`build`) → P resolved (`physical_batch`)
  → `build.restore_or_init` → the start lines (`run_report.announce`)
  → `loop.Loop(...).run(state)` → the final result (`run_report.finish`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from dpjax.data import device as device_data
from dpjax.data import sources as data
from dpjax.privacy import ema as ema_lib
from dpjax.privacy import sharding
from dpjax.trainer.loop import build
from dpjax.trainer.workdir import checkpoints
from dpjax.trainer.loop import training_loop as loop_lib
from dpjax.trainer.loop import loop_parts
from dpjax.trainer.planning import optimizers
from dpjax.trainer.planning import physical_batch
from dpjax.trainer.planning import plan as plan_lib
from dpjax.trainer.loop import run_report


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
  build.check_noise_state_fits(step_fns, params, physical_batch.device_memory_bytes())
  state = sharding.replicate(
    mesh,
    loop_lib.TrainState(  # Same seed, same values on every host.
      step=np.int32(0),
      params=params,
      # The optimiser's state, after a stateful privatizer's (correlated noise); one compiled
      # program: eagerly, each leaf shape's zeros is its own compilation.
      opt_state=jax.jit(step_fns.init_opt_state)(params),
      num_truncated=np.int32(0),
      ema=ema_lib.init(params),
    ),
  )
  # The training set on the device when it fits (the sampler sends indices only); else
  # host-gathered rows, prefetched on a thread.
  dataset = (
    device_data.put_on_device(train_source, sharding.replicated(mesh))
    if device_data.fits_on_device(train_source)
    else None
  )
  plan = physical_batch.resolve_physical_batch_size(
    plan, step_fns, state.params, state.opt_state, train_source, dataset, mesh, log
  )
  evaluate = build.make_evaluator(plan, model, test_source, mesh)
  manager = checkpoints.make_manager(workdir, plan.schedule.keep_checkpoints)
  restored_step, state = build.restore_or_init(manager, state, plan, workdir, log)
  run_report.announce(plan, workdir, train_source, mesh, params, log)
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
