"""Throughput and memory of DP clipping methods against the non-private step.

For each model, times one `DPStep.accumulate` call (one physical batch of P
random examples) for three methods: non-private (one backward pass, no
clipping), 'vmap' (per-example gradients) and 'ghost' (ghost norms and
book-keeping, `dpjax.privacy.ghost_clipping`). Reports examples/s (P / median time
over repeats of samples >= 0.1 s, after compilation), the ratios to
non-private, XLA's memory
estimate of the compiled program (arguments + outputs + temporaries, from
`compiled.memory_analysis()`), and the largest P whose estimate fits a
memory budget: memory is about affine in P, so it is fitted from two
compiled sizes (P and 2P), and for models that compile quickly the predicted
P is compiled again and lowered until it fits (within 2% of the largest).
The three methods are timed round-robin so that load on the shared machine
affects them alike. Also checks that ghost and vmap give the same clipped sum
on the timed batch (max |ghost - vmap| / max |vmap| over leaves) and the
same sum of norms.

With --forms, only ghost clipping's per-layer forms are compared (no vmap, no
memory fit): the FLOP rule's choice (ghost where S²(m + c) < S·m·c, Bu et al.
2022), the measured choice (`ghost_clipping.form_timing`: both forms of each
layer timed on this device, then the whole clipped sum with the winners and
with the FLOP rule's forms, `ghost_clipping.whole_step`), and every layer
forced to the ghost, then the materialised, form (Embed likewise); each as a
ratio to non-private, the measured step's speed over the FLOP rule's, and
what measuring added to the first compile. Written to
bench_clipping_forms_<backend>.json.

Models (issue 5): MLP 784-128-10 and the tanh CNN on 28x28x1 at P = 256,
WRN-16-4 (GroupNorm, weight standardisation) on 32x32x3 at P = 16, and the
default transformer (2 layers, width 64) on 28 tokens of 28 features at
P = 64; with --models vit, ViT-S/4 (12 layers, width 384, 64 tokens of 4x4
patches) on 32x32x3 at P = 8. On a GPU (detected: `jax.default_backend()`)
the physical batches are issue 14's: CNN 1024, WRN 256, ViT 256 (MLP 1024,
transformer 256), and the result goes to bench_clipping_gpu.json. The
device name is recorded. The machine is shared: numbers are medians of
repeats.

Run:
  python scripts/bench_clipping.py            # mlp cnn wrn transformer, ~7 min on 2 cores
  python scripts/bench_clipping.py --models mlp cnn --repeats 30
  python scripts/bench_clipping.py --forms --repeats 9     # forms: mlp cnn wrn transformer
  python scripts/bench_clipping.py --models mlp cnn wrn transformer vit   # on a GPU
Writes scripts/results/bench_clipping.json (bench_clipping_gpu.json on a
GPU; or --out).
"""

import argparse
import contextlib
import json
import os
import platform
import time

import jax
import ml_collections
import numpy as np
import optax

from dpjax.privacy import dp_step
from dpjax.privacy import ghost_clipping
from dpjax.models import factory as models
from dpjax.privacy import prng

METHODS = ('nonprivate', 'vmap', 'ghost')
MAX_P = 2**16  # Larger physical batches are reported as this cap.
MIN_SAMPLE_S = 0.1  # Shortest timed sample (several calls for fast steps).


MODELS = ('mlp', 'cnn', 'wrn', 'transformer', 'vit')
# Physical batch sizes: on the CPU, and on an accelerator (issue 14's table).
PHYSICAL_BATCH = {
  'cpu': {'mlp': 256, 'cnn': 256, 'wrn': 16, 'transformer': 64, 'vit': 8},
  'accelerator': {'mlp': 1024, 'cnn': 1024, 'wrn': 256, 'transformer': 256, 'vit': 256},
}


def _model(name: str):
  """(model, input_shape, physical batch size) for the benchmark."""
  if name == 'mlp':
    cfg = ml_collections.ConfigDict({'name': 'mlp', 'hidden_sizes': (128,)})
    shape = (28, 28, 1)
  elif name == 'cnn':
    cfg, shape = models.default_model_config('cnn'), (28, 28, 1)
  elif name == 'wrn':
    cfg, shape = models.default_model_config('wrn'), (32, 32, 3)
  elif name == 'vit':
    cfg, shape = models.default_model_config('vit'), (32, 32, 3)  # ViT-S/4.
  else:
    cfg, shape = models.default_model_config('transformer'), (28, 28)
  sizes = PHYSICAL_BATCH['cpu' if jax.default_backend() == 'cpu' else 'accelerator']
  return models.make_model(cfg, 10, shape), shape, sizes[name]


def _batch(shape, p, seed=0):
  rng = np.random.default_rng(seed)
  return jax.device_put(
    {
      'x': rng.normal(size=(p, *shape)).astype(np.float32),
      'y': rng.integers(0, 10, p).astype(np.int32),
      'weight': np.ones(p, np.float32),
    }
  )


def _step(model, method: str, p: int, forms: str = 'flops') -> dp_step.DPStep:
  return dp_step.DPStep.for_model(
    model,
    optax.sgd(0.1),
    clip_norm=1.0,
    noise_multiplier=1.0,
    expected_batch_size=p,
    private=method != 'nonprivate',
    clipping='vmap' if method == 'nonprivate' else method,
    clipping_forms=forms,
  )


def _compile(step, params, batch):
  """(compiled accumulate, seconds to compile, estimated peak bytes)."""
  start = time.perf_counter()
  compiled = step.accumulate.lower(params, step.init_accumulator(params), batch).compile()
  seconds = time.perf_counter() - start
  m = compiled.memory_analysis()
  peak = (
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  )
  return compiled, seconds, int(peak)


def _max_batch(model, method, params, shape, fit, budget, verify):
  """Largest P with estimated memory <= budget from the affine fit of two
  compiled sizes; if `verify`, compiled at that P (and lowered until it
  fits)."""
  (p1, b1), (p2, b2) = fit
  slope = (b2 - b1) / (p2 - p1)
  guess = int((budget - b1) / slope + p1) if slope > 0 else MAX_P
  guess = max(1, min(guess, MAX_P))
  checked = []
  while verify:
    _, _, peak = _compile(_step(model, method, guess), params, _batch(shape, guess))
    checked.append((guess, peak))
    if peak <= budget or guess == 1:
      break
    guess = max(1, int(guess * budget / peak * 0.98))
  return guess, checked


def _rel_diff(a, b) -> float:
  scale = max(float(np.max(np.abs(l))) for l in jax.tree.leaves(b))
  return (
    max(
      float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
      for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
    / scale
  )


def _time_interleaved(compiled, accs, params, batch, methods, repeats):
  """(calls per sample, {method: [seconds per call]}): round-robin over the methods, so that
  load changes on the shared machine affect them alike.

  Each timed sample is `calls` back-to-back calls lasting >= MIN_SAMPLE_S for the non-private
  step: a single call of a few ms is at the mercy of thread wake-ups (the MLP's ratio swung
  0.6-1.2 with one call per sample).
  """
  start = time.perf_counter()
  accs['nonprivate'] = jax.block_until_ready(
    compiled['nonprivate'](params, accs['nonprivate'], batch)
  )
  calls = max(1, int(np.ceil(MIN_SAMPLE_S / (time.perf_counter() - start))))
  times = {m: [] for m in methods}
  for _ in range(repeats):
    for method in methods:
      start = time.perf_counter()
      for _ in range(calls):
        accs[method] = compiled[method](params, accs[method], batch)
      jax.block_until_ready(accs[method])
      times[method].append((time.perf_counter() - start) / calls)
  return calls, times


def bench_model(name: str, repeats: int, budget: int, verify_below_s: float) -> dict:
  """Times the methods interleaved (round-robin), so that load changes
  on the shared machine affect them alike; medians over rounds."""
  model, shape, p = _model(name)
  params = prng.init_params(model, 0, shape)
  batch = _batch(shape, p)
  out = {
    'physical_batch_size': p,
    'input_shape': list(shape),
    'num_params': int(sum(l.size for l in jax.tree.leaves(params))),
    'methods': {},
  }
  compiled, accs, sums = {}, {}, {}
  methods = METHODS
  for method in methods:
    step = _step(model, method, p)
    compiled[method], compile_s, peak = _compile(step, params, batch)
    one = compiled[method](params, step.init_accumulator(params), batch)
    sums[method] = jax.block_until_ready((one.grad_sum, one.stats))
    accs[method] = compiled[method](
      params, step.init_accumulator(params), batch
    )  # Warm-up; reused (donated).
    _, _, peak2 = _compile(step, params, _batch(shape, 2 * p))
    max_p, checked = _max_batch(
      model,
      method,
      params,
      shape,
      [(p, peak), (2 * p, peak2)],
      budget,
      verify=compile_s < verify_below_s,
    )
    out['methods'][method] = {
      'compile_seconds': compile_s,
      'peak_bytes': peak,
      'peak_bytes_at_2p': peak2,
      'max_physical_batch_size': max_p,
      'max_batch_verified_by_compiling': checked,
    }
  out['calls_per_sample'], times = _time_interleaved(
    compiled, accs, params, batch, methods, repeats
  )
  for method in methods:
    r = out['methods'][method]
    r['seconds_per_batch'] = float(np.median(times[method]))
    r['examples_per_second'] = p / r['seconds_per_batch']
    print(
      f'{name:12s} {method:10s} {r["examples_per_second"]:10.1f} ex/s '
      f'{r["seconds_per_batch"] * 1e3:9.2f} ms/batch  peak '
      f'{r["peak_bytes"] / 2**20:8.1f} MiB  max P '
      f'{r.get("max_physical_batch_size", "-")} (compile '
      f'{r["compile_seconds"]:.1f}s)',
      flush=True,
    )
  base = out['methods']['nonprivate']['examples_per_second']
  for method in ('vmap', 'ghost'):
    out[f'{method}_over_nonprivate'] = out['methods'][method]['examples_per_second'] / base
  out['ghost_vs_vmap_grad_sum_rel_diff'] = _rel_diff(sums['ghost'][0], sums['vmap'][0])
  out['ghost_vs_vmap_grad_norm_sum_rel_diff'] = abs(
    float(sums['ghost'][1].grad_norm_sum / sums['vmap'][1].grad_norm_sum) - 1
  )
  print(
    f'{name:12s} ghost/nonprivate {out["ghost_over_nonprivate"]:.3f}  '
    f'vmap/nonprivate {out["vmap_over_nonprivate"]:.3f}  ghost vs vmap '
    f'rel diff {out["ghost_vs_vmap_grad_sum_rel_diff"]:.1e}',
    flush=True,
  )
  return out


# --forms: name -> (clipping, clipping_forms, every layer forced to ghost (True) / materialised).
FORM_METHODS = {
  'nonprivate': ('nonprivate', 'flops', None),
  'flops': ('ghost', 'flops', None),
  'measured': ('ghost', 'measured', None),
  'all_ghost': ('ghost', 'flops', True),
  'all_materialised': ('ghost', 'flops', False),
}


def bench_forms(name: str, repeats: int, batch_size: int = 0, methods=tuple(FORM_METHODS)) -> dict:
  """Step time (one physical batch) of ghost clipping with the FLOP rule's forms, the measured
  ones (`form_timing`, timed while compiling: its cost is in that compile time) and every layer
  forced to one form, medians of interleaved repeats; `measured_speedup_over_flops` is the
  FLOP rule's median time over the measured one's (>= 1: measured at least as fast)."""
  model, shape, p = _model(name)
  p = batch_size or p
  params = prng.init_params(model, 0, shape)
  batch = _batch(shape, p)
  out = {'physical_batch_size': p, 'input_shape': list(shape), 'methods': {}}
  compiled, accs, sums = {}, {}, {}
  methods = tuple(m for m in FORM_METHODS if m in {'nonprivate', 'flops', 'measured', *methods})
  for method in methods:
    clipping, forms, forced = FORM_METHODS[method]
    with (
      ghost_clipping.mixed.forced_form(forced) if forced is not None else contextlib.nullcontext()
    ):  # Traced while compiling.
      step = _step(model, clipping, p, forms)
      compiled[method], compile_s, peak = _compile(step, params, batch)
    sums[method] = jax.block_until_ready(
      compiled[method](params, step.init_accumulator(params), batch).grad_sum
    )
    accs[method] = compiled[method](params, step.init_accumulator(params), batch)  # Warm-up.
    out['methods'][method] = {
      'compile_seconds': compile_s,
      'peak_bytes': peak,
      'choice': list(step.clipping_choice),
    }
  out['calls_per_sample'], times = _time_interleaved(
    compiled, accs, params, batch, methods, repeats
  )
  base = float(np.median(times['nonprivate']))
  for method, r in out['methods'].items():
    r['seconds_per_batch'] = float(np.median(times[method]))
    r['over_nonprivate'] = base / r['seconds_per_batch']
    if method != 'nonprivate':
      r['grad_sum_rel_diff_to_flops'] = _rel_diff(sums[method], sums['flops'])
  flops, measured = out['methods']['flops'], out['methods']['measured']
  out['measured_speedup_over_flops'] = flops['seconds_per_batch'] / measured['seconds_per_batch']
  # Timing the forms happens while the measured step compiles (nothing cached in this process).
  out['measuring_compile_seconds'] = measured['compile_seconds'] - flops['compile_seconds']
  tail = lambda r: (
    r['choice'][r['choice'].index('all layers:') + 1 :]
    if 'all layers:' in r['choice']
    else r['choice'][1:]
  )
  out['measured_forms_differ_from_flops'] = tail(measured) != tail(flops)
  # Identical programs run at the same speed: their timed difference is the machine's noise.
  out['measured_same_program_as_flops'] = (
    compiled['measured'].as_text() == compiled['flops'].as_text()
  )
  print(
    f'{name:12s} P={p} / nonprivate: '
    + '  '.join(
      f'{m} {r["over_nonprivate"]:.3f}' for m, r in out['methods'].items() if m != 'nonprivate'
    )
    + f'  measured/flops speed {out["measured_speedup_over_flops"]:.3f}'
    + f' (forms differ: {out["measured_forms_differ_from_flops"]}, same program: '
    f'{out["measured_same_program_as_flops"]})',
    flush=True,
  )
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument(
    '--models', nargs='+', default=['mlp', 'cnn', 'wrn', 'transformer'], choices=list(MODELS)
  )
  parser.add_argument('--repeats', type=int, default=15)
  parser.add_argument('--budget-gib', type=float, default=2.0)
  parser.add_argument(
    '--verify-below-s',
    type=float,
    default=20.0,
    help='compile the fitted max P only for models that '
    'compile faster than this (WRN-16-4 takes ~30 s)',
  )
  parser.add_argument(
    '--forms',
    action='store_true',
    help="time ghost clipping's forms instead: the FLOP rule's, the measured "
    'ones, all ghost, all materialised (bench_clipping_forms.json)',
  )
  parser.add_argument(
    '--batch',
    type=int,
    default=0,
    help='--forms: the physical batch P (0: the default of each model)',
  )
  parser.add_argument(
    '--form-methods',
    nargs='+',
    default=list(FORM_METHODS),
    choices=list(FORM_METHODS),
    help='--forms: which forms to time (nonprivate, flops and measured always are; '
    'all_ghost and all_materialised each compile one more program)',
  )
  parser.add_argument('--out', default=None)
  args = parser.parse_args()
  backend = jax.default_backend()
  stem = 'bench_clipping_forms' if args.forms else 'bench_clipping'
  args.out = args.out or os.path.join(
    os.path.dirname(__file__),
    'results',
    f'{stem}.json' if backend == 'cpu' and not args.forms else f'{stem}_{backend}.json',
  )
  budget = int(args.budget_gib * 2**30)
  result = {
    'jax': jax.__version__,
    'backend': backend,
    'device': jax.devices()[0].device_kind,
    'cpu_count': os.cpu_count(),
    'machine': platform.machine(),
    'repeats': args.repeats,
    'memory_budget_bytes': budget,
    'memory': 'XLA estimate of the compiled accumulate: arguments + '
    'outputs - aliased + temporaries',
    'models': {},
  }
  start = time.perf_counter()
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  for name in args.models:
    result['models'][name] = (
      bench_forms(name, args.repeats, args.batch, args.form_methods)
      if args.forms
      else bench_model(name, args.repeats, budget, args.verify_below_s)
    )
    result['wall_seconds'] = time.perf_counter() - start
    # Written after every model, so a run cut off by its time limit keeps the models it finished.
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)
  print(f'wrote {args.out} ({result["wall_seconds"]:.0f} s)')


if __name__ == '__main__':
  main()
