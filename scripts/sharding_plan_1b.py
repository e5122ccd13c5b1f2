"""Plan before you rent: per-device memory of a 1B-parameter decoder's DP step on 8 × 80 GB.

Question (issue 37, item 6): a VaultGemma-sized causal LM (26 layers, sequence 1024, width
1152, 4 heads, MLP 6912, vocabulary 256,000; dpjax's pre-LN transformer: an ungated GELU MLP
and an untied output layer, so ~1.14B parameters where VaultGemma has ~1.0B) trained by
dpjax's DP step (Adam, EMA, Gaussian noise) on 8 accelerators: how many bytes does each
device hold, by XLA's memory analysis of the compiled step, for fsdp ∈ {1, 8}, with ghost
clipping and with per-example gradients (vmap), and what is the largest physical batch P
(a multiple of data · fsdp = 8) whose step fits 80 GB?

Nothing is allocated: params, Adam state and EMA are `jax.eval_shape` shapes, the step is
lowered from `jax.ShapeDtypeStruct`s with the shardings of `param_sharding` on 8 forced CPU
devices and compiled ahead of time (`bench_sharding.compile_step`); only the compiler runs.
XLA:CPU's analysis stands in for the accelerator's: the same SPMD partitioning and buffer
assignment, but a GPU/TPU compiler fuses and schedules differently, so treat the numbers as
a plan (within tens of percent), and leave headroom.

The search over P: bytes(P) at P = 8 and 16 fix a line; the line's largest P under the
limit is compiled, then P is stepped by 8 (up or down, compiling each) until P fits and
P + 8 does not: every P reported as fitting was compiled. `--layers N` compiles a shallower
model instead (labelled in the JSON; `--depths` checks linearity in depth and extrapolates).

Usage:
  python scripts/sharding_plan_1b.py [--limit_gb 80] [--configs fsdp1-ghost,...]
Writes scripts/results/sharding_plan_1b.json and prints a table.
"""

from __future__ import annotations

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_sharding

from dpjax.privacy import sharding

VAULTGEMMA_1B = bench_sharding.Setup(
  num_layers=26,
  model_dim=1152,
  num_heads=4,
  mlp_dim=6912,
  vocab=256_000,
  length=1024,
  physical_batch=8,
  num_batches=1,
)
GB = 1e9  # Bytes; the limit is the accelerator's nominal 80 GB (= 74.5 GiB).


def compile_memory(setup: bench_sharding.Setup, fsdp: int, physical_batch: int) -> dict:
  """XLA's per-device memory of the setup's step (+ EMA) on (data = 8/fsdp, fsdp), from
  shapes only, with the compile time; {'refused': line} if the step refuses the layout."""
  mesh = sharding.make_mesh(fsdp=fsdp)
  step = bench_sharding.make_step(setup, mesh)
  state = bench_sharding.abstract_state(setup, step)
  buffer = bench_sharding.abstract_buffer(setup, physical_batch)
  start = time.perf_counter()
  try:
    compiled = bench_sharding.compile_step(step, state, buffer, mesh)
  except ValueError as e:
    return {'refused': str(e).splitlines()[0]}
  out = bench_sharding.memory(compiled)
  out['compile_seconds'] = time.perf_counter() - start
  out['state'] = bench_sharding.state_bytes(state, bench_sharding.state_shardings(state, mesh))
  out['physical_batch'] = physical_batch
  return out


def full_state_bytes(setup: bench_sharding.Setup, fsdp: int) -> dict:
  """Per-device bytes of params, Adam state and EMA of the full-depth model (shapes only)."""
  mesh = sharding.make_mesh(fsdp=fsdp)
  state = bench_sharding.abstract_state(setup, bench_sharding.make_step(setup, mesh))
  return bench_sharding.state_bytes(state, bench_sharding.state_shardings(state, mesh))


def largest_batch(measure, groups: int, limit: int, log) -> dict:
  """The largest P (a multiple of `groups`) with measure(P)['total'] <= limit, and every
  measurement made; `measure(P)` compiles (see the module docstring for the search)."""
  seen = {}

  def total(p):
    if p not in seen:
      seen[p] = measure(p)
      log(p, seen[p])
    return seen[p].get('total', float('inf'))

  a, b = groups, 2 * groups
  if total(a) > limit:
    return {'largest_physical_batch': 0, 'measured': seen}
  slope = max((total(b) - total(a)) / groups, 1.0)
  p = max(groups, groups * int((a + (limit - total(a)) / slope) // groups))
  while total(p) > limit:
    p -= groups
  while total(p + groups) <= limit:
    p += groups
  line = {'bytes_at_first': total(a), 'bytes_per_unit_of_P': slope}
  return {'largest_physical_batch': p, 'fit': line, 'measured': seen}


def depth_extrapolated(setup, fsdp: int, depths, physical_batch: int) -> dict:
  """Memory at setup.num_layers layers from compiles at `depths` (a line per field through
  the first and last depth), with the worst relative miss of that line at the middle
  depths: the check that bytes are linear in depth. Labelled 'extrapolated'."""
  runs = {
    d: compile_memory(dataclasses.replace(setup, num_layers=d), fsdp, physical_batch)
    for d in depths
  }
  if any('refused' in r for r in runs.values()):
    return next(r for r in runs.values() if 'refused' in r)
  lo, hi = depths[0], depths[-1]
  out, worst = {'extrapolated_from_depths': list(depths)}, 0.0
  for key in ('arguments', 'outputs', 'temporaries', 'aliased', 'total'):
    per_layer = (runs[hi][key] - runs[lo][key]) / (hi - lo)
    out[key] = int(runs[lo][key] + per_layer * (setup.num_layers - lo))
    for d in depths[1:-1]:
      line = runs[lo][key] + per_layer * (d - lo)
      worst = max(worst, abs(runs[d][key] - line) / max(runs[d][key], 1))
  out['linearity_worst_relative_miss'] = worst
  out['compile_seconds'] = sum(r['compile_seconds'] for r in runs.values())
  out['physical_batch'] = physical_batch
  return out


CONFIGS = {
  'fsdp1-ghost': (1, 'ghost'),
  'fsdp8-ghost': (8, 'ghost'),
  'fsdp1-vmap': (1, 'vmap'),
  'fsdp8-vmap': (8, 'vmap'),
}


def plan(setup, configs, limit: int, depths=None, verify=(), save=lambda results: None) -> dict:
  """Every config's memory at P = 8 and its largest fitting P; with depths, each P's bytes
  are extrapolated in depth, and the configs named in `verify` are compiled at full depth at
  the P found (the check of the extrapolation)."""
  results = {}
  for name in configs:
    fsdp, clipping = CONFIGS[name]
    config = dataclasses.replace(setup, clipping=clipping)
    groups = jax.device_count() // fsdp * fsdp
    if depths:  # Linearity in depth checked at the first P (all depths), then two depths.
      ends = (depths[0], depths[-1])
      measure = lambda p, c=config, f=fsdp, g=groups: depth_extrapolated(
        c, f, depths if p == g else ends, p
      )
    else:
      measure = lambda p, c=config, f=fsdp: compile_memory(c, f, p)

    def log(p, m, name=name, label=''):
      shown = m.get('refused') or f'{m["total"] / GB:.2f} GB ({m["compile_seconds"]:.0f} s)'
      print(f'{name}{label} P={p}: {shown}', flush=True)

    found = largest_batch(measure, groups, limit, log)
    found['measured'] = {str(k): v for k, v in found['measured'].items()}
    p = found['largest_physical_batch']
    if depths and name in verify and p:
      m = compile_memory(config, fsdp, p)
      log(p, m, label=f' ({setup.num_layers} layers)')
      found['verified_full_depth'] = {str(p): m}
    results[name] = {'fsdp': fsdp, 'data': jax.device_count() // fsdp, 'clipping': clipping}
    results[name].update(found, state_bytes=full_state_bytes(config, fsdp))
    save(results)  # After each config: a long plan stopped midway keeps what it measured.
  return results


def table(results: dict) -> str:
  """Rows: config; columns: GB per device at P = 8 (state, arguments, temporaries, total), the
  largest P, its total, and its full-depth compile where one was made."""
  lines = [
    (
      '| layout, clipping | params + Adam + EMA | arguments | temporaries | total (P = 8) '
      '| largest P in 80 GB | total at that P | 26-layer compile at that P |'
    ),
    '|---|---|---|---|---|---|---|---|',
  ]
  gb = lambda b: f'{b / GB:.1f} GB'
  for name, r in results['configs'].items():
    m = r['measured'].get('8', {})
    if 'refused' in m:
      lines.append(f'| {name} | refused: {m["refused"]} | | | | | | |')
      continue
    p = r['largest_physical_batch']
    at_p = r['measured'].get(str(p), {}).get('total')
    full = r.get('verified_full_depth', {}).get(str(p), {}).get('total')
    lines.append(
      f'| data={r["data"]} fsdp={r["fsdp"]}, {r["clipping"]} | {gb(r["state_bytes"]["state"])} '
      f'| {gb(m["arguments"])} | {gb(m["temporaries"])} | {gb(m["total"])} | {p} '
      f'| {gb(at_p) if at_p else "-"} | {gb(full) if full else "-"} |'
    )
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--limit_gb', type=float, default=80.0)
  parser.add_argument('--configs', default=','.join(CONFIGS))
  parser.add_argument('--layers', type=int, default=0, help='compile this depth (0: 26)')
  parser.add_argument('--depths', default='', help='e.g. 2,3,4: extrapolate to 26 layers')
  parser.add_argument('--verify', default='', help='configs to compile at full depth at their P')
  parser.add_argument('--merge', default='', help='a.json,b.json: their configs into --out')
  parser.add_argument('--out', default=str(bench_sharding.RESULTS / 'sharding_plan_1b.json'))
  args = parser.parse_args()
  if args.merge:  # Configs planned by separate processes (the same setup and code) in one file.
    parts = [json.loads(pathlib.Path(f).read_text()) for f in args.merge.split(',')]
    results = dict(parts[0], configs={k: v for p in parts for k, v in p['configs'].items()})
    results['wall_seconds'] = [p['wall_seconds'] for p in parts]
    for r in results['configs'].values():  # Files written before state_bytes was recorded.
      r.setdefault('state_bytes', full_state_bytes(VAULTGEMMA_1B, r['fsdp']))
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + '\n')
    print(table(results))
    return
  setup = VAULTGEMMA_1B
  if args.layers:
    setup = dataclasses.replace(setup, num_layers=args.layers)
  depths = [int(d) for d in args.depths.split(',') if d]
  start = time.perf_counter()
  step = bench_sharding.make_step(setup)
  params = bench_sharding.abstract_state(setup, step)[0]
  results = {
    'provenance': bench_sharding.provenance(),
    'setup': dataclasses.asdict(setup),
    'num_parameters': int(sum(np.prod(p.shape) for p in jax.tree.leaves(params))),
    'limit_bytes': int(args.limit_gb * GB),
    'method': 'extrapolated in depth' if depths else f'compiled at {setup.num_layers} layers',
  }
  print(f'{results["num_parameters"]:,} parameters; {results["method"]}', flush=True)

  def save(configs):
    results.update(configs=configs, wall_seconds=time.perf_counter() - start)
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + '\n')

  configs = args.configs.split(',')
  save(plan(setup, configs, results['limit_bytes'], depths, args.verify.split(','), save))
  print(table(results))


if __name__ == '__main__':
  main()
