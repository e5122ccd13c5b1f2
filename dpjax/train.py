"""Train a model with DP-SGD; re-running the same command resumes.

  python -m dpjax.train --config configs/digits_mlp.py --workdir workdirs/digits_mlp \\
      [--config.privacy.target_epsilon=2.0 ...]

Data parallel over all devices of the machine (`config.num_devices`, see
`dpjax.sharding`); over several hosts, start the same command on every host
with --distributed (jax.distributed.initialize; the coordinator, process count
and id from the flags below, JAX_COORDINATOR_ADDRESS, or the cluster's
environment). Only process 0 writes metrics and the config; every process
takes part in checkpoints, so --workdir must be a shared file system.

Everything lands under --workdir: `config.json` (the resolved config),
`metrics.jsonl` (one JSON object per logged step), TensorBoard event files,
and `checkpoints/<step>/` with the ε of that step. The loop reads top to
bottom: config → data, sampler and batcher → privacy (σ and ε) → model and
optimiser → devices → DP step → restore → train loop with periodic log / eval /
checkpoint, always firing at the last step.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from absl import app
from absl import flags
from absl import logging
import flax
import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_flags
import numpy as np
import optax
import tensorboardX
import tqdm

from dpjax import accounting
from dpjax import batching
from dpjax import checkpoints
from dpjax import data
from dpjax import dp_step
from dpjax import models
from dpjax import samplers
from dpjax import sharding

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Training config file.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and config.')
_DISTRIBUTED = flags.DEFINE_bool(
    'distributed', False, 'Multi-host run: call jax.distributed.initialize() first (on every host).')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', None, 'host:port of process 0 (--distributed; default: '
    'JAX_COORDINATOR_ADDRESS or the cluster environment).')
_NUM_PROCESSES = flags.DEFINE_integer(
    'num_processes', None, 'Number of processes (--distributed; default: from the cluster).')
_PROCESS_ID = flags.DEFINE_integer(
    'process_id', None, 'This process, 0..num_processes-1 (--distributed; default: from the cluster).')
flags.mark_flags_as_required(['config', 'workdir'])

OPTIMIZERS = ('sgd', 'adam')


@flax.struct.dataclass
class TrainState:
  """Everything a resume needs: sampler and noise are pure functions of (seed, step)."""
  step: jax.Array
  params: Any
  opt_state: Any
  num_truncated: jax.Array  # Steps whose logical batch exceeded B (the accountant pays).


def num_train_steps(config: ml_collections.ConfigDict, sampler: samplers.Sampler) -> int:
  """How long: exactly one of `num_steps` or `num_epochs` (epochs of ceil(N/b) steps) is > 0."""
  for field in ('num_steps', 'num_epochs'):
    value = config[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f'{field} must be an integer >= 0 (0 = unset), got {value!r}.')
  if (config.num_steps > 0) == (config.num_epochs > 0):
    raise ValueError('Exactly one of num_steps and num_epochs must be > 0 (the other 0); got '
                     f'num_steps={config.num_steps}, num_epochs={config.num_epochs}.')
  return config.num_steps or config.num_epochs * sampler.steps_per_epoch


def is_time(step: int, every: int, last_step: int) -> bool:
  """Whether a periodic action fires after `step` (1-based count); always at the last."""
  return step == last_step or (every > 0 and step % every == 0)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  if config.name not in OPTIMIZERS:
    raise ValueError(f'optimizer.name = {config.name!r}; valid: {", ".join(OPTIMIZERS)}.')
  if not config.learning_rate > 0:
    raise ValueError(f'optimizer.learning_rate must be > 0, got {config.learning_rate}.')
  if config.name == 'sgd':
    if not 0 <= config.momentum < 1:
      raise ValueError(f'optimizer.momentum must be in [0, 1), got {config.momentum}.')
    return optax.sgd(config.learning_rate, momentum=config.momentum or None)
  return optax.adam(config.learning_rate)


def check_periodic_fields(config: ml_collections.ConfigDict) -> None:
  for field in ('log_every_steps', 'eval_every_steps', 'checkpoint_every_steps', 'keep_checkpoints'):
    value = config[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'{field} must be an integer >= 1, got {value!r}.')


def resolve_config(config: ml_collections.ConfigDict, num_examples: int,
                   sampler: samplers.Sampler) -> ml_collections.ConfigDict:
  """A copy with the run's length in steps and the noise multiplier σ filled in.

  With only `privacy.target_epsilon` set, σ is the smallest noise multiplier
  whose ε after the last step is at most the target
  (`accounting.calibrate_noise_multiplier`). With both set, σ is kept and the
  target is a budget checked before training.
  """
  resolved = ml_collections.ConfigDict(config.to_dict())
  resolved.num_steps = num_train_steps(config, sampler)
  resolved.num_epochs = 0
  privacy = resolved.privacy
  if not privacy.enabled:
    return resolved
  if not (isinstance(privacy.target_epsilon, (int, float)) and privacy.target_epsilon >= 0):
    raise ValueError(f'privacy.target_epsilon must be >= 0 (0 = no target), got '
                     f'{privacy.target_epsilon!r}.')
  if privacy.noise_multiplier is None and not privacy.target_epsilon:
    raise ValueError('Set privacy.noise_multiplier (σ) or privacy.target_epsilon > 0 (σ is then '
                     'calibrated to it), or both (σ fixed, the target is a budget the run may '
                     'not exceed).')
  if privacy.noise_multiplier is None:  # Calibrate σ once; the target stays as the budget.
    privacy.noise_multiplier = accounting.make_accountant(resolved, num_examples).noise_multiplier
  return resolved


def evaluate(step_fn, params, source: data.DataSource, physical_batch_size: int,
             mesh: jax.sharding.Mesh) -> dict[str, float]:
  """Loss and accuracy over a whole split, in zero-weight-padded batches sharded like training."""
  rows = sharding.local_rows(mesh, physical_batch_size)
  totals = None
  for start in range(0, len(source), physical_batch_size):
    indices = np.arange(start, min(start + physical_batch_size, len(source)))
    weights = np.zeros(physical_batch_size, np.float32)
    weights[:len(indices)] = 1
    padded = np.zeros(physical_batch_size, np.int64)
    padded[:len(indices)] = indices
    batch = source.gather(padded[rows])
    batch['weight'] = weights[rows]
    out = step_fn(params, sharding.shard_batch(mesh, batch))
    totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
  totals = jax.device_get(totals)
  return {'eval_loss': float(totals['loss_sum'] / totals['num_examples']),
          'eval_accuracy': float(totals['correct'] / totals['num_examples'])}


class MetricWriter:
  """Scalars to TensorBoard event files and to `metrics.jsonl` (one object per line).

  Disabled (writes nothing) on every process but the first of a multi-host job.
  """

  def __init__(self, workdir: str, resume_step: int, enabled: bool = True):
    self.enabled = enabled
    if not enabled:
      return
    self._path = os.path.join(workdir, 'metrics.jsonl')
    # Lines logged after the checkpoint we resume from are recomputed: drop them.
    if os.path.exists(self._path):
      with open(self._path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)['step'] <= resume_step]
      with open(self._path, 'w') as f:
        f.writelines(kept)
    self._jsonl = open(self._path, 'a')
    self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.enabled:
      return
    for name, value in scalars.items():
      if value is not None:
        self._tb.add_scalar(name, value, step)
    self._jsonl.write(json.dumps({'step': step, **scalars}) + '\n')
    self._jsonl.flush()

  def close(self):
    if not self.enabled:
      return
    self._jsonl.close()
    self._tb.close()


def privacy_metadata(step: int, report: accounting.PrivacyReport | None,
                     config: ml_collections.ConfigDict, sampler: samplers.Sampler,
                     max_batch_size: int, num_truncated: int) -> dict:
  """The claim stored with a checkpoint: what ε holds for exactly this state."""
  return {
      'step': step,
      'privacy': report.to_dict() if report is not None else {
          'epsilon': None, 'bound': 'none (non-private run)', 'accountant': None,
          'delta': None},
      'noise_multiplier': config.privacy.noise_multiplier if config.privacy.enabled else None,
      'clip_norm': config.privacy.clip_norm if config.privacy.enabled else None,
      'num_examples': sampler.num_examples,
      'sampler': {'name': sampler.name, 'batch_size': sampler.batch_size,
                  'expected_batch_size': sampler.expected_batch_size,
                  'sampling_probability': sampler.sampling_probability,
                  'steps_per_epoch': sampler.steps_per_epoch,
                  'max_batch_size': max_batch_size,
                  'physical_batch_size': config.sampler.physical_batch_size},
      'num_truncated': num_truncated,
      'seed': config.seed,
      'config': config.to_dict(),
  }


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains (or resumes) the run described by `config`; returns the final metrics."""
  # ---------------------------------------------------------------------------
  # Data, sampler, batcher. Everything is validated before any compilation.
  # ---------------------------------------------------------------------------
  check_periodic_fields(config)
  train_source, test_source = data.make_sources(config.data, seed=config.seed)
  num_examples = len(train_source)
  sampler = samplers.make_sampler(config, num_examples)
  config = resolve_config(config, num_examples, sampler)
  num_steps = config.num_steps
  delta = config.privacy.delta if config.privacy.enabled else 1e-5
  max_batch_size = batching.resolve_max_batch_size(
      sampler, config.sampler.physical_batch_size, config.sampler.max_batch_size,
      num_steps=num_steps, delta=delta)
  with config.unlocked():
    config.sampler.max_batch_size = max_batch_size
  batcher = batching.Batcher(sampler, config.sampler.physical_batch_size, max_batch_size)

  # ---------------------------------------------------------------------------
  # Devices: a 'data' mesh axis over every device of every host. Each physical
  # batch is split over it (this process gathers only its own rows); state is
  # replicated. Only process 0 writes metrics and logs.
  # ---------------------------------------------------------------------------
  mesh = sharding.make_mesh(config.num_devices)
  sharding.check_physical_batch_size(config.sampler.physical_batch_size, mesh)
  rows = sharding.local_rows(mesh, config.sampler.physical_batch_size)
  primary = sharding.is_primary_process()
  log = print if primary else lambda *args, **kwargs: None

  # ---------------------------------------------------------------------------
  # Privacy: the accountant reads the same config (same sampler, same B) and
  # refuses a run whose final ε would exceed privacy.target_epsilon.
  # ---------------------------------------------------------------------------
  accountant = accounting.make_accountant(config, num_examples) if config.privacy.enabled else None
  final_report = accountant.epsilon_at(num_steps, estimates=False) if accountant else None
  # ---------------------------------------------------------------------------
  # Model, optimiser and the DP step.
  # ---------------------------------------------------------------------------
  model = models.make_model(config.model, train_source.num_classes, train_source.input_shape)
  optimizer = make_optimizer(config.optimizer)
  step_fns = dp_step.DPStep(
      model, optimizer, clip_norm=config.privacy.clip_norm,
      noise_multiplier=config.privacy.noise_multiplier, expected_batch_size=sampler.expected_batch_size,
      private=config.privacy.enabled, clipping=config.privacy.clipping,
      label_format=config.data.label_format, mesh=mesh)
  eval_fn = jax.jit(  # Sharded like training; the sums come back replicated.
      lambda params, batch: dp_step.eval_step(model, params, batch, config.data.label_format),
      in_shardings=(sharding.replicated(mesh), sharding.batch_sharding(mesh)),
      out_shardings=sharding.replicated(mesh))
  run_eval = lambda params: evaluate(eval_fn, params, test_source, config.sampler.physical_batch_size,
                                     mesh)
  params = dp_step.init_params(model, config.seed, train_source.input_shape)
  state = sharding.replicate(mesh, TrainState(  # Same seed, same values on every host.
      step=np.int32(0), params=params, opt_state=optimizer.init(params),
      num_truncated=np.int32(0)))
  replicated = sharding.replicated(mesh)

  # ---------------------------------------------------------------------------
  # Restore: the same command resumes from the latest readable checkpoint.
  # ---------------------------------------------------------------------------
  os.makedirs(workdir, exist_ok=True)
  manager = checkpoints.make_manager(workdir, config.keep_checkpoints)
  restored = checkpoints.restore_latest(manager, state)
  if restored is not None:
    restored_step, state, metadata = restored
    saved_config = ml_collections.ConfigDict(metadata['config'])
    if config.privacy.enabled and saved_config.privacy.noise_multiplier != config.privacy.noise_multiplier:
      raise ValueError(
          f'The checkpoint at step {restored_step} was trained with σ = '
          f'{saved_config.privacy.noise_multiplier}, this config resolves to σ = '
          f'{config.privacy.noise_multiplier}; mixing them would break the privacy claim. '
          'Use a fresh --workdir or the original config.')
    log(f'Resuming from step {restored_step} ({checkpoints.checkpoint_dir(workdir)}).')
  start_step = int(state.step)
  if primary:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      json.dump(config.to_dict(), f, indent=2)
  log('Config:\n' + json.dumps(config.to_dict(), indent=2))
  log(f'{mesh.devices.size} device(s) on {jax.process_count()} process(es), '
      f'{len(rows)} rows of each physical batch gathered here.')
  log(f'N = {num_examples}, {sampler.name} sampler, expected batch {sampler.expected_batch_size:g}, '
      f'B = {max_batch_size}, P = {config.sampler.physical_batch_size}, {num_steps} steps'
      + (f', σ = {config.privacy.noise_multiplier:.4f}, C = {config.privacy.clip_norm}, '
         f'final ε = {final_report.epsilon:.4f} ({final_report.bound}, {final_report.accountant}), '
         f'δ = {final_report.delta:g}' if final_report else ', non-private'))

  # ---------------------------------------------------------------------------
  # Train loop.
  # ---------------------------------------------------------------------------
  writer = MetricWriter(workdir, start_step, enabled=primary)
  params, opt_state, num_truncated = state.params, state.opt_state, int(state.num_truncated)
  last = {}
  if start_step == 0:
    last = run_eval(params)
    writer.write(0, last)
  progress = tqdm.tqdm(total=num_steps, initial=start_step, desc='train', dynamic_ncols=True,
                       disable=not primary or (not sys.stderr.isatty()
                                               and os.environ.get('DPJAX_PROGRESS') != '1'))
  start_time, log_metrics = time.time(), []
  for step in range(start_step, num_steps):
    logical = batcher.logical_batch(step)
    num_truncated += int(logical.truncated)
    acc = step_fns.init_accumulator(params)
    for indices, weights in logical.physical_batches():
      batch = train_source.gather(indices[rows])  # This host's rows only.
      batch['weight'] = weights[rows]
      acc = step_fns.accumulate(params, acc, sharding.shard_batch(mesh, batch))
    # The same key on every device: the noise is drawn once, replicated.
    key = jax.device_put(dp_step.noise_key(config.seed, step), replicated)
    params, opt_state, metrics = step_fns.apply(params, opt_state, acc, key)
    log_metrics.append(metrics)
    done = step + 1
    progress.update(1)

    if is_time(done, config.log_every_steps, num_steps):
      fetched = jax.device_get(log_metrics)  # One host sync per logged step.
      summary = {k: float(np.mean([m[k] for m in fetched])) for k in ('loss', 'accuracy')}
      if not math.isfinite(summary['loss']):
        raise FloatingPointError(f'Non-finite training loss between steps {done - len(log_metrics) + 1} '
                                 f'and {done}.')
      num_nonfinite = sum(int(m['num_nonfinite']) for m in fetched)
      log_metrics = []
      last = {'train_loss': summary['loss'], 'train_accuracy': summary['accuracy'],
              'num_nonfinite_examples': num_nonfinite, 'num_truncated': num_truncated,
              'steps_per_second': (done - start_step) / (time.time() - start_time)}
      if accountant is not None:
        last['epsilon'] = accountant.epsilon(done)  # The attached ε; side estimates only at checkpoints.
      if is_time(done, config.eval_every_steps, num_steps):
        last.update(run_eval(params))
      writer.write(done, last)
      shown = {k: f'{v:.4g}' for k, v in last.items()
               if k in ('train_loss', 'train_accuracy', 'eval_accuracy', 'epsilon')}
      progress.set_postfix(shown)
      if progress.disable and primary:  # No terminal: one plain line per logged step.
        print(f'step {done}/{num_steps} ' + ' '.join(f'{k}={v}' for k, v in shown.items()), flush=True)
    elif is_time(done, config.eval_every_steps, num_steps):
      last.update(run_eval(params))
      writer.write(done, {k: last[k] for k in ('eval_loss', 'eval_accuracy')})

    if is_time(done, config.checkpoint_every_steps, num_steps):
      # Side estimates (Monte-Carlo, lower bounds, comparisons) at the last step only: they
      # can cost seconds, and the attached ε and its kind of bound are the same without them.
      report = accountant.epsilon_at(done, estimates=done == num_steps) if accountant else None
      checkpoints.save(manager, done, TrainState(
          step=sharding.replicate(mesh, np.int32(done)), params=params, opt_state=opt_state,
          num_truncated=sharding.replicate(mesh, np.int32(num_truncated))),
          privacy_metadata(done, report, config, sampler, max_batch_size, num_truncated))
  progress.close()
  manager.wait_until_finished()
  writer.close()

  if num_truncated and accountant is not None:
    log(f'{num_truncated} of {num_steps} logical batches exceeded B = {max_batch_size} and were '
        'truncated; the reported ε accounts for the cap.')
  if 'eval_accuracy' not in last:
    last.update(run_eval(params))
  result = {'step': num_steps, **last, 'params': params,
            'compilations': {'accumulate': step_fns.compile_count('accumulate'),
                             'apply': step_fns.compile_count('apply')}}
  if final_report is not None:
    final_report = accountant.epsilon_at(num_steps)  # With the estimates reported beside ε.
    result['privacy'] = final_report.to_dict()
  eps_text = (f'ε = {final_report.epsilon:.4f} ({final_report.bound} bound, {final_report.accountant}), '
              f'δ = {final_report.delta:g}' if final_report else 'non-private (no ε)')
  log(f'Final: step {num_steps}, test accuracy {last["eval_accuracy"]:.4f}, {eps_text}.')
  return result


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)  # Orbax's per-save INFO lines drown the progress bar.
  try:
    launch = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    if _DISTRIBUTED.value:  # Before anything touches a device.
      sharding.initialize_distributed(*launch)
    elif any(value is not None for value in launch):
      raise ValueError('--coordinator_address, --num_processes and --process_id only apply with '
                       '--distributed (a multi-host run).')
    train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except ValueError as e:  # Bad config or data: the message names the field; no traceback.
    sys.exit(f'dpjax.train: error: {e}')


if __name__ == '__main__':
  app.run(main)
