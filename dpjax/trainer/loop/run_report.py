"""What a run states at its start (`announce`) and its end (`finish`: the result and Final line).

Lines go to `log` (print on process 0, nothing elsewhere); the resolved config
goes to `<workdir>/config.json`.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax
import numpy as np

from dpjax.data import sources as data
from dpjax.privacy import losses
from dpjax.privacy import mechanisms
from dpjax.privacy import sharding
from dpjax.trainer.loop import build
from dpjax.trainer.planning import plan as plan_lib
from dpjax.trainer.workdir import run_seed
from dpjax.trainer.planning import run_warnings
from dpjax.trainer.planning import training_set_size
from dpjax.trainer.workdir.atomic_write import write_text_atomically


def announce(
  plan: plan_lib.RunPlan,
  workdir: str,
  train_source: data.DataSource,
  mesh: jax.sharding.Mesh,
  params,
  log=print,
) -> None:
  """Writes config.json (process 0), then the start lines: devices, model and plan (with the
  final ε), seed, a large-ε warning, the data's preprocessing and the plan's warnings."""
  if sharding.is_primary_process():
    write_text_atomically(
      os.path.join(workdir, 'config.json'), plan.config_json(), what='the run config'
    )
  rows = sharding.local_rows(mesh, plan.perf.physical_batch_size)
  log(
    f'{mesh.devices.size} device(s) on {jax.process_count()} process(es), {len(rows)} rows of '
    f'each physical batch gathered here ({jax.devices()[0].device_kind}).'
  )
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  accountant = plan.privacy.accountant if plan.private else None
  final_epsilon = accountant.epsilon(plan.num_steps) if plan.private else None
  log(
    f'Model {plan.recipe.model_name} with {num_params:,} parameters; {plan.summary()}'
    + (f'; final ε = {final_epsilon:.4f}{composed_with(accountant)}' if plan.private else '')
    + '.'
  )
  if plan.init_source is not None:
    log(plan.init_source.describe())
  if plan.private:
    log(f'Float rounding: {plan.privacy.rounding_record()["statement"]}.')
    if plan.privacy.noise != 'gaussian':
      log(f'Noise: {mechanisms.describe(plan.privacy.strategy, num_params)}.')
  log(run_seed.RunSeed(plan.seed, plan.seed_source).describe(workdir))
  if plan.private:
    for line in run_warnings.RunWarnings().epsilon(final_epsilon, plan.privacy.target_epsilon):
      log(f'WARNING: {line}')
  preprocess = getattr(getattr(train_source, 'base', train_source), 'preprocess', None)
  if preprocess is not None:  # Where the scale came from: derived or data.scale.
    log(
      f'Data: {plan.data.source}, {training_set_size.describe(plan.sampler)}, '
      f'{preprocess.describe()}.'
    )
  for line in plan.warnings:
    log(f'WARNING: {line}')


def composed_with(accountant) -> str:
  """', composed with <runs>' when ε composes the runs init_from starts from, else ''."""
  runs = accountant.prior_runs if accountant is not None else ()
  return f', composed with {", ".join(r.name for r in runs)}' if runs else ''


def finish(
  plan: plan_lib.RunPlan,
  state,
  last: dict[str, Any],
  evaluate: Callable,
  auditor: build.Auditor | None,
  compilations: dict[str, int],
  log=print,
) -> dict[str, Any]:
  """The result of a finished run: the last log row (evaluated if it was not), the
  parameters, the compiled programs, ε with its side estimates and the audit; prints the
  truncation count and the Final line."""
  accountant = plan.privacy.accountant if plan.private else None
  if state.num_truncated and accountant is not None:
    log(
      f'{state.num_truncated} of {plan.num_steps} logical batches exceeded B = '
      f'{plan.max_batch_size} and were truncated; the reported ε accounts for the cap (this '
      'count is not covered by ε).'
    )
  if 'eval_accuracy' not in last:
    last.update(evaluate(state))
  result = {'step': plan.num_steps, **last, 'params': state.params, 'compilations': compilations}
  final_report = accountant.epsilon_at(plan.num_steps) if accountant else None  # With estimates.
  if final_report is not None:
    result['privacy'] = final_report.to_dict()
  eps_text = (
    f'ε = {final_report.epsilon:.4f} ({final_report.bound} bound, '
    f'{final_report.accountant}{composed_with(accountant)}), δ = '
    f'{final_report.delta:g}'
    if final_report
    else 'non-private (ε = ∞)'
  )
  if auditor is not None:
    result['audit'] = auditor(state.params)
    eps_text += (
      f'; audit ε ≥ {result["audit"]["audit_epsilon_lower"]:.4f} (one-run lower '
      f'bound, confidence {auditor.confidence:g}, {auditor.num_canaries} canaries)'
    )
  if final_report is not None and not plan.seed_is_secret:
    eps_text += '; the seed came from the config: ε holds only if that seed is secret'
  quality = (
    f'test accuracy {last["eval_accuracy"]:.4f}'
    if losses.HAS_ACCURACY[plan.recipe.loss]
    else f'test loss {last["eval_loss"]:.4f}'
  )
  log(f'Final: step {plan.num_steps}, {quality}, {eps_text}.')
  return result
