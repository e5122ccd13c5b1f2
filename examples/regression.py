"""DP regression: a linen model trained with the mean squared error, any loss works the same way.

Synthetic data y = x·w* + noise; the test MSE is compared with the non-private least
squares fit.

  python examples/regression.py            # 10 epochs
  python examples/regression.py --quick    # 1 epoch of 5,000 examples (the test suite)
"""

import argparse
import secrets

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import dpjax


W_STAR = np.random.default_rng(0).normal(size=16).astype(np.float32)


def make_data(n: int, seed: int):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, len(W_STAR))).astype(np.float32)
  return x, x @ W_STAR + 0.1 * rng.normal(size=n).astype(np.float32)


def main(quick: bool) -> None:
  x_train, y_train = make_data(5_000 if quick else 20_000, seed=1)
  x_test, y_test = make_data(2_000, seed=2)
  epochs = 1 if quick else 10
  sampler = dpjax.PoissonSampler(
    num_examples=len(x_train), batch_size=250 if quick else 500, seed=secrets.randbits(63)
  )
  steps = epochs * sampler.steps_per_epoch
  plan = dpjax.PrivacyPlan.create(
    sampler, num_steps=steps, clip_norm=1.0, target_epsilon=1.0, delta=1e-6
  )
  model = nn.Dense(1)
  # One program (op by op, each layer's init would compile its own).
  params = jax.jit(model.init)(jax.random.key(0), x_train[:1])['params']

  def loss(p, example):  # Squared error of ONE example.
    prediction = model.apply({'params': p}, example['x'])[0]
    return jnp.square(prediction - example['y'])

  grad_fn = plan.clipped_grad(loss)
  tx = optax.chain(plan.privatizer(), optax.adam(0.05))

  @jax.jit
  def accumulate(grad_sum, params, batch, weights):  # += Σ_i w_i·clip_C(g_i) of P rows.
    return grad_sum.add(grad_fn(params, batch, weights)[0])  # Compensated (Kahan).

  @jax.jit
  def update(grad_sum, opt_state, params, t):  # Logical step t: its noise, ÷ b, optimiser.
    updates, opt_state = tx.update(grad_sum.total, opt_state, params, step=t)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  for batch in plan.batcher(256, opt_state):  # Steps t = 0..T-1, each once.
    grad_sum = dpjax.GradSum.zeros(params)
    for idx, weights in batch.physical_batches():
      grad_sum = accumulate(grad_sum, params, {'x': x_train[idx], 'y': y_train[idx]}, weights)
    params, opt_state = update(grad_sum, opt_state, params, batch.step)
  mse = float(np.mean((jax.jit(model.apply)({'params': params}, x_test)[:, 0] - y_test) ** 2))
  w, *_ = np.linalg.lstsq(np.c_[x_train, np.ones(len(x_train))], y_train, rcond=None)
  baseline = float(np.mean((np.c_[x_test, np.ones(len(x_test))] @ w - y_test) ** 2))
  report = plan.epsilon_at(steps)
  print(
    f'{steps} steps: test MSE {mse:.4f} (non-private least squares {baseline:.4f}, '
    f'predicting 0: {np.mean(y_test**2):.2f})'
  )
  print(
    f'ε = {report.epsilon:.3f} ({report.bound} bound, {report.accountant}), δ = {report.delta:g}'
  )


if __name__ == '__main__':
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='one epoch (for the tests)')
  main(parser.parse_args().quick)
