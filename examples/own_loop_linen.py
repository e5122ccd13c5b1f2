"""Your own DP-SGD loop with a linen model: an MLP on the digits, shuffling, σ given.

Shows a loss with aux (accuracy, returned per example and summed by the caller) and the
per-row values `clipped_grad` returns (monitoring only: not private).

  python examples/own_loop_linen.py            # 10 epochs
  python examples/own_loop_linen.py --quick    # 1 epoch (the test suite runs this)
"""

import argparse
import secrets

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import dpjax
from dpjax.data import digits


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(128)(x.reshape(x.shape[0], -1)))
    return nn.Dense(10)(x)


def main(quick: bool) -> None:
  x_train, y_train, x_test, y_test = digits.load_digits_arrays()
  x_train, x_test = x_train / 16, x_test / 16
  epochs = 1 if quick else 10
  sampler = dpjax.ShuffleSampler(
    num_examples=len(x_train), batch_size=128, seed=secrets.randbits(63)
  )
  steps = epochs * sampler.steps_per_epoch
  plan = dpjax.PrivacyPlan.create(
    sampler, num_steps=steps, clip_norm=1.0, noise_multiplier=5.0, delta=1e-5
  )
  model = MLP()
  # One program (op by op, each layer's init would compile its own).
  params = jax.jit(model.init)(jax.random.key(0), x_train[:1])['params']

  def loss(p, example):
    logits = model.apply({'params': p}, example['x'][None])[0]
    correct = jnp.argmax(logits) == example['y']
    return optax.softmax_cross_entropy_with_integer_labels(logits, example['y']), correct

  grad_fn = plan.clipped_grad(loss, has_aux=True)  # 'auto': ghost for Dense.
  tx = optax.chain(plan.privatizer(), optax.adam(5e-3))
  opt_state = tx.init(params)
  batcher = plan.batcher(128, opt_state)  # Starts at the privatizer state's step.

  @jax.jit
  def accumulate(grad_sum, correct, params, batch, weights):
    g, per_row = grad_fn(params, batch, weights)  # per_row: loss, aux, norm (not private).
    return grad_sum.add(g), correct + jnp.sum(per_row.aux * weights)  # Compensated (Kahan).

  @jax.jit
  def update(grad_sum, opt_state, params, t):
    updates, opt_state = tx.update(
      grad_sum.total, opt_state, params, step=t
    )  # The noise of step t.
    return optax.apply_updates(params, updates), opt_state

  for batch in batcher:  # Steps t = 0..T-1 across the epochs, each once.
    grad_sum, correct, rows = dpjax.GradSum.zeros(params), 0.0, 0.0
    for idx, weights in batch.physical_batches():
      grad_sum, correct = accumulate(
        grad_sum, correct, params, {'x': x_train[idx], 'y': y_train[idx]}, weights
      )
      rows += weights.sum()
    params, opt_state = update(grad_sum, opt_state, params, batch.step)
    if batch.step % max(steps // 4, 1) == 0:
      print(f'step {batch.step}: nonprivate_train_accuracy {correct / max(rows, 1):.3f}')
  accuracy = np.mean(np.argmax(jax.jit(model.apply)({'params': params}, x_test), -1) == y_test)
  report = plan.epsilon_at(steps)
  print(f'{steps} steps, σ = {plan.noise_multiplier:.3f}, test accuracy {accuracy:.3f}')
  print(
    f'ε = {report.epsilon:.3f} ({report.bound} bound, {report.accountant}), δ = {report.delta:g}'
  )


if __name__ == '__main__':
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='one epoch (for the tests)')
  main(parser.parse_args().quick)
