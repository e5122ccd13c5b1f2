"""Per-device memory and step time of the DP step with parameters sharded over 'fsdp'.

Question (issue 37, item 5): on 8 devices, how many bytes of parameters + Adam state + EMA
does each device hold for fsdp ∈ {1, 2, 4, 8} (data = 8 / fsdp), by
`param_sharding.bytes_per_device` and by XLA's memory analysis of the compiled step, against
1/fsdp of the replicated (data-parallel) layout (target: within 10 %)? Does a transformer
whose replicated step exceeds a per-device budget train sharded within it? And what does a
step cost on each layout against data parallelism on the same devices?

The model is dpjax's causal transformer LM, trained by one compiled program per layout:
`DPStep.logical_step` (ghost clipping, Gaussian noise, Adam) followed by the EMA update
(`dpjax.privacy.ema`), jitted with the state's `param_sharding.state_shardings` as in- and
out-shardings (state donated) and the logical buffer split over 'data' × 'fsdp'. The budget
is a fraction (default 0.5) of the replicated layout's compiled per-device total (arguments +
outputs + temporaries − donated). Every layout runs the same steps from the same seed, interleaved (one step of each layout per round), so
step-time ratios are measured under the same load and the losses can be compared.

Runs on 8 forced CPU devices (XLA_FLAGS is set here when not given). Usage:
  python scripts/bench_sharding.py [--steps 8] [--budget_fraction 0.5]
Writes scripts/results/sharding_bench.json and prints a table.
"""

from __future__ import annotations

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import argparse
import dataclasses
import json
import pathlib
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax.models import transformer
from dpjax.privacy import dp_step
from dpjax.privacy import ema as ema_lib
from dpjax.privacy import param_sharding
from dpjax.privacy import prng
from dpjax.privacy import sharding

RESULTS = pathlib.Path(__file__).resolve().parent / 'results'
TARGET = 1.10  # Per-device state within 10 % of replicated / fsdp.
EMA_DECAY = 0.999
RULES = param_sharding.ShardingRules()  # FSDP only; arrays >= MIN_SHARDED_SIZE elements split.


@dataclasses.dataclass(frozen=True)
class Setup:
  """The model and step of a measurement (a causal transformer LM over `vocab` tokens)."""

  num_layers: int = 4
  model_dim: int = 192
  num_heads: int = 4
  mlp_dim: int = 768
  vocab: int = 512
  length: int = 64  # Tokens per example.
  physical_batch: int = 32  # P, rows of one physical batch over all devices.
  num_batches: int = 1  # K_max physical batches per logical step.
  clipping: str = 'ghost'
  noise_multiplier: float = 0.5
  clip_norm: float = 1.0
  learning_rate: float = 1e-3

  def model(self) -> transformer.Transformer:
    return transformer.Transformer(
      self.vocab,
      self.length,
      self.vocab,
      self.num_layers,
      self.num_heads,
      self.model_dim,
      self.mlp_dim,
      causal=True,
    )


def make_step(setup: Setup, mesh=None) -> dp_step.DPStep:
  """The DP step (Adam) of the setup's model; expected batch size b = K_max · P. With a mesh,
  the step holds its accumulator and release in `RULES`' layout (`DPStep.placed`)."""
  return dp_step.DPStep.for_model(
    setup.model(),
    optax.adam(setup.learning_rate),
    clip_norm=setup.clip_norm,
    noise_multiplier=setup.noise_multiplier,
    expected_batch_size=setup.num_batches * setup.physical_batch,
    clipping=setup.clipping,
    loss='sequence_cross_entropy',
    mesh=mesh,
    rules=RULES,
  )


def abstract_state(setup: Setup, step: dp_step.DPStep):
  """(params, opt_state, ema) as ShapeDtypeStructs: `jax.eval_shape`, no weight allocated."""
  params = jax.eval_shape(lambda: prng.init_params(setup.model(), 0, (setup.length,)))
  return params, jax.eval_shape(step.init_opt_state, params), jax.eval_shape(ema_lib.init, params)


def abstract_buffer(setup: Setup, physical_batch: int | None = None) -> dict:
  """The logical buffer {'x', 'y': int32 [K_max, P, L], 'weight': [K_max, P]} as shapes."""
  p = physical_batch or setup.physical_batch
  rows = (setup.num_batches, p)
  tokens = jax.ShapeDtypeStruct((*rows, setup.length), jnp.int32)
  return {'x': tokens, 'y': tokens, 'weight': jax.ShapeDtypeStruct(rows, jnp.float32)}


def state_shardings(state, mesh, rules=RULES):
  """The NamedShardings of (params, opt_state, ema): every leaf by the parameter's rule."""
  params = state[0]
  return tuple(param_sharding.state_shardings(tree, params, mesh, rules) for tree in state)


def compile_step(step: dp_step.DPStep, state, buffer, mesh, rules=RULES):
  """The compiled program (params, opt, ema, buffer, K, t, keys) -> (params, opt, ema,
  metrics): one logical DP step and the EMA update, state in and out with `state_shardings`
  (donated), the buffer's rows split over 'data' × 'fsdp'. Nothing runs."""
  shardings = state_shardings(state, mesh, rules)
  rep = sharding.replicated(mesh)

  def program(params, opt_state, ema, logical, k, t, keys):
    params, opt_state, metrics = step.logical_step(params, opt_state, logical, k, t, None, keys)
    return params, opt_state, ema_lib.update(ema, params, EMA_DECAY), metrics

  jitted = jax.jit(
    program,
    in_shardings=(*shardings, sharding.logical_batch_sharding(mesh), rep, rep, rep),
    out_shardings=(*shardings, rep),
    donate_argnums=(0, 1, 2),
  )
  scalars = (jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.uint32))
  return jitted.lower(*state, buffer, *scalars, step.keys).compile()


def memory(compiled) -> dict:
  """XLA's per-device memory analysis (bytes): arguments, outputs, temporaries, aliased
  (donated) and total = arguments + outputs + temporaries − aliased (`step_sizing`'s sum)."""
  m = compiled.memory_analysis()
  out = {
    'arguments': int(m.argument_size_in_bytes),
    'outputs': int(m.output_size_in_bytes),
    'temporaries': int(m.temp_size_in_bytes),
    'aliased': int(m.alias_size_in_bytes),
  }
  out['total'] = out['arguments'] + out['outputs'] + out['temporaries'] - out['aliased']
  return out


def state_bytes(state, shardings) -> dict:
  """Per-device bytes of params, optimiser state, EMA and their sum (`bytes_per_device`)."""
  names = ('params', 'opt_state', 'ema')
  out = {n: param_sharding.bytes_per_device(t, s) for n, t, s in zip(names, state, shardings)}
  out['state'] = param_sharding.bytes_per_device(state, shardings)
  return out


def replicated_leaves(state, shardings) -> tuple[int, list[dict]]:
  """Bytes of the state kept whole on every device, and the parameters kept whole (path,
  shape, bytes of the parameter alone; its Adam μ, ν and EMA follow it), largest first."""
  total = 0
  for leaf, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True):
    if not param_sharding.is_sharded(s.spec):
      total += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
  whole = []
  params = jax.tree_util.tree_flatten_with_path(state[0])[0]
  for (path, leaf), s in zip(params, jax.tree.leaves(shardings[0]), strict=True):
    if not param_sharding.is_sharded(s.spec):
      size = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
      name = '/'.join(param_sharding.path_names(path))
      whole.append({'param': name, 'shape': list(leaf.shape), 'bytes': size})
  return total, sorted(whole, key=lambda e: -e['bytes'])


def data_buffers(setup: Setup, steps: int, seed: int = 0) -> list[dict]:
  """One logical buffer per step: sequences of tokens drawn from a 16-token subset of the
  vocabulary (learnable at once: the loss falls from ln V toward ln 16), y = x shifted."""
  rng = np.random.default_rng(seed)
  alphabet = rng.choice(setup.vocab, size=min(16, setup.vocab), replace=False)
  rows = (setup.num_batches, setup.physical_batch)
  out = []
  for _ in range(steps):
    seq = alphabet[rng.integers(0, len(alphabet), (*rows, setup.length + 1))].astype(np.int32)
    out.append({'x': seq[..., :-1], 'y': seq[..., 1:], 'weight': np.ones(rows, np.float32)})
  return out


@dataclasses.dataclass
class Layout:
  """One mesh's compiled step and its live state."""

  fsdp: int
  mesh: jax.sharding.Mesh
  step: dp_step.DPStep
  compiled: object
  shardings: tuple
  shapes: tuple  # (params, opt_state, ema) as ShapeDtypeStructs.
  state: tuple = ()
  times: list = dataclasses.field(default_factory=list)
  losses: list = dataclasses.field(default_factory=list)


def build_layouts(setup: Setup, fsdps, num_devices: int = 0) -> list[Layout]:
  """A step on each mesh (data = devices / fsdp), compiled from abstract shapes."""
  layouts = []
  for fsdp in fsdps:
    mesh = sharding.make_mesh(num_devices, fsdp=fsdp)
    step = make_step(setup, mesh)
    state = abstract_state(setup, step)
    compiled = compile_step(step, state, abstract_buffer(setup), mesh)
    layouts.append(Layout(fsdp, mesh, step, compiled, state_shardings(state, mesh), state))
  return layouts


def train_interleaved(setup: Setup, layouts: list[Layout], steps: int) -> None:
  """Every layout runs logical steps t = 0..steps−1 from the same initial state and data,
  one step of each layout per round (timed to the outputs' readiness)."""
  params = prng.init_params(setup.model(), 0, (setup.length,))
  step = layouts[0].step  # Same σ, C, b and seed on every layout: the same noise key.
  host = jax.device_get((params, step.init_opt_state(params), ema_lib.init(params)))
  for layout in layouts:
    layout.state = param_sharding.place(host, layout.shardings)
  for t, buffer in enumerate(data_buffers(setup, steps)):
    for layout in layouts:
      start = time.perf_counter()
      *state, metrics = layout.compiled(
        *layout.state, buffer, np.int32(setup.num_batches), np.uint32(t), step.keys
      )
      layout.state = tuple(jax.block_until_ready(state))
      layout.times.append(time.perf_counter() - start)
      layout.losses.append(float(metrics['loss']))


def max_relative_difference(a, b) -> float:
  """max |a − b| / max |b| over the parameters."""
  a, b = jax.device_get((a, b))
  num = max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  return num / max(float(np.max(np.abs(y))) for y in jax.tree.leaves(b))


def measure(setup: Setup, fsdps, steps: int, budget_fraction: float, num_devices=0) -> dict:
  """Every number of the benchmark, as a dict (the JSON's 'layouts' and 'budget')."""
  layouts = build_layouts(setup, fsdps, num_devices)
  state = layouts[0].shapes
  train_interleaved(setup, layouts, steps)
  base = layouts[0]
  rows = []
  for layout in layouts:
    per_device = state_bytes(state, layout.shardings)
    whole, replicated = replicated_leaves(state, layout.shardings)
    rows.append(
      {
        'mesh': sharding.layout_name(layout.mesh),
        'bytes_per_device': per_device,
        'xla': memory(layout.compiled),
        'replicated_state_bytes': whole,
        'replicated_params': replicated[:6],
        'num_replicated_params': len(replicated),
        'losses': layout.losses,
        'step_seconds': layout.times,
        'median_step_seconds': float(np.median(layout.times[1:] or layout.times)),
        'params_vs_first_layout': max_relative_difference(layout.state[0], base.state[0]),
      }
    )
  return {'layouts': rows, 'budget': judge(rows, budget_fraction)}


def judge(rows: list[dict], budget_fraction: float) -> dict:
  """Ratios to the first (replicated) layout and the budget test, added to rows in place."""
  base = rows[0]
  budget = int(budget_fraction * base['xla']['total'])
  for row in rows:
    f = row['mesh']['fsdp']
    for key, ref in (('state', base['bytes_per_device']['state']), ('xla_arguments', None)):
      mine = row['bytes_per_device']['state'] if ref is not None else row['xla']['arguments']
      ref = ref if ref is not None else base['xla']['arguments']
      row[f'{key}_ratio_to_ideal'] = mine / (ref / f)
    row['meets_target'] = row['state_ratio_to_ideal'] <= TARGET
    # What the arrays kept whole add over the ideal: whole · (1 − 1/f) / (replicated / f).
    ideal = base['bytes_per_device']['state'] / f
    row['excess_from_replicated_arrays'] = row['replicated_state_bytes'] * (1 - 1 / f) / ideal
    row['speed_vs_data_parallel'] = base['median_step_seconds'] / row['median_step_seconds']
    row['fits_budget'] = row['xla']['total'] <= budget
    losses = row['losses']
    row['trains'] = bool(np.all(np.isfinite(losses)) and losses[-1] < losses[0])
  return {
    'fraction_of_replicated_total': budget_fraction,
    'bytes': budget,
    'replicated_exceeds': not base['fits_budget'],
    'fitting_layouts_that_train': [r['mesh'] for r in rows if r['fits_budget'] and r['trains']],
  }


def table(results: dict) -> str:
  """The printed table (MB = 1e6 bytes)."""
  lines = [
    (
      '| mesh (data×fsdp) | state B/dev (MB) | ratio to 1/fsdp | XLA args / temps / total (MB) '
      '| fits budget | step s (median) | speed vs DP | loss first→last |'
    ),
    '|---|---|---|---|---|---|---|---|',
  ]
  for r in results['layouts']:
    x, mb = r['xla'], lambda b: f'{b / 1e6:.1f}'
    lines.append(
      f'| {r["mesh"]["data"]}×{r["mesh"]["fsdp"]} | {mb(r["bytes_per_device"]["state"])} '
      f'| {r["state_ratio_to_ideal"]:.3f} {"ok" if r["meets_target"] else "MISSED"} '
      f'| {mb(x["arguments"])} / {mb(x["temporaries"])} / {mb(x["total"])} '
      f'| {"yes" if r["fits_budget"] else "no"} | {r["median_step_seconds"]:.3f} '
      f'| {r["speed_vs_data_parallel"]:.2f} | {r["losses"][0]:.3f}→{r["losses"][-1]:.3f} |'
    )
  lines.append(f'budget: {results["budget"]["bytes"] / 1e6:.1f} MB per device')
  return '\n'.join(lines)


def provenance() -> dict:
  """Machine, versions, commit and load."""
  try:
    commit = subprocess.run(
      ['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, check=True
    ).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    commit = None
  return {
    'machine': platform.platform(),
    'cpu_count': os.cpu_count(),
    'devices': f'{jax.device_count()} x {jax.devices()[0].device_kind}',
    'jax': jax.__version__,
    'commit': commit,
    'load_average': os.getloadavg(),
  }


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--steps', type=int, default=8)
  parser.add_argument('--budget_fraction', type=float, default=0.5)
  parser.add_argument('--out', default=str(RESULTS / 'sharding_bench.json'))
  args = parser.parse_args()
  setup = Setup()
  fsdps = [f for f in (1, 2, 4, 8) if jax.device_count() % f == 0]
  start = time.perf_counter()
  results = {'provenance': provenance(), 'setup': dataclasses.asdict(setup)}
  results.update(measure(setup, fsdps, args.steps, args.budget_fraction))
  results['wall_seconds'] = time.perf_counter() - start
  results['provenance']['load_average_end'] = os.getloadavg()
  pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + '\n')
  n = sum(
    int(np.prod(p.shape)) for p in jax.tree.leaves(abstract_state(setup, make_step(setup))[0])
  )
  print(f'{n:,} parameters; {results["provenance"]["devices"]}; jax {jax.__version__}')
  print(table(results))


if __name__ == '__main__':
  main()
