"""What the training loop is given: its settings and collaborators, typed, and the real ones.

`Loop` (`dpjax.trainer.loop.training_loop`) holds the logic of a run — which actions are due
after which step, how a signal or a divergence stops it, which ε a row and a
checkpoint carry — and receives everything that computes or writes:

  steps         `StepRunner`: one call of S logical steps (the compiled DP step)
  chunks        `ChunkStream`: the (call, `multi_step.Chunk`) of each scheduled call
  evaluate      state → {'eval_loss': ..., ...}
  writer        `Writer`: metrics.jsonl and TensorBoard (`metrics.MetricWriter`)
  checkpointer  `Checkpointer`: a state and the privacy claim of its step
  accountant    ε(step) (`Accountant.epsilon_at`), None for a non-private run
  clock         seconds (time.time)

`from_plan` builds the real ones from a resolved plan; tests pass fakes (a numpy step, an
in-memory checkpointer) and check the loop's logic without compiling anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ContextManager, Iterable, Protocol

import jax
import numpy as np

from dpjax.data import preprocess
from dpjax.data import sources as data
from dpjax.privacy import dp_step
from dpjax.privacy import ema as ema_lib
from dpjax.privacy import multi_step
from dpjax.privacy import sharding
from dpjax.privacy.accounting.report import PrivacyReport
from dpjax.trainer.workdir import checkpoints
from dpjax.trainer.loop import chunks as chunks_lib
from dpjax.trainer.loop import metrics as metrics_lib
from dpjax.trainer.planning import plan as plan_lib
from dpjax.trainer.workdir import privacy_metadata
from dpjax.trainer.loop import stops


@dataclasses.dataclass(frozen=True)
class LoopSettings:
  """What the loop reads of the plan. `steps_per_call`: S as requested (0: automatic, paced);
  `serial`: calls one at a time, ε computed when asked (`chunks.serial_dispatch`);
  `primary`: this process writes and shows progress."""

  num_steps: int
  log_every: int
  eval_every: int
  checkpoint_every: int
  steps_per_call: int = 0
  ema_decay: float = 0.0
  max_batch_size: int = 0  # B: examples counted per step for the rates.
  clip_norm: float | None = None  # For the warnings (None: non-private).
  private: bool = True
  serial: bool = False
  primary: bool = True

  @classmethod
  def of_plan(cls, plan: plan_lib.RunPlan, mesh: jax.sharding.Mesh) -> LoopSettings:
    return cls(
      num_steps=plan.num_steps,
      log_every=plan.schedule.log_every,
      eval_every=plan.schedule.eval_every,
      checkpoint_every=plan.schedule.checkpoint_every,
      steps_per_call=plan.perf.steps_per_call,
      ema_decay=plan.recipe.ema_decay,
      max_batch_size=plan.max_batch_size,
      clip_norm=plan.privacy.clip_norm if plan.private else None,
      private=plan.private,
      serial=chunks_lib.serial_dispatch(mesh),
      primary=sharding.is_primary_process(),
    )


class StepRunner(Protocol):
  """The device side: S logical steps per call, and a check of the parameters."""

  size: int  # S, the slots of a call.

  def __call__(self, params, opt_state, ema, chunk: multi_step.Chunk) -> tuple:
    """(params, opt_state, ema, metrics stacked [S]) after the chunk's steps."""

  def diverged(self, params) -> Any:
    """Whether the parameters are not finite (`stops.parameters_diverged`)."""

  @property
  def clipping_choice(self) -> list[str]:
    """The clipping form per layer, known once the step is traced."""

  def compilations(self) -> dict[str, int]:
    """The programs compiled so far, by name."""


ChunkStream = Callable[
  [Iterable[tuple[int, int]]], ContextManager[Iterable[tuple[tuple[int, int], multi_step.Chunk]]]
]
Evaluate = Callable[[Any], dict]


class Writer(Protocol):
  """`metrics.MetricWriter`'s interface."""

  def write(self, step: int, scalars: dict) -> None: ...
  def flush(self) -> None: ...
  def close(self) -> None: ...


class Checkpointer(Protocol):
  """Saves a state with the privacy claim of its step (asynchronously)."""

  def save(self, state, report: PrivacyReport | None, audit: dict | None) -> None: ...
  def wait_until_finished(self) -> None: ...


class Epsilons(Protocol):
  """The accountant as the loop asks it."""

  def epsilon_at(self, step: int, *, estimates: bool = True) -> PrivacyReport: ...


class CompiledSteps:
  """`StepRunner` of a DP step: `multi_step.MultiStep` over the data (on the device or not)."""

  def __init__(
    self, step_fns: dp_step.DPStep, size: int, ema_decay: float, mesh: jax.sharding.Mesh, dataset
  ):
    self.step_fns, self.size, self.dataset = step_fns, size, dataset
    self.multi = multi_step.MultiStep(step_fns, size, ema_decay, mesh)

  def __call__(self, params, opt_state, ema, chunk: multi_step.Chunk) -> tuple:
    return self.multi(params, opt_state, ema, chunk, self.dataset)

  def diverged(self, params) -> jax.Array:
    return stops.parameters_diverged(params)

  @property
  def clipping_choice(self) -> list[str]:
    return self.step_fns.clipping_choice

  def compilations(self) -> dict[str, int]:
    counts = (
      ('train_steps', self.multi.compile_count()),
      ('train_step', self.step_fns.compile_count('train_step')),
    )
    return {name: count for name, count in counts if count}


class PlanCheckpointer:
  """`Checkpointer` to an orbax manager: each checkpoint holds the ε of its step and the plan's
  privacy fingerprint (`privacy_metadata`), σ and C read from the step that ran."""

  def __init__(
    self,
    manager,
    plan: plan_lib.RunPlan,
    step_fns,
    batcher,
    train_source: data.DataSource,
    mesh: jax.sharding.Mesh,
    ema_decay: float,
  ):
    self.manager, self.plan, self.step_fns, self.batcher = manager, plan, step_fns, batcher
    self.train_source, self.mesh, self.ema_decay = train_source, mesh, ema_decay

  def save(self, state, report: PrivacyReport | None, audit: dict | None) -> None:
    metadata = privacy_metadata.privacy_metadata(
      state.step, report, self.plan, self.step_fns, self.batcher, state.num_truncated
    )
    metadata['model_io'] = preprocess.model_io(self.train_source)  # For export.
    # Where the state lived (not in the fingerprint: any layout resumes it, to the same values).
    metadata['layout'] = sharding.layout_name(self.mesh)
    if audit is not None:
      metadata['audit'] = audit
    checkpoints.save(self.manager, state.step, self.stored(state), metadata)

  def stored(self, state):
    """`state` as a checkpoint holds it: replicated int32 counters; with ema_decay = 0 the
    EMA is what the update would have made, (θ, t)."""
    count = lambda n: sharding.replicate(self.mesh, np.int32(n))
    return state.replace(
      step=count(state.step),
      num_truncated=count(state.num_truncated),
      ema=state.ema if self.ema_decay else ema_lib.EmaState(state.params, count(state.step)),
    )

  def wait_until_finished(self) -> None:
    checkpoints.wait_until_finished(self.manager)


@dataclasses.dataclass(frozen=True)
class LoopParts:
  """The real collaborators of a plan's loop (`from_plan`)."""

  settings: LoopSettings
  steps: CompiledSteps
  chunks: ChunkStream
  writer: metrics_lib.MetricWriter
  checkpointer: PlanCheckpointer


def from_plan(
  plan: plan_lib.RunPlan,
  workdir: str,
  step_fns: dp_step.DPStep,
  params,
  train_source: data.DataSource,
  dataset,
  mesh: jax.sharding.Mesh,
  manager,
  restored_step: int | None,
) -> LoopParts:
  """The loop's collaborators for `plan` (P resolved): S = `multi_step.steps_per_call` for the
  step's loop mode at `params`, the plan's batcher, the workdir's writer and checkpoints."""
  settings = LoopSettings.of_plan(plan, mesh)
  size = multi_step.steps_per_call(
    settings.steps_per_call, step_fns.loop_mode(params), dataset is not None
  )
  batcher = chunks_lib.make_batcher(plan)

  def chunks(calls):
    return chunks_lib.make_chunks(
      calls, batcher, train_source, dataset, mesh, size, settings.serial
    )

  return LoopParts(
    settings,
    CompiledSteps(step_fns, size, settings.ema_decay, mesh, dataset),
    chunks,
    metrics_lib.MetricWriter(workdir, restored_step, enabled=settings.primary),
    PlanCheckpointer(manager, plan, step_fns, batcher, train_source, mesh, settings.ema_decay),
  )
