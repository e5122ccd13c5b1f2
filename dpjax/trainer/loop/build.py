"""What a run computes, built from its plan, and the state it starts from.

  model, params = build.init_params(plan, model, input_shape)
  auditor = build.Auditor(plan, params, workdir)        # with audit.num_canaries > 0
  step = build.build_step(plan, model, optimizer, mesh, auditor)
  evaluate = build.make_evaluator(plan, model, test_source, mesh)   # P resolved
  restored_step, state = build.restore_or_init(manager, initial_state, plan, workdir)

The DP step takes σ, C, b and the seed from the plan the accountant was made
from; the config supplies only what does not enter ε (clipping method, loss,
precision, augmentation).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import jax
import numpy as np
import optax

from dpjax.data import sources as data
from dpjax.privacy import auditing
from dpjax.privacy import dp_step
from dpjax.privacy import lora
from dpjax.privacy import losses
from dpjax.privacy import mechanisms
from dpjax.privacy import prng
from dpjax.privacy import sharding
from dpjax.trainer.workdir import audit_record
from dpjax.trainer.workdir import checkpoints
from dpjax.trainer.loop import evaluation
from dpjax.trainer.planning import fingerprint as fingerprint_lib
from dpjax.trainer.planning import finetune
from dpjax.trainer.planning import plan as plan_lib
from dpjax.trainer.planning import privacy_resolution


def init_params(plan: plan_lib.RunPlan, model, input_shape) -> tuple[Any, Any]:
  """(model, trainable params): initialised from the plan's seed, or fine-tuned.

  `init_from` loads pretrained weights: public ones, or a dpjax run's or export's, whose
  privacy loss the plan's accountant composes (`plan.init_source`, read from the checkpoint
  it accounted for); `freeze` and `lora.rank` make frozen parameters, which get no gradient,
  noise or clipping, part of the returned model.
  """
  tune = plan.finetune
  params = prng.init_params(model, plan.seed, input_shape)
  if tune.init_from:
    params = finetune.load_pretrained(
      plan.init_source.weights, params, tune.init_from_rules, plan.init_source.weights_sha256
    )
  if tune.freeze or tune.lora_rank:
    model, params = lora.make_finetune(
      model,
      params,
      freeze=tune.freeze,
      lora_rank=tune.lora_rank,
      lora_alpha=tune.lora_alpha,
      lora_targets=tune.lora_targets,
      seed=plan.seed,
    )
  return model, params


class Auditor:
  """The one-run audit of gradient canaries (`dpjax.privacy.auditing`, Steinke et al. 2023).

  Each canary j adds clip_C(λ·u_j) to the summed gradient of every step that
  samples it (`wrap`); `__call__(params)` is the ε lower bound read from the
  canaries' coordinates of θ. Process 0 writes the audit record once per workdir.
  """

  def __init__(self, plan: plan_lib.RunPlan, params, workdir: str):
    audit = plan.audit
    self.canaries = auditing.make_canaries(
      plan.seed, audit.num_canaries, int(sum(np.size(x) for x in jax.tree.leaves(params)))
    )
    self.confidence, self.every_checkpoint = audit.confidence, audit.every_checkpoint
    self.num_canaries = audit.num_canaries
    # A non-private run (no δ in its plan) is audited at the config's δ.
    self.delta = plan.privacy.delta if plan.private else audit.delta
    self._clip_norm = plan.privacy.clip_norm if plan.private else math.inf
    self._scale = plan.privacy.clip_norm if plan.private else 1.0
    self._initial_projection = auditing.project(params, self.canaries)
    if sharding.is_primary_process() and not os.path.exists(
      os.path.join(workdir, audit_record.AUDIT_FILE)
    ):
      audit_record.write_record(
        workdir, self.canaries, confidence=self.confidence, initial_params=params
      )

  def wrap(self, sum_fn):
    """The clipped-sum function with the sampled canaries' gradients added."""
    return auditing.with_gradient_canaries(
      sum_fn,
      self.canaries,
      canary_norm=self.canaries.gradient_scale * self._scale,
      clip_norm=self._clip_norm,
    )

  def __call__(self, params) -> dict:
    """The audit's metrics and metadata fields at `params`."""
    return audit_record.audit_params(
      self.canaries,
      self._initial_projection,
      jax.device_get(params),
      delta=self.delta,
      confidence=self.confidence,
    )


def build_step(
  plan: plan_lib.RunPlan,
  model,
  optimizer: optax.GradientTransformation,
  mesh: jax.sharding.Mesh,
  auditor: Auditor | None = None,
) -> dp_step.DPStep:
  """The DP step of the plan (σ, C, b, seed), or the non-private step."""
  recipe = plan.recipe
  options = dict(
    clipping=recipe.clipping,
    label_format=plan.data.label_format,
    loss=recipe.loss,
    noise_impl=recipe.noise_prng,
    mesh=mesh,
    rules=plan.perf.rules,
    sum_fn_wrapper=None if auditor is None else auditor.wrap,
    augmult=recipe.augmult,
    clipping_forms=plan.perf.clipping_forms,
  )
  if not plan.private:
    return dp_step.DPStep.non_private(
      model,
      optimizer,
      plan.sampler.expected_batch_size,
      plan.seed,
      precision=recipe.precision,
      **options,
    )
  step = dp_step.DPStep.from_plan(model, optimizer, plan.privacy, **options)
  # What is reported is what runs (and its precision is the one whose η ε pays for); not an
  # assert, which `python -O` removes.
  if not (
    step.noise_multiplier
    == plan.privacy.accountant.noise_multiplier
    == plan.privacy.noise_multiplier
    and step.precision == plan.privacy.precision == recipe.precision
  ):
    raise RuntimeError('the DP step and the privacy plan disagree on σ or the precision.')
  return step


def check_noise_state_fits(step: dp_step.DPStep, params, memory_bytes: int) -> None:
  """Refuses (one line, before anything compiles) a correlated-noise state that, beside the
  parameters, the optimiser state and the EMA (about 4 copies of the parameters), exceeds
  90 % of one device's memory: BandMF keeps b − 1 copies of the parameters, BLT d."""
  state_bytes = getattr(step.privatizer, 'state_bytes', None)
  if state_bytes is None:
    return
  noise_bytes = state_bytes(params)
  param_bytes = sum(int(np.size(p)) * np.dtype(p.dtype).itemsize for p in jax.tree.leaves(params))
  if noise_bytes + 4 * param_bytes > 0.9 * memory_bytes:
    field, value, copies = mechanisms.state_setting(step.privatizer)
    raise privacy_resolution.PlanError(
      f'{field} = {value}: the correlated-noise state needs {noise_bytes / 1e9:.3g} GB '
      f'({copies} copies of the parameters) beside ~{4 * param_bytes / 1e9:.3g} GB of '
      f"parameters, optimiser state and EMA, more than 90 % of the device's "
      f'{memory_bytes / 1e9:.3g} GB: lower {field}.'
    )


def make_evaluator(
  plan: plan_lib.RunPlan, model, test_source: data.DataSource, mesh: jax.sharding.Mesh
) -> Callable[[Any], dict[str, float]]:
  """`evaluate(state)`: loss and accuracy of `state.params` on the test split (and of the
  EMA parameters, as `*_ema`, when `ema_decay` > 0), in batches of the plan's P."""
  label_format, loss, physical = (
    plan.data.label_format,
    plan.recipe.loss,
    plan.perf.physical_batch_size,
  )
  # A fine-tuned model's frozen base is an argument (placed like parameters), not a constant.
  rules = plan.perf.rules
  _, base = lora.loss_and_base(model, lambda m: None, mesh, rules)
  with_base = lambda b: model if b is None else model.with_base(b)
  eval_base = jax.jit(  # Params in their layout, rows like training; the sums come back replicated.
    lambda params, b, batch: losses.eval_step(with_base(b), params, batch, label_format, loss),
    in_shardings=(
      None,
      None if base is None else lora.frozen_shardings(base, mesh, rules),
      sharding.batch_sharding(mesh),
    ),
    out_shardings=sharding.replicated(mesh),
  )
  eval_fn = lambda params, batch: eval_base(params, base, batch)

  def evaluate(state) -> dict[str, float]:
    out = evaluation.evaluate(eval_fn, state.params, test_source, physical, mesh)
    if plan.recipe.ema_decay:
      out.update(
        {
          f'{k}_ema': v
          for k, v in evaluation.evaluate(
            eval_fn, state.ema.params, test_source, physical, mesh
          ).items()
        }
      )
    return out

  return evaluate


def restore_or_init(
  manager, state, plan: plan_lib.RunPlan, workdir: str, log=print
) -> tuple[int | None, Any]:
  """(step restored, state) from the newest readable checkpoint, or (None, `state`).

  PlanError if that checkpoint's privacy fingerprint differs from the plan's. The arrays are
  restored onto `state`'s shardings, whatever layout saved them (the checkpoint records it:
  `sharding.layout_name`). The returned counters are host ints.
  """
  restored = checkpoints.restore_latest(manager, state)
  restored_step = None
  if restored is not None:
    restored_step, state, metadata = restored
    if fingerprint_lib.fingerprint_changes(metadata.get('fingerprint', {}), plan.fingerprint):
      raise plan_lib.PlanError(
        f'checkpoint {restored_step} has another privacy fingerprint '
        f'than the newest one; {plan_lib.NEW_WORKDIR_HINT}'
      )
    log(f'Resuming from step {restored_step} ({checkpoints.checkpoint_dir(workdir)}).')
  return restored_step, state.replace(step=int(state.step), num_truncated=int(state.num_truncated))
