"""Train a model with DP-SGD; re-running the same command resumes.

  python -m dpjax.train --config configs/digits_mlp.py:runlocal --workdir /tmp/dpjax_smoke
  python -m dpjax.train --config configs/digits_mlp.py:runlocal --workdir /tmp/dpjax_smoke_eps2 \\
      --config.privacy.target_epsilon=2.0

(`:runlocal` shrinks the run to a few steps; drop it for the full run.) Every
field that enters ε is resolved once into a `dpjax.trainer.planning.plan.RunPlan` and stored
as the privacy fingerprint of every checkpoint; a rerun that would change it
is refused before any compute (use a new --workdir). Bad input of any kind
prints one line and exits with code 2 before anything in the workdir changes.

Data parallel over all devices of the machine (`config.num_devices`, see
`dpjax.privacy.sharding`), with parameters, optimizer state and EMA split over
`config.mesh.fsdp` devices (and `mesh.tensor` with `mesh.tensor_parallel`;
`dpjax.privacy.param_sharding`); over several hosts, start the same command on every host
with --distributed (jax.distributed.initialize; the coordinator, process count
and id from the flags below, JAX_COORDINATOR_ADDRESS, or the cluster's
environment). Only process 0 writes metrics and the config; every process
takes part in checkpoints, so --workdir must be a shared file system.

Everything lands under --workdir: `config.json` (the resolved config),
`metrics.jsonl` (one JSON object per logged step), TensorBoard event files,
and `checkpoints/<step>/` with the ε of that step. This module validates the
config, data and workdir, resolves the plan (sampler, B, σ, accountant) and
locks the workdir, all before any compute; `dpjax.trainer.loop.training_loop` runs it.
"""

from __future__ import annotations

if __name__ == '__main__':  # Ctrl-C or SIGTERM during the imports below: one line, exit.
  from dpjax.trainer.commands import interrupts  # pylint: disable=g-import-not-at-top

  interrupts.exit_on_signals('dpjax.train', ' before training started')

import dataclasses  # pylint: disable=g-import-not-at-top,wrong-import-position
import os
import signal
import sys
import tempfile
from typing import Any

from absl import app
from absl import flags
from absl import logging
import ml_collections
from ml_collections import config_flags

from dpjax import configs
from dpjax.trainer.commands import cli
from dpjax.trainer.commands import interrupts

# The trainer's modules (jax, flax, orbax, the data) are imported by the functions that use
# them, after the flags are parsed: --help and a bad flag answer at once
# (tests/e2e/test_cli_start.py).

_CONFIG = config_flags.DEFINE_config_file(
  'config',
  None,
  "the training config: a file (path[:arg]) or a packaged config's name "
  '(digits_mlp, mnist_cnn, ...); omitted: the config.json of the run in --workdir (resume). '
  '--config.<field>=value overrides a field',
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
  'workdir',
  None,
  'directory for checkpoints, metrics and config (private: publish with python -m dpjax.export)',
)
_DISTRIBUTED = flags.DEFINE_bool(
  'distributed', False, 'Multi-host run: call jax.distributed.initialize() first (on every host).'
)
_COORDINATOR = flags.DEFINE_string(
  'coordinator_address',
  None,
  'host:port of process 0 (--distributed; default: '
  'JAX_COORDINATOR_ADDRESS or the cluster environment).',
)
_NUM_PROCESSES = flags.DEFINE_integer(
  'num_processes', None, 'Number of processes (--distributed; default: from the cluster).'
)
_PROCESS_ID = flags.DEFINE_integer(
  'process_id', None, 'This process, 0..num_processes-1 (--distributed; default: from the cluster).'
)
flags.mark_flags_as_required(['workdir'])
PROG = 'dpjax.train'


def check_workdir(workdir: str) -> str:
  """The absolute workdir; ConfigError unless it is (or can become) a writable directory.

  Writes nothing: a missing workdir is created only once the run is planned.
  """
  from dpjax.trainer.configuration import config_fields  # pylint: disable=import-outside-toplevel

  if not workdir:
    raise config_fields.ConfigError('--workdir: must name a directory.')
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise config_fields.ConfigError(f'--workdir {workdir!r}: is a file, not a directory.')
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise config_fields.ConfigError(
      f'--workdir {workdir!r}: {existing!r} is a file, not a directory.'
    )
  if not _can_create_in(existing):
    raise config_fields.ConfigError(
      f'--workdir {workdir!r}: cannot create files in {existing!r} (not writable).'
    )
  return path


def _can_create_in(directory: str) -> bool:
  """Whether a directory can be made in `directory` (probed: os.access is wrong for root)."""
  try:
    os.rmdir(tempfile.mkdtemp(prefix='.dpjax-probe-', dir=directory))
    return True
  except OSError:
    return False


def resume_point(workdir: str) -> tuple[int, dict | None]:
  """(step, privacy fingerprint) of the newest checkpoint's metadata; (0, None) if none.

  Reads JSON only (creates nothing). A checkpoint without a fingerprint gives {}.
  """
  from dpjax.trainer.workdir import checkpoints  # pylint: disable=import-outside-toplevel

  rows = [row for row in checkpoints.read_metadata(workdir) if 'error' not in row]
  if not rows:
    return 0, None
  return rows[-1]['step'], rows[-1].get('fingerprint', {})


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains (or resumes) the run described by `config`; returns the final metrics.

  Raises ValueError (bad config, data, workdir, a workdir in use, a resume that would
  change the privacy fingerprint) before anything is written or compiled;
  TrainingDiverged, RunInterrupted or write_errors.WriteError (a full disk; a failed
  checkpoint is its CheckpointSaveError) while training.
  """
  # pylint: disable=import-outside-toplevel
  from dpjax.privacy import sharding
  from dpjax.trainer.workdir import checkpoints, workdir_lock
  from dpjax.trainer.loop import training

  # pylint: enable=import-outside-toplevel
  # ---------------------------------------------------------------------------
  # Config, workdir, data, model, devices: all validated before anything is
  # written or compiled.
  # ---------------------------------------------------------------------------
  workdir, (train_source, test_source), model, perf, mesh = _validated_inputs(config, workdir)

  # ---------------------------------------------------------------------------
  # The plan: sampler, B, σ (given, the checkpoint's, or calibrated) and the
  # accountant, resolved once. A resume must match the checkpoint's privacy
  # fingerprint; a run that would exceed privacy.target_epsilon is refused.
  # One run per workdir: process 0 holds its lock (a second run refuses).
  # ---------------------------------------------------------------------------
  lock = workdir_lock.WorkdirLock(workdir, primary=sharding.is_primary_process())
  try:
    if os.path.isdir(checkpoints.checkpoint_dir(workdir)):  # A run to resume: lock, then read.
      lock.acquire()
    plan, seed, resumed = _plan(config, workdir, train_source, perf)
    lock.acquire()  # Creates a fresh workdir; a no-op if held.
    if resume_point(workdir) != resumed:  # Another run wrote here meanwhile: plan again.
      plan, seed, resumed = _plan(config, workdir, train_source, perf)
    if sharding.is_primary_process():  # Before any compute: the resume needs it.
      plan = _record_seed(plan, workdir, seed, resumed)
    return training.run(plan, workdir, train_source, test_source, model, mesh)
  finally:
    lock.release()


def _validated_inputs(config: ml_collections.ConfigDict, workdir: str) -> tuple:
  """(workdir, (train, test) sources, model, `Perf`, mesh), each checked before anything is
  written or compiled (ConfigError, one line, naming the field)."""
  # pylint: disable=import-outside-toplevel
  from dpjax.models import factory as models
  from dpjax.privacy import auditing, augmult as augmult_lib, sharding
  from dpjax.trainer.configuration import config_fields, perf as perf_lib
  from dpjax.trainer.planning import plan as plan_lib

  # pylint: enable=import-outside-toplevel
  config_fields.validate(config)
  a = config.audit
  auditing.check_audit(a.num_canaries, a.kind, a.confidence, a.every_checkpoint, prefix='audit.')
  workdir = check_workdir(workdir)
  train_source, test_source = plan_lib.make_training_sources(config)
  if config.augmult.num_views > 1:  # Crops and flips need images; checked before any compute.
    augmult_lib.check_config(
      config.augmult.num_views,
      config.augmult.crop_padding,
      config.augmult.flip,
      input_shape=train_source.input_shape,
    )
  model = models.make_model(config.model, train_source.num_classes, train_source.input_shape)
  perf = perf_lib.Perf.from_config(config)
  mesh = sharding.make_mesh(perf.num_devices, perf.fsdp, perf.tensor)
  sharding.check_physical_batch_size(perf.physical_batch_size, mesh)
  return workdir, (train_source, test_source), model, perf, mesh


def _plan(config: ml_collections.ConfigDict, workdir: str, train_source, perf):
  """(the plan, its seed, the resume point) of `config` in `workdir` as it is now."""
  from dpjax.trainer.planning import plan as plan_lib  # pylint: disable=import-outside-toplevel
  from dpjax.trainer.workdir import run_seed

  resumed = resume_point(workdir)
  seed = run_seed.broadcast_seed(run_seed.resolve_seed(config.seed, workdir))
  plan = plan_lib.make_plan(
    config,
    train_source,
    resumed[1],
    seed=seed.value,
    seed_source=seed.source,
    resumed_step=resumed[0],
    perf=perf,
  )
  return plan, seed, resumed


def _record_seed(plan, workdir: str, seed, resumed: tuple[int, dict | None]):
  """Stores the seed (process 0) and the run's identity; `plan` with a warning if a given
  seed was used by another run already."""
  # pylint: disable=import-outside-toplevel
  from dpjax.trainer.workdir import run_identity, run_seed, seed_record

  # pylint: enable=import-outside-toplevel
  run_seed.store_seed(workdir, seed)
  # The seed record tells runs apart by their run id: a start from scratch is a new run
  # whatever its path (a workdir deleted and trained again); a resume is the same run.
  if resumed[0]:
    run_identity.kept(workdir)  # A workdir from before run ids gets one.
    return plan
  run = run_identity.fresh(workdir)
  if seed.source != 'config':
    return plan
  reuse = seed_record.start_warnings(
    plan.fingerprint['seed_sha256'], workdir, run.run_id, run.earlier
  )
  return dataclasses.replace(plan, warnings=plan.warnings + tuple(reuse))


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parse with dpjax's conventions: --help / -h print usage and exit 0; without
  --config, a --workdir holding a run supplies its config.json (resume with --workdir alone)."""
  argv = list(argv)
  if any(a in ('-h', '--help', '--helpfull') for a in argv[1:]):
    print(
      cli.usage(
        PROG,
        __doc__,
        flags.FLAGS,
        names=(
          'config',
          'workdir',
          'distributed',
          'coordinator_address',
          'num_processes',
          'process_id',
        ),
      )
    )
    sys.exit(0)
  has_config = any(a == '--config' or a.startswith('--config=') for a in argv[1:])
  workdir = cli.flag_value(argv[1:], 'workdir')
  if not has_config and workdir and os.path.isfile(os.path.join(workdir, 'config.json')):
    # Before its overrides: absl registers --config.<field> when it meets --config.
    argv.insert(1, f'--config={configs.FROM_WORKDIR}:{os.path.abspath(workdir)}')
  elif not has_config:
    cli.fail(
      PROG,
      "--config: required (a config file or a packaged config's name, e.g. "
      '--config digits_mlp), unless --workdir holds a run to resume (its config.json).',
    )
  rest = cli.parse_flags(PROG, flags.FLAGS, argv)
  launch = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if not _DISTRIBUTED.value and any(value is not None for value in launch):
    cli.fail(
      PROG,
      '--coordinator_address, --num_processes and --process_id only apply with '
      '--distributed (a multi-host run).',
    )
  return rest


def main(argv):
  del argv
  # pylint: disable=import-outside-toplevel
  from dpjax.privacy import sharding
  from dpjax.trainer.loop import compilation_cache, training_loop
  from dpjax.trainer.workdir import write_errors

  # pylint: enable=import-outside-toplevel
  logging.set_verbosity(logging.ERROR)  # Orbax's per-save INFO lines drown the progress bar.
  prog = PROG
  try:
    launch = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)  # Checked: parse_flags.
    try:
      config = _CONFIG.value  # Overrides are applied here: an unknown field fails now.
    except Exception as e:  # pylint: disable=broad-except
      cli.fail(prog, cli.config_override_error(sys.argv[1:]) or f'--config: {e}')
    if _DISTRIBUTED.value:  # Before anything touches a device.
      sharding.initialize_distributed(*launch)
    compilation_cache.enable_compilation_cache(config.compilation_cache_dir)  # Before compiling.
    train_and_evaluate(config, _WORKDIR.value)
  except ValueError as e:  # Bad config, data or workdir: the message names the field.
    cli.fail(prog, e)
  except training_loop.RunInterrupted as e:
    print(f'{prog}: {e}', file=sys.stderr, flush=True)
    if e.abandoned:  # XLA still compiles on a thread: no interpreter teardown under it.
      sys.stdout.flush()
      os._exit(e.exit_code)  # pylint: disable=protected-access
    sys.exit(e.exit_code)
  except (training_loop.TrainingDiverged, write_errors.WriteError) as e:  # Checkpoints too.
    cli.fail(prog, e, code=1)
  except BrokenPipeError:  # The reader of our output went away (`| head`).
    cli.quiet_broken_pipe()
    sys.exit(1)
  except KeyboardInterrupt:  # Ctrl-C before the loop (it handles its own): no traceback.
    interrupts.exit_interrupted(
      f'{prog}: interrupted (Ctrl-C) before training started; rerun the same command to '
      'start again.'
    )


if __name__ == '__main__':
  # KeyboardInterrupt from here on, and again at the loop's start if Python dropped it.
  signal.signal(signal.SIGINT, interrupts.interrupt_before_the_loop)
  sys.unraisablehook = interrupts.drop_lost_interrupts
  try:
    app.run(main, flags_parser=parse_flags)
  except KeyboardInterrupt:  # During start-up (imports, flag parsing).
    interrupts.exit_interrupted(f'{PROG}: interrupted (Ctrl-C) before training started.')
