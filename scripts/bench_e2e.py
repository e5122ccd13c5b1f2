"""Is the trainer as fast as its compiled step? `python -m dpjax.train` (e2e) vs the bare kernel.

For each config, on the same Poisson logical batches (the sampler is a pure
function of (seed, step), so this process rebuilds exactly the batches the
trainer draws):

* e2e: `python -m dpjax.train` in a subprocess; the examples/s its
  metrics.jsonl reports for each log window after `--warmup` steps (eval and
  checkpoint time excluded, reported apart), median over windows.
* kernel: `DPStep.train_step`, the compiled logical-step program, called
  back to back on device-resident logical batches (index buffers into the
  training set on the device, or host-gathered buffers put on the device
  beforehand) after warm-up.
* multi_step_kernel: the program the trainer runs (`dpjax.privacy.multi_step`: S
  logical steps a call, same results) back to back on device-resident chunks.
* fused_loop: the trainer's loop rebuilt in this process: sampler -> index
  buffers -> chunks -> the multi-step program (a `Prefetcher` thread for
  host-gathered buffers when the data does not fit), metrics fetched every
  log step.

Each config runs `--repeats` rounds: one trainer run, then the three timers
once each, so every ratio pairs rates taken under the same load (a small VM's
speed drifts by +-15% within a minute). ratio = median over rounds of e2e /
kernel (issue 14's goal: >= 0.9); ratio_vs_multi_step_kernel = the same
against multi_step_kernel (what is left of the host's overhead once S steps
share a dispatch); fused_loop_ratio = fused_loop / kernel. Rates are medians
over rounds. Also, for digits_mlp: the trainer's first 10 steps and its whole
wall time with an empty and then a warm persistent compilation cache.

  python scripts/bench_e2e.py            # writes scripts/results/e2e.json
  python scripts/bench_e2e.py --quick    # < 5 min on 2 CPU cores; scripts/results/e2e_quick.json

The last line printed is one JSON object {config: {"e2e_examples_per_s",
"kernel_examples_per_s", "ratio", ...}}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
from dpjax.privacy import ema as ema_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
from dpjax.privacy import prng

COMMON = {  # Fixed σ (no calibration), no periodic eval / checkpoint inside the timed steps.
  'num_epochs': 0,
  'privacy.target_epsilon': 0.0,
  'privacy.noise_multiplier': 1.0,
  'eval_every_steps': 10**6,
  'checkpoint_every_steps': 10**6,
  'keep_checkpoints': 1,
}
CONFIGS = {
  'digits_mlp': {
    'file': 'configs/digits_mlp.py',
    'overrides': {'sampler.batch_size': 256, 'sampler.physical_batch_size': 64},
    # Steps of ~0.3 ms on 2 CPU cores: log windows of 40 steps (~15 ms), not of a few ms.
    'steps': 3000,
    'quick_steps': 1000,
    'log_every': 40,
    'warmup': 40,
    'quick_repeats': 5,
  },
  # WRN-16-4 (GroupNorm, weight standardisation) on 32x32x3 synthetic data.
  'wrn_synthetic': {
    'file': 'configs/cifar10_wrn.py',
    'overrides': {
      'data.source': 'synthetic',
      'data.num_examples': 2000,
      'data.input_shape': (32, 32, 3),
      'data.num_classes': 10,
      'sampler.batch_size': 32,
      'sampler.physical_batch_size': 16,
      'augmult.num_views': 0,
    },  # The input pipeline, not augmentation multiplicity (K x compute).
    'quick_overrides': {
      'data.num_examples': 500,
      'sampler.batch_size': 16,
      'sampler.physical_batch_size': 8,
    },
    'steps': 24,
    'quick_steps': 8,
    'log_every': 2,
    'warmup': 2,
    'quick_repeats': 2,
  },
}


def _cli_value(value) -> str:
  return f'({", ".join(str(v) for v in value)})' if isinstance(value, tuple) else str(value)


def _spec(name: str, quick: bool) -> dict:
  spec = dict(CONFIGS[name])
  overrides = {**COMMON, **spec['overrides'], **(spec.get('quick_overrides', {}) if quick else {})}
  overrides['num_steps'] = spec['quick_steps'] if quick else spec['steps']
  overrides['log_every_steps'] = spec['log_every']
  return {**spec, 'overrides': overrides, 'num_steps': overrides['num_steps']}


def _load_config(spec: dict):
  import importlib  # pylint: disable=g-import-not-at-top

  module = importlib.import_module(spec['file'][:-3].replace('/', '.'))
  config = module.get_config()
  config.update_from_flattened_dict(spec['overrides'])
  return config


class Run:
  """The trainer's objects for a config, rebuilt in this process."""

  def __init__(self, spec: dict):
    from dpjax.privacy import augmult
    from dpjax.privacy import batching
    from dpjax.data import sources as data
    from dpjax.privacy import dp_step
    from dpjax.models import factory as models
    from dpjax.trainer.planning import optimizers
    from dpjax.trainer.planning import plan as plan_lib  # pylint: disable=g-import-not-at-top,multiple-imports

    config = _load_config(spec)
    self.config = config
    if config.seed is None:  # In-process timers need a seed; the trainer draws its own.
      config.seed = 0
    self.train_source, _ = data.make_sources(config.data)
    n = len(self.train_source)
    self.sampler = plan_lib.make_sampler(config, n)
    p = config.sampler.physical_batch_size
    self.max_batch_size = batching.resolve_max_batch_size(
      self.sampler,
      p,
      config.sampler.max_batch_size,
      num_steps=spec['num_steps'],
      delta=config.privacy.delta,
    )
    self.batcher = batching.Batcher(self.sampler, p, self.max_batch_size)
    model = models.make_model(
      config.model, self.train_source.num_classes, self.train_source.input_shape
    )
    self.step = dp_step.DPStep.for_model(
      model,
      optimizers.make_optimizer(config.optimizer, spec['num_steps']),
      clip_norm=config.privacy.clip_norm,
      noise_multiplier=config.privacy.noise_multiplier,
      expected_batch_size=self.sampler.expected_batch_size,
      private=config.privacy.enabled,
      clipping=config.privacy.clipping,
      label_format=config.data.label_format,
      seed=config.seed,
      precision=config.precision,
      augmult=augmult.Augmult.of(
        config.augmult.num_views, config.augmult.crop_padding, config.augmult.flip
      ),
      allow_repeated_steps=True,
    )  # The timers replay steps; nothing is released.
    self.params = prng.init_params(model, config.seed, self.train_source.input_shape)
    self.opt_state = self.step.optimizer.init(self.params)

  def rows(self, step: int) -> int:
    return int(min(len(self.sampler.indices(step)), self.max_batch_size))


def time_e2e(name: str, spec: dict, run: Run, env: dict | None = None) -> dict:
  """`python -m dpjax.train` in a subprocess; steady-state rates from its metrics.jsonl."""
  with tempfile.TemporaryDirectory() as workdir:
    argv = [
      sys.executable,
      '-m',
      'dpjax.train',
      f'--config={REPO}/{spec["file"]}',
      f'--workdir={workdir}',
    ] + [f'--config.{k}={_cli_value(v)}' for k, v in spec['overrides'].items()]
    start = time.perf_counter()
    proc = subprocess.run(
      argv, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=False
    )
    wall = time.perf_counter() - start
    if proc.returncode:
      raise RuntimeError(f'{name}: dpjax.train failed:\n{proc.stderr[-3000:]}')
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      lines = [json.loads(l) for l in f if l.strip()]
  n = (
    'nonprivate_'  # Timings are not covered by ε (dpjax.trainer.loop.metrics): named nonprivate_*.
  )
  logged = [l for l in lines if n + 'steps_per_second' in l]
  # The trainer's rate of each log window (eval and checkpoint time excluded), after warm-up.
  rates = [
    l[n + 'examples_per_second']
    for l in logged
    if l.get(n + 'examples_per_second') and l['step'] > spec['warmup']
  ]
  out = {
    'examples_per_s': statistics.median(rates) if rates else None,
    'source': 'metrics.jsonl nonprivate_examples_per_second (per log window)',
    'interval_rates': rates,
    'wall_seconds': wall,
    'first_steps_seconds': {l['step']: l[n + 'wall_seconds'] for l in logged[:2]},
    'eval_seconds': [l[n + 'eval_seconds'] for l in lines if n + 'eval_seconds' in l],
    'checkpoint_seconds': [
      l[n + 'checkpoint_seconds'] for l in lines if n + 'checkpoint_seconds' in l
    ],
  }
  values = [l[n + 'compile_seconds'] for l in logged if n + 'compile_seconds' in l]
  if values:
    out['compile_seconds'] = values[-1]
  return out


def kernel_and_loop_timers(run: Run, steps: range, log_every: int) -> tuple[dict, dict]:
  """Timers of the kernel, the trainer's multi-step program and its loop on the same steps,
  warmed up; each call of a timer runs the steps once and returns examples/s.

  kernel: `DPStep.train_step`, the logical-step program, back to back on device-resident
  logical batches after warm-up (the issue's definition). multi_step_kernel: the program the
  trainer runs (`dpjax.privacy.multi_step`, S steps a call) back to back on device-resident chunks.
  loop: the trainer's loop in this process: sampler -> index buffers -> chunks -> the
  multi-step program, one host sync per logged step (a Prefetcher for host-gathered rows).
  Also returns facts about them (compilations, S, first call).
  """
  from dpjax.data import device as device_data
  from dpjax.privacy import multi_step  # pylint: disable=g-import-not-at-top,multiple-imports

  k_max = run.batcher.max_physical_batches
  on_device = device_data.fits_on_device(run.train_source)
  dataset = device_data.put_on_device(run.train_source) if on_device else None
  if on_device:
    make = lambda t: device_data.index_buffer(
      run.batcher.logical_batch(t), k_max, num_rows=len(dataset)
    )
  else:
    make = lambda t: device_data.host_buffer(run.train_source, run.batcher.logical_batch(t), k_max)
  size = multi_step.steps_per_call(
    run.config.steps_per_call, run.step.loop_mode(run.params), on_device
  )
  runner = multi_step.MultiStep(run.step, size, run.config.ema_decay)
  # A list: `schedule` is a generator, and the loop timer walks the calls again (a generator
  # spent by `chunks` left it nothing to run: 2e9 "examples/s").
  calls = list(multi_step.schedule(steps.start, steps.stop, size, (log_every,)))
  make_chunk = lambda call: multi_step.stack(
    call[0], [(None, *make(t)) for t in range(call[0], call[0] + call[1])], size
  )
  batches = [jax.device_put((*make(t), np.uint32(t))) for t in steps]
  chunks = [make_chunk(call) for call in calls]
  examples = sum(run.rows(t) for t in steps)
  state = jax.tree.map(np.array, (run.params, run.opt_state))
  ema = jax.tree.map(np.array, ema_lib.init(run.params)) if run.config.ema_decay else None
  start = time.perf_counter()
  params, opt_state, metrics = run.step.train_step(*state, *batches[0], dataset)
  jax.block_until_ready(metrics)
  first_call = time.perf_counter() - start
  params, opt_state, ema, metrics = runner(params, opt_state, ema, chunks[0], dataset)
  jax.block_until_ready(metrics)

  def kernel():
    nonlocal params, opt_state
    for buf, k, t in batches:
      params, opt_state, metrics = run.step.train_step(params, opt_state, buf, k, t, dataset)
    jax.block_until_ready((params, metrics))

  def multi_kernel():
    nonlocal params, opt_state, ema
    for chunk in chunks:
      params, opt_state, ema, metrics = runner(params, opt_state, ema, chunk, dataset)
    jax.block_until_ready((params, metrics))

  def loop():
    nonlocal params, opt_state, ema
    pending, pacer = [], multi_step.CallPacer(size, adaptive=False)
    with (
      device_data.Prefetcher(make_chunk, calls)
      if not on_device
      else contextlib.nullcontext((c, make_chunk(c)) for c in calls) as prefetched
    ):
      for _, chunk in prefetched:
        params, opt_state, ema, metrics = runner(params, opt_state, ema, chunk, dataset)
        pending.append(metrics)
        pacer.dispatched(metrics)  # As the trainer: at most two calls in flight.
        if (chunk.last_step + 1) % log_every == 0:
          jax.device_get(pending)  # The trainer's one host sync per logged step.
          pending = []
    jax.block_until_ready((params, pending))

  def timed(fn):
    def rate():
      start = time.perf_counter()
      fn()
      return examples / (time.perf_counter() - start)

    return rate

  timers = {
    'kernel': timed(kernel),
    'multi_step_kernel': timed(multi_kernel),
    'fused_loop': timed(loop),
  }
  for rate in timers.values():  # Warm-up (the loop's and multi-step's programs are compiled).
    rate()
  facts = {
    'device_data': on_device,
    'first_call_seconds': first_call,
    'compilations': run.step.compile_count('train_step'),
    'steps_per_call': size,
    'multi_step_compilations': runner.compile_count(),
    'loop_buffers': 'index buffers made inline'
    if on_device
    else 'host buffers from a Prefetcher thread (depth 2)',
  }
  return timers, facts


def time_compilation_cache(name: str, spec: dict, run: Run) -> dict:
  """The trainer's first 10 steps with an empty, then a warm, persistent compilation cache."""
  spec = {
    **spec,
    'overrides': {**spec['overrides'], 'num_steps': 10, 'log_every_steps': 10},
    'warmup': 0,
  }
  out = {}
  with tempfile.TemporaryDirectory() as cache:
    env = {'JAX_COMPILATION_CACHE_DIR': cache, 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0.1'}
    for label in ('cold', 'warm'):
      r = time_e2e(name, spec, run, env)
      out[label] = {
        'first_10_steps_seconds': r['first_steps_seconds'].get(10),
        'process_wall_seconds': r['wall_seconds'],
      }
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true', help='fewer steps (< 5 min on 2 cores)')
  parser.add_argument('--configs', nargs='+', default=list(CONFIGS), choices=list(CONFIGS))
  parser.add_argument(
    '--repeats', type=int, default=None, help='rounds (trainer run + timers) per config'
  )
  parser.add_argument('--out', default=None)
  args = parser.parse_args()
  repeats = args.repeats or (3 if args.quick else 5)
  out_path = args.out or os.path.join(
    REPO, 'scripts', 'results', 'e2e_quick.json' if args.quick else 'e2e.json'
  )
  from dpjax.trainer.loop import compilation_cache  # pylint: disable=g-import-not-at-top
  from dpjax_bench import provenance  # pylint: disable=g-import-not-at-top

  cache_dir = compilation_cache.enable_compilation_cache('')  # The same cache as a user's runs.
  began = time.perf_counter()
  device = jax.devices()[0]
  results = {
    'jax': jax.__version__,
    'backend': jax.default_backend(),
    'device': getattr(device, 'device_kind', str(device)),
    'cpu_count': os.cpu_count(),
    'machine': provenance.machine(),
    'git': provenance.git_state(),
    'quick': args.quick,
    'repeats': repeats,
    'compilation_cache_dir': cache_dir,
    'load_average_start': os.getloadavg(),
    'configs': {},
  }
  summary = {}
  for name in args.configs:
    spec = _spec(name, args.quick)
    run = Run(spec)
    timed = range(spec['warmup'], spec['num_steps'])
    config_repeats = args.repeats or (spec.get('quick_repeats', repeats) if args.quick else repeats)
    env = {
      'JAX_COMPILATION_CACHE_DIR': cache_dir or '',
      'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0.1',
    }
    timers, facts = kernel_and_loop_timers(run, timed, spec['log_every'])
    # Rounds: a trainer run, then each in-process timer once, so a ratio compares rates taken
    # under the same load (this VM's speed drifts by +-15% over a minute).
    rounds = []
    for i in range(config_repeats):
      print(
        f'{name}: round {i + 1}/{config_repeats}: e2e ({spec["num_steps"]} steps of '
        'python -m dpjax.train), then kernel, multi-step kernel and fused loop...',
        flush=True,
      )
      e2e = time_e2e(name, spec, run, env)
      rounds.append({'e2e': e2e, **{key: rate() for key, rate in timers.items()}})
    median = lambda key: statistics.median(
      r[key] if key != 'e2e' else r['e2e']['examples_per_s'] for r in rounds
    )
    paired = lambda key, base: statistics.median(
      r['e2e']['examples_per_s'] / r[base] for r in rounds
    )
    entry = {
      'repeats': config_repeats,
      'physical_loop': run.step.loop_mode(run.params),
      'overrides': {k: v for k, v in spec['overrides'].items()},
      'max_batch_size': run.max_batch_size,
      'expected_batch_size': run.sampler.expected_batch_size,
      'timed_steps': [timed.start, timed.stop],
      'kernel_facts': facts,
      'rounds': rounds,
    }
    if name == 'digits_mlp':
      print(f'{name}: compilation cache cold / warm...', flush=True)
      entry['compilation_cache'] = time_compilation_cache(name, spec, run)
    results['configs'][name] = entry
    summary[name] = {
      'e2e_examples_per_s': median('e2e'),
      'kernel_examples_per_s': median('kernel'),
      'ratio': paired('e2e', 'kernel'),
      'round_ratios': [r['e2e']['examples_per_s'] / r['kernel'] for r in rounds],
      'steps_per_call': facts['steps_per_call'],
      'multi_step_kernel_examples_per_s': median('multi_step_kernel'),
      'ratio_vs_multi_step_kernel': paired('e2e', 'multi_step_kernel'),
      'fused_loop_examples_per_s': median('fused_loop'),
      'fused_loop_ratio': statistics.median(r['fused_loop'] / r['kernel'] for r in rounds),
    }
    print(f'{name}: {json.dumps(summary[name])}', flush=True)
    results['summary'] = summary  # Written after every config: a run cut off keeps what it did.
    results['wall_seconds'] = time.perf_counter() - began
    with open(out_path, 'w') as f:
      json.dump(results, f, indent=1)
  results['summary'] = summary
  results['load_average_end'] = os.getloadavg()
  results['wall_seconds'] = time.perf_counter() - began
  with open(out_path, 'w') as f:
    json.dump(results, f, indent=1)
  print(f'wrote {out_path} in {results["wall_seconds"]:.0f} s', flush=True)
  print(json.dumps(summary))


if __name__ == '__main__':
  main()
