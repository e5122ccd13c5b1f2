"""Time one DPStep.accumulate call (private) against the non-private path.

Median of repeats, per physical batch and per example, for the MLP 784-128-10
(or the CNN) on random MNIST-shaped inputs, with `--clipping` auto (the
default: ghost clipping where it covers the model), vmap or ghost. The full
comparison with memory and several models is scripts/bench_clipping.py.
Usage:
  python scripts/bench_dp_step.py [--model mlp|cnn] [--sizes 256,64,32]
      [--clipping auto|vmap|ghost]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from dpjax.privacy import dp_step
from dpjax.models import factory as models
from dpjax.privacy import prng


def _median_ms(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--model', default='mlp', choices=('mlp', 'cnn'))
  parser.add_argument('--sizes', default='256,64,32')
  parser.add_argument('--repeats', type=int, default=15)
  parser.add_argument('--clipping', default='auto', choices=('auto', 'vmap', 'ghost'))
  args = parser.parse_args()
  if args.model == 'mlp':
    cfg = ml_collections.ConfigDict({'name': 'mlp', 'hidden_sizes': (128,)})
  else:
    cfg = models.default_model_config('cnn')
  model = models.make_model(cfg, 10, (28, 28, 1))
  params = prng.init_params(model, 0, (28, 28, 1))
  num_params = sum(p.size for p in jax.tree.leaves(params))
  print(
    f'{args.model}: {num_params} parameters, jax {jax.__version__}, {jax.devices()[0].device_kind}'
  )
  rng = np.random.default_rng(0)
  for p in (int(s) for s in args.sizes.split(',')):
    batch = jax.device_put(
      {
        'x': rng.normal(size=(p, 28, 28, 1)).astype(np.float32),
        'y': rng.integers(0, 10, p).astype(np.int32),
        'weight': np.ones(p, np.float32),
      }
    )
    for private in (True, False):
      step = dp_step.DPStep.for_model(
        model,
        optax.sgd(0.1),
        clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=p,
        private=private,
        clipping=args.clipping,
      )
      acc = step.accumulate(params, step.init_accumulator(params), batch)
      acc = jax.block_until_ready(acc)

      def one_call():
        nonlocal acc
        acc = step.accumulate(params, acc, batch)
        return acc

      ms = _median_ms(one_call, args.repeats)
      label = f'private ({args.clipping})' if private else 'non-private'
      print(
        f'P={p:4d} {label:16s}: '
        f'{ms:8.2f} ms per accumulate call, {1e3 * ms / p:8.1f} us per '
        f'example; compilations: {step.compile_count("accumulate")}'
      )


if __name__ == '__main__':
  main()
