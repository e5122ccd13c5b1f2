"""The training loop of a resolved plan: DP step, restore, log / eval / checkpoint.

`run(plan, ...)` is what `dpjax.train` calls once the config is validated, the
plan resolved (`dpjax.plan`) and the workdir locked. It reads top to bottom:
model and optimiser → the DP step built from the plan's σ and C → the
training set on the device (or a prefetching host pipeline) → restore → the
loop, one compiled program per logical step, with periodic log / eval /
checkpoint always firing at the last step. Every checkpoint stores the ε of
its step and the plan's privacy fingerprint (`plan.privacy_metadata`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

from absl import logging
import flax
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from dpjax.accounting import ahead as ahead_lib
from dpjax import auditing
from dpjax import augmult as augmult_lib
from dpjax import batching
from dpjax import checkpoints
from dpjax import data
from dpjax import device_data
from dpjax import dp_step
from dpjax import ema as ema_lib
from dpjax import finetune
from dpjax import interrupts
from dpjax import losses
from dpjax import metrics as metrics_lib
from dpjax import multi_step
from dpjax import optimizers
from dpjax import physical_batch
from dpjax import plan as plan_lib
from dpjax import prng
from dpjax import run_seed
from dpjax import run_warnings
from dpjax import sharding
from dpjax.auditing import record as audit_record

@flax.struct.dataclass
class TrainState:
  """Everything a resume needs: sampler and noise are pure functions of (seed, step)."""
  step: jax.Array
  params: Any  # The trainable parameters (all of them unless fine-tuning freezes some).
  opt_state: Any
  num_truncated: jax.Array  # Steps whose logical batch exceeded B (the accountant pays).
  ema: ema_lib.EmaState  # EMA of params (= params when ema_decay = 0): post-processing.


def is_time(step: int, every: int, last_step: int) -> bool:
  """Whether a periodic action fires after `step` (1-based count); always at the last."""
  return step == last_step or (every > 0 and step % every == 0)

class TrainingDiverged(RuntimeError):
  """Non-finite loss or parameters: the run stops, the last good checkpoint is kept."""


class TooManyNonFinite(TrainingDiverged):
  """More than max_nonfinite_fraction of the examples had a non-finite loss or gradient."""


class RunInterrupted(Exception):
  """SIGTERM / SIGINT: the run saved a checkpoint and stops; `exit_code` = 128 + signal."""

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code


@jax.jit
def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))

def run(plan: plan_lib.RunPlan, workdir: str, train_source: data.DataSource,
           test_source: data.DataSource, model, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """The run of a plan, in a locked workdir."""
  config, num_steps, accountant = plan.config, plan.num_steps, plan.accountant
  primary = sharding.is_primary_process()
  log = print if primary else lambda *args, **kwargs: None

  # ---------------------------------------------------------------------------
  # Model, optimiser and the DP step, built from the plan's σ and C.
  # ---------------------------------------------------------------------------
  optimizer = optimizers.make_optimizer(config.optimizer, num_steps)
  params = prng.init_params(model, plan.seed, train_source.input_shape)
  if config.init_from:  # Fine-tuning: public pretrained weights (they do not enter ε).
    params = finetune.load_pretrained(config.init_from, params, config.init_from_rules)
  if config.freeze or config.lora.rank:  # Frozen parameters get no gradient, noise or clipping.
    model, params = finetune.make_finetune(
        model, params, freeze=config.freeze, lora_rank=config.lora.rank,
        lora_alpha=config.lora.alpha, lora_targets=config.lora.targets, seed=plan.seed)
  canaries = wrapper = None
  if config.audit.num_canaries:  # Gradient canaries (dpjax.auditing): clip_C(λ·u_j) per coin.
    canaries = auditing.make_canaries(plan.seed, config.audit.num_canaries,
                                      int(sum(np.size(x) for x in jax.tree.leaves(params))))
    scale = plan.clip_norm if plan.private else 1.0
    wrapper = lambda sum_fn: auditing.with_gradient_canaries(
        sum_fn, canaries, canary_norm=canaries.gradient_scale * scale,
        clip_norm=plan.clip_norm if plan.private else math.inf)
    initial_projection = auditing.project(params, canaries)
    if sharding.is_primary_process() and not os.path.exists(
        os.path.join(workdir, audit_record.AUDIT_FILE)):
      audit_record.write_record(workdir, canaries, confidence=config.audit.confidence,
                                initial_params=params)
  step_options = dict(clipping=config.privacy.clipping, label_format=config.data.label_format,
                      loss=config.loss, noise_impl=config.privacy.noise_prng, mesh=mesh,
                      precision=config.precision, sum_fn_wrapper=wrapper,
                      augmult=augmult_lib.Augmult.from_config(config.augmult))
  if plan.private:  # σ, C, b and the seed from the one plan the accountant was made from.
    step_fns = dp_step.DPStep.from_plan(model, optimizer, plan.privacy, **step_options)
  else:
    step_fns = dp_step.DPStep(model, optimizer, clip_norm=None, noise_multiplier=None,
                              expected_batch_size=plan.sampler.expected_batch_size,
                              private=False, seed=plan.seed, **step_options)

  def run_audit(params) -> dict:
    """The one-run ε lower bound from the canaries' coordinates of θ (Steinke et al. 2023)."""
    return audit_record.audit_params(canaries, initial_projection, jax.device_get(params),
                                     delta=config.privacy.delta,
                                     confidence=config.audit.confidence)
  if plan.private:  # What is reported is what runs.
    assert step_fns.noise_multiplier == accountant.noise_multiplier == plan.noise_multiplier
  eval_fn = jax.jit(  # Sharded like training; the sums come back replicated.
      lambda params, batch: losses.eval_step(model, params, batch, config.data.label_format,
                                             config.loss),
      in_shardings=(sharding.replicated(mesh), sharding.batch_sharding(mesh)),
      out_shardings=sharding.replicated(mesh))

  def run_eval(params, ema):
    out = losses.evaluate(eval_fn, params, test_source, plan.physical_batch_size, mesh)
    if config.ema_decay:  # The EMA parameters, evaluated beside the raw ones.
      out.update({f'{k}_ema': v for k, v in losses.evaluate(
          eval_fn, ema.params, test_source, plan.physical_batch_size, mesh).items()})
    return out

  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  state = sharding.replicate(mesh, TrainState(  # Same seed, same values on every host.
      step=np.int32(0), params=params, opt_state=optimizer.init(params),
      num_truncated=np.int32(0), ema=ema_lib.init(params)))
  # The training set on the device when it fits (the sampler sends indices only); else
  # host-gathered buffers, prefetched on a thread.
  dataset = (device_data.put_on_device(train_source, sharding.replicated(mesh))
             if device_data.fits_on_device(train_source) else None)
  if not plan.physical_batch_size:  # 0: the largest P whose compiled step fits the device.
    # B is already resolved (to the row, without P): P only sizes the [ceil(B/P), P] buffer.
    example = {'index': np.int32(0)}
    if dataset is None:
      example.update({k: v[0] for k, v in train_source.gather(np.zeros(1, np.int64)).items()})
    chosen = physical_batch.choose_physical_batch_size(
        step_fns, state.params, state.opt_state, example, plan.max_batch_size,
        num_devices=mesh.devices.size, dataset=dataset, first=32 * mesh.devices.size,
        log=lambda line: logging.info('%s', line))
    log(f'sampler.physical_batch_size = 0: P = {chosen}, the largest power-of-two multiple of '
        f'the device count whose step fits the device (XLA memory analysis).')
    plan = dataclasses.replace(plan, physical_batch_size=chosen)
  rows = sharding.local_rows(mesh, plan.physical_batch_size)
  batcher = (plan.privacy.batcher(plan.physical_batch_size) if plan.private else
             batching.Batcher(plan.sampler, plan.physical_batch_size, plan.max_batch_size))
  max_physical_batches = batcher.max_physical_batches

  # ---------------------------------------------------------------------------
  # Restore: the same command resumes from the latest readable checkpoint.
  # ---------------------------------------------------------------------------
  manager = checkpoints.make_manager(workdir, config.keep_checkpoints)
  restored = checkpoints.restore_latest(manager, state)
  restored_step = None
  if restored is not None:
    restored_step, state, metadata = restored
    if plan_lib.fingerprint_changes(metadata.get('fingerprint', {}), plan.fingerprint):
      raise plan_lib.PlanError(f'checkpoint {restored_step} has another privacy fingerprint than '
                               f'the newest one; {plan_lib.NEW_WORKDIR_HINT}')
    log(f'Resuming from step {restored_step} ({checkpoints.checkpoint_dir(workdir)}).')
  start_step = int(state.step)
  if primary:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      json.dump(config.to_dict(), f, indent=2)
  log(f'{mesh.devices.size} device(s) on {jax.process_count()} process(es), {len(rows)} rows of '
      f'each physical batch gathered here ({jax.devices()[0].device_kind}).')
  log(f'Model {config.model.name} with {num_params:,} parameters; {plan.summary()}'
      + (f'; final ε = {accountant.epsilon(num_steps):.4f}' if plan.private else '') + '.')
  seed = run_seed.RunSeed(plan.seed, plan.seed_source)
  log(seed.describe(workdir))
  warnings = run_warnings.RunWarnings()
  if plan.private:
    for line in warnings.epsilon(accountant.epsilon(num_steps), plan.target_epsilon):
      log(f'WARNING: {line}')
  preprocess = getattr(getattr(train_source, 'base', train_source), 'preprocess', None)
  if preprocess is not None:  # Where the scale came from: derived or data.scale.
    log(f'Data: {config.data.source}, N = {len(train_source)}, {preprocess.describe()}.')
  for line in plan.warnings:
    log(f'WARNING: {line}')

  # ---------------------------------------------------------------------------
  # Train loop.
  # ---------------------------------------------------------------------------
  writer = metrics_lib.MetricWriter(workdir, restored_step, enabled=primary)
  params, opt_state, ema = state.params, state.opt_state, state.ema
  num_truncated = int(state.num_truncated)
  last = {}
  if start_step == 0:
    last = run_eval(params, ema)
    writer.write(0, last)
  progress = tqdm.tqdm(total=num_steps, initial=start_step, desc='train', dynamic_ncols=True,
                       disable=not primary or (not sys.stderr.isatty()
                                               and os.environ.get('DPJAX_PROGRESS') != '1'))
  log_metrics, window_start = [], start_step + 1
  seen_examples, nonfinite_examples = 0.0, 0  # Since this (re)start: max_nonfinite_fraction.
  compile_seconds = window_clock = checkpoint_seconds = None
  window_examples = window_steps = paused = 0.0  # Paused: eval / checkpoint time in a window.
  first_time = time.time()

  def stop(error: Exception) -> Exception:
    """Leaves the workdir consistent (earlier saves complete, events flushed), returns `error`."""
    progress.close()
    checkpoints.wait_until_finished(manager)
    writer.close()
    return error

  # S logical steps per compiled call (dpjax.multi_step): calls end where the host needs the
  # parameters (logs, evals, checkpoints). ema_decay = 0: the EMA is θ itself (d_t = 0), so no
  # EMA runs; the checkpoint stores what the update would have made, (θ, t).
  size = multi_step.steps_per_call(config.steps_per_call, step_fns.loop_mode(params),
                                   dataset is not None)
  runner = multi_step.MultiStep(step_fns, size, config.ema_decay, mesh)
  # Automatic S: a call lasts ~0.5 s at most, so a signal stops a slow run within ~2 steps.
  pacer = multi_step.CallPacer(size, adaptive=config.steps_per_call == 0 and size > 1)
  calls = multi_step.schedule(start_step, num_steps, size, (
      config.log_every_steps, config.eval_every_steps, config.checkpoint_every_steps),
                              limit=pacer.limit)

  def prepare(call: tuple[int, int]) -> multi_step.Chunk:
    """The logical batches of a call as [S, K_max, P] buffers (this host's rows) and their K."""
    first, count = call
    prepared = []
    for t in range(first, first + count):
      logical = batcher.logical_batch(t)
      buffer, k = (device_data.index_buffer(logical, max_physical_batches, rows) if dataset
                   is not None else device_data.host_buffer(train_source, logical,
                                                            max_physical_batches, rows))
      prepared.append((logical, buffer, k))
    chunk = multi_step.stack(first, prepared, size)
    chunk.buffer = sharding.shard_chunk(mesh, chunk.buffer)
    return chunk

  # XLA:CPU with several (forced) devices: one call in flight at a time, and the next call's
  # buffers are sent to the devices only after it. Programs with cross-device reductions
  # queued back to back have timed out in its all-reduce rendezvous on a loaded 2-core machine,
  # and the 2-process run hung twice in the full suite once the next chunk was sent during a
  # call (tests/test_sharding.py); accelerators keep the async queue and the overlap.
  serialise_steps = mesh.devices.size > 1 and jax.devices()[0].platform == 'cpu'
  # Index buffers are cheap: made inline. Host-gathered rows are prefetched on a thread
  # (not beside serialised steps).
  batches = (contextlib.nullcontext((c, prepare(c)) for c in calls)
             if dataset is not None or serialise_steps
             else device_data.Prefetcher(prepare, calls))
  # ε of the logged and checkpointed steps, computed ahead on a thread while the device trains
  # (the same numbers, without stalling the loop for a PLD composition at every log). Not with
  # several CPU devices: a busy thread beside their collectives starved the all-reduce
  # rendezvous of a 2-process run on 2 loaded cores (it hung); there ε is computed when asked.
  ahead = () if serialise_steps else (
      s for s in range(start_step + 1, num_steps + 1)
      if is_time(s, config.log_every_steps, num_steps)
      or is_time(s, config.checkpoint_every_steps, num_steps))
  epsilons = (contextlib.nullcontext() if accountant is None
              else ahead_lib.EpsilonAhead(accountant, ahead))
  with interrupts.GracefulStop() as signals, batches as batch_stream, epsilons:
    chunks = iter(batch_stream)
    upcoming = next(chunks, None)
    while upcoming is not None:
      chunk = upcoming[1]
      # One compiled call: S logical steps, each K physical batches, noise keyed by
      # (seed, step), the update (and the EMA).
      dispatched = time.time()
      params, opt_state, ema_out, metrics = runner(
          params, opt_state, ema if config.ema_decay else None, chunk, dataset)
      signals.progress = chunk.last_step + 1  # Read by the signal handler.
      ema = ema_out if config.ema_decay else ema
      if serialise_steps:  # Nothing else touches the devices while collectives run.
        jax.block_until_ready(params)
      upcoming = next(chunks, None)  # The next call's buffers, made while this one runs.
      log_metrics.append((metrics, chunk.count))
      done = chunk.last_step + 1
      num_truncated += sum(int(logical.truncated) for logical in chunk.logicals)
      progress.update(int(chunk.count))
      if compile_seconds is None:  # One sync: compilation apart from the steady-state rate.
        jax.block_until_ready(params)
        window_clock = time.time()
        compile_seconds = window_clock - first_time
        if step_fns.clipping_choice:  # Known once the step is traced: one line per layer.
          log('Clipping: ' + '\n  '.join(step_fns.clipping_choice))
      else:
        if not pacer.observed:  # One more sync: how long a step takes, after compilation.
          jax.block_until_ready(params)
          pacer.observe(int(chunk.count), time.time() - dispatched)
        window_steps += int(chunk.count)
        window_examples += sum(min(logical.size, plan.max_batch_size)
                               for logical in chunk.logicals)

      stopping = signals.requested  # A signal: save this step, then exit 128 + signal.
      logging_now = is_time(done, config.log_every_steps, num_steps)
      saving_now = stopping or is_time(done, config.checkpoint_every_steps, num_steps)
      if logging_now or saving_now:  # One host sync per logged or saved step.
        fetched, finite = jax.device_get((log_metrics, _all_finite(params)))  # One sync.
        fetched = [row for m, count in fetched for row in multi_step.rows_of(m, count)]
        loss = float(np.mean([m['loss'] for m in fetched])) if fetched else 0.0
        if not (math.isfinite(loss) and bool(finite)):
          raise stop(TrainingDiverged(
              f'non-finite training loss or parameters between steps {window_start} and '
              f'{done}; the last checkpoint before step {window_start} is intact. Try a smaller '
              'optimizer.learning_rate or privacy.clip_norm, or check the data for NaN/inf.'))
      audit = (run_audit(params) if canaries is not None and saving_now and (
          config.audit.every_checkpoint or done == num_steps) else None)
      if audit is not None and not logging_now:
        writer.write(done, {k: audit[k] for k in ('audit_epsilon_lower', 'audit_confidence')})
      if logging_now:  # Rates of this window's steps; eval and checkpoint time apart.
        elapsed = time.time() - window_clock - paused
        rate = window_steps / elapsed if window_steps and elapsed > 0 else None
        if rate:
          pacer.observe(window_steps, elapsed)  # The steady-state step time.
        # Statistics of the private data that ε does not cover: named nonprivate_*
        # (dpjax.metrics; never exported).
        last = {'nonprivate_train_loss': loss,
                'nonprivate_train_accuracy': float(np.mean([m['accuracy'] for m in fetched])),
                'nonprivate_num_nonfinite_examples': sum(int(m['num_nonfinite'])
                                                         for m in fetched),
                'nonprivate_num_truncated': num_truncated,
                'nonprivate_compile_seconds': compile_seconds,
                'nonprivate_steps_per_second': rate,
                'nonprivate_wall_seconds': time.time() - first_time,
                'nonprivate_examples_per_second': window_examples / elapsed if rate else None,
                'nonprivate_clip_fraction': (
                    sum(int(m['num_clipped']) for m in fetched)
                    / max(1.0, sum(float(m['num_examples']) for m in fetched))),
                'nonprivate_mean_grad_norm': float(np.mean(
                    [m['example_grad_norm'] for m in fetched])) if plan.private else None}
        for line in warnings.check(last, window_start, done, plan.clip_norm):
          log(f'WARNING: {line}')
        log_metrics, window_start = [], done + 1
        seen_examples += sum(float(m['num_examples']) for m in fetched)
        nonfinite_examples += last['nonprivate_num_nonfinite_examples']
        if nonfinite_examples > config.max_nonfinite_fraction * max(seen_examples, 1.0):
          raise stop(TooManyNonFinite(
              f'{nonfinite_examples} of {seen_examples:.0f} examples since the start had a '
              f'non-finite loss or gradient (step {done}), above max_nonfinite_fraction = '
              f'{config.max_nonfinite_fraction:g}; each was dropped (zero contribution) and '
              'the last checkpoint is intact. Lower optimizer.learning_rate, or raise '
              'max_nonfinite_fraction if the data is known to hold such examples.'))
        if accountant is not None:  # Side estimates only at checkpoints.
          # A log row between checkpoints takes ε only if it is ready (computed on the thread)
          # rather than stall the device; a saved step (and the last) always waits for it.
          report = (epsilons.epsilon_at(done) if saving_now or serialise_steps
                    else epsilons.epsilon_if_ready(done))
          if report is not None:
            last.update(epsilon=report.epsilon, epsilon_bound=report.bound)
        if is_time(done, config.eval_every_steps, num_steps):
          clock = time.time()
          last.update(run_eval(params, ema), nonprivate_eval_seconds=time.time() - clock)
        if checkpoint_seconds is not None:  # The latest save's duration (outside the rates).
          last['nonprivate_checkpoint_seconds'] = checkpoint_seconds
        if audit is not None:  # Beside ε: an empirical lower bound, with its confidence.
          last.update({k: audit[k] for k in ('audit_epsilon_lower', 'audit_confidence')})
        writer.write(done, last)
        shown = {k: f'{v:.4g}' for k, v in last.items()
                 if k in ('nonprivate_train_loss', 'nonprivate_train_accuracy', 'eval_accuracy',
                          'epsilon')}
        if 'epsilon' in shown:  # The kind of bound beside the number.
          shown['epsilon'] += f' ({last["epsilon_bound"]})'
        progress.set_postfix(shown)
        if progress.disable and primary:  # No terminal: one plain progress line per log.
          # The steps left, and the ε each coming checkpoint (and the last step) waits for.
          saves_left = (num_steps - done) // config.checkpoint_every_steps + 1
          eta = ((num_steps - done) / rate + saves_left * (
              epsilons.mean_query_seconds if accountant is not None else 0.0)
                 if rate else float('nan'))
          speed = f'{last["nonprivate_examples_per_second"]:.0f} ex/s' if rate else 'compiling'
          print(f'step {done}/{num_steps}, {speed}, ETA {eta:.0f} s, '
                + ' '.join(f'{k}={v}' for k, v in shown.items()), flush=True)
      elif is_time(done, config.eval_every_steps, num_steps):
        jax.block_until_ready(params)  # Queued steps finish inside the rate, not the eval.
        clock = time.time()
        evaluated = run_eval(params, ema)
        evaluated['nonprivate_eval_seconds'] = time.time() - clock
        paused += evaluated['nonprivate_eval_seconds']
        last.update(evaluated)
        writer.write(done, evaluated)

      if saving_now:
        jax.block_until_ready(params)
        clock = time.time()
        # Side estimates (Monte-Carlo, lower bounds, comparisons) at the last step only: they
        # can cost seconds; the attached ε and its kind of bound are the same without them.
        report = epsilons.epsilon_at(done, estimates=done == num_steps) if accountant else None
        metadata = plan_lib.privacy_metadata(done, report, plan, step_fns, batcher, num_truncated)
        metadata['model_io'] = {'num_classes': int(train_source.num_classes),  # For export.
                                'input_shape': [int(d) for d in train_source.input_shape]}
        if audit is not None:
          metadata['audit'] = audit
        checkpoints.save(manager, done, TrainState(
            step=sharding.replicate(mesh, np.int32(done)), params=params, opt_state=opt_state,
            num_truncated=sharding.replicate(mesh, np.int32(num_truncated)),
            ema=ema if config.ema_decay else ema_lib.EmaState(
                params, sharding.replicate(mesh, np.int32(done)))), metadata)
        writer.flush()  # Metrics and TensorBoard events durable at every checkpoint.
        checkpoint_seconds = time.time() - clock
        paused += checkpoint_seconds
      if logging_now:  # The next window starts now.
        window_clock, paused, window_steps, window_examples = time.time(), 0.0, 0, 0
      if stopping and done < num_steps:
        raise stop(RunInterrupted(
            f'stopped by {signals.signal_name} after step {done} of {num_steps} '
            f'({done - signals.progress_at_signal} steps after it arrived); checkpoint {done} '
            'saved. Rerun the same command to resume.', signals.exit_code))
  progress.close()
  checkpoints.wait_until_finished(manager)
  writer.close()

  if num_truncated and accountant is not None:
    log(f'{num_truncated} of {num_steps} logical batches exceeded B = {plan.max_batch_size} and '
        'were truncated; the reported ε accounts for the cap (this count is not covered by ε).')
  if 'eval_accuracy' not in last:
    last.update(run_eval(params, ema))
  result = {'step': num_steps, **last, 'params': params,
            'compilations': {name: count for name, count in (  # The programs the loop ran.
                ('train_steps', runner.compile_count()),
                ('train_step', step_fns.compile_count('train_step'))) if count}}
  final_report = accountant.epsilon_at(num_steps) if accountant else None  # With estimates.
  if final_report is not None:
    result['privacy'] = final_report.to_dict()
  eps_text = (f'ε = {final_report.epsilon:.4f} ({final_report.bound} bound, '
              f'{final_report.accountant}), δ = {final_report.delta:g}' if final_report
              else 'non-private (ε = ∞)')
  if canaries is not None:
    result['audit'] = run_audit(params)
    eps_text += (f'; audit ε ≥ {result["audit"]["audit_epsilon_lower"]:.4f} (one-run lower '
                 f'bound, confidence {config.audit.confidence:g}, '
                 f'{config.audit.num_canaries} canaries)')
  if final_report is not None and not seed.is_secret:
    eps_text += '; the seed came from the config: ε holds only if that seed is secret'
  quality = (f'test accuracy {last["eval_accuracy"]:.4f}' if losses.HAS_ACCURACY[config.loss]
             else f'test loss {last["eval_loss"]:.4f}')
  log(f'Final: step {num_steps}, {quality}, {eps_text}.')
  return result
