"""The library's private step beside a bare non-private JAX step, in one run.

Question: how close is a DP-SGD step written with dpjax's library API (`clipped_grad` +
`gaussian_privatizer` + adam, one jitted function) to the non-private step (jax.grad of
the batch's mean loss + adam) on the same model and batch?

For the MLP (digits-sized: 64 -> 256 -> 128 -> 10) and the small CNN (8x8x1, two 3x3
convs), linen and NNX, vmap and ghost clipping, and for the MLP with ghost clipping each
noise generator (threefry, rbg, unsafe_rbg), both steps are timed in paired rounds (the
private and the non-private step back to back, `--iters` calls each); the ratio is
non-private time / private time (1 = free privacy), the median over `--rounds` rounds.

  python scripts/bench_library.py                 # ~2 min on 2 CPU cores
  python scripts/bench_library.py --rounds 3 --iters 5 --out /tmp/x.json

Writes scripts/results/bench_library.json (bench_library_gpu.json on a GPU).
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import dpjax
from dpjax.models import cnn
from dpjax.models import mlp

SHAPE, CLASSES, BATCH = (8, 8, 1), 10, 256
MODELS = {
  'mlp': (
    lambda: mlp.MLP(CLASSES, (256, 128)),
    lambda rngs: mlp.NNXMLP(SHAPE, CLASSES, (256, 128), rngs=rngs),
  ),
  'cnn': (
    lambda: cnn.CNN(CLASSES, (16, 32), (3, 3), (1, 1), ('SAME', 'SAME'), 32),
    lambda rngs: cnn.NNXCNN(
      SHAPE, CLASSES, (16, 32), (3, 3), (1, 1), ('SAME', 'SAME'), 32, rngs=rngs
    ),
  ),
}


def _forward(model_name: str, framework: str):
  """(params, batched forward `(params, x) -> logits`)."""
  linen, make_nnx = MODELS[model_name]
  if framework == 'linen':
    model = linen()
    params = model.init(jax.random.key(0), jnp.zeros((1, *SHAPE)))['params']
    return params, lambda p, x: model.apply({'params': p}, x)
  fm = dpjax.NNXFunctional(make_nnx(nnx.Rngs(0)))
  return fm.params, fm.apply


def make_steps(model_name: str, framework: str, method: str, noise_impl: str):
  """(params, private step, non-private step), each `(params, opt_state, batch) -> ...`."""
  params, forward = _forward(model_name, framework)

  def example_loss(p, example):
    logits = forward(p, example['x'][None])[0]
    return optax.softmax_cross_entropy_with_integer_labels(logits, example['y'])

  grad_fn = dpjax.clipped_grad(example_loss, 1.0, method=method)
  private_tx = optax.chain(
    dpjax.gaussian_privatizer(1.0, 1.0, BATCH, seed=1234, noise_impl=noise_impl), optax.adam(1e-3)
  )
  plain_tx = optax.adam(1e-3)

  @jax.jit
  def private(p, state, batch):
    g, _ = grad_fn(p, batch, batch['weight'])
    # Timing only: the step the state expects (a loop passes its batch's `step`).
    updates, state = private_tx.update(g, state, p, step=state[0].step)
    return optax.apply_updates(p, updates), state

  @jax.jit
  def plain(p, state, batch):
    def mean_loss(q):
      logits = forward(q, batch['x'])
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch['y']))

    g = jax.grad(mean_loss)(p)
    updates, state = plain_tx.update(g, state, p)
    return optax.apply_updates(p, updates), state

  return params, (private, private_tx.init(params)), (plain, plain_tx.init(params)), grad_fn


def _time(step, params, state, batch, iters: int) -> float:
  start = time.perf_counter()
  for _ in range(iters):
    params, state = step(params, state, batch)
  jax.block_until_ready(params)
  return (time.perf_counter() - start) / iters


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=7)
  parser.add_argument('--iters', type=int, default=20)
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  batch = {
    'x': jnp.asarray(rng.normal(size=(BATCH, *SHAPE)), jnp.float32),
    'y': jnp.asarray(rng.integers(0, CLASSES, BATCH), jnp.int32),
    'weight': jnp.ones((BATCH,), jnp.float32),
  }
  cases = [
    (m, f, c, 'threefry') for m in MODELS for f in ('linen', 'nnx') for c in ('vmap', 'ghost')
  ]
  cases += [('mlp', f, 'ghost', impl) for f in ('linen', 'nnx') for impl in ('rbg', 'unsafe_rbg')]
  built = {}
  for case in cases:
    params, (private, p_state), (plain, n_state), grad_fn = make_steps(*case)
    _time(private, params, p_state, batch, 1)  # Compile.
    _time(plain, params, n_state, batch, 1)
    built[case] = (params, private, p_state, plain, n_state, list(grad_fn.choice))
  ratios = {case: [] for case in cases}
  times = {case: ([], []) for case in cases}
  for _ in range(args.rounds):
    for case, (params, private, p_state, plain, n_state, _) in built.items():
      t_private = _time(private, params, p_state, batch, args.iters)
      t_plain = _time(plain, params, n_state, batch, args.iters)
      ratios[case].append(t_plain / t_private)
      times[case][0].append(t_private)
      times[case][1].append(t_plain)
  rows = []
  for case in cases:
    model_name, framework, method, impl = case
    rows.append(
      {
        'model': model_name,
        'framework': framework,
        'clipping': method,
        'noise_impl': impl,
        'ratio_median': statistics.median(ratios[case]),
        'ratio_min': min(ratios[case]),
        'ratio_max': max(ratios[case]),
        'private_ms': 1e3 * statistics.median(times[case][0]),
        'nonprivate_ms': 1e3 * statistics.median(times[case][1]),
        'choice': built[case][5][:1],
      }
    )
    print(
      f'{model_name:4s} {framework:6s} {method:6s} {impl:10s} private/non-private speed '
      f'{rows[-1]["ratio_median"]:.2f} ({rows[-1]["private_ms"]:.2f} ms vs '
      f'{rows[-1]["nonprivate_ms"]:.2f} ms)'
    )
  backend = jax.default_backend()
  result = {
    'question': 'non-private step time / private step time (library API, b = 256)',
    'rounds': args.rounds,
    'iters': args.iters,
    'rows': rows,
    'jax': jax.__version__,
    'backend': backend,
    'device': jax.devices()[0].device_kind,
    'cpu_count': os.cpu_count(),
    'machine': platform.machine(),
  }
  name = 'bench_library_gpu.json' if backend == 'gpu' else 'bench_library.json'
  out = args.out or str(pathlib.Path(__file__).parent / 'results' / name)
  with open(out, 'w') as f:
    json.dump(result, f, indent=1)
  print('wrote', out)


if __name__ == '__main__':
  main()
