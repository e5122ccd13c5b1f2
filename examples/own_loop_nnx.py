"""Your own DP-SGD loop: an NNX CNN on the digits, Poisson sampling, ghost clipping, σ calibrated.

python examples/own_loop_nnx.py            # 15 epochs, ~1 min on 2 CPU cores
python examples/own_loop_nnx.py --quick    # half an epoch (the test suite runs this)
"""

import argparse
import secrets

import jax
import numpy as np
import optax
from flax import nnx

import dpjax
from dpjax.data import digits


class CNN(nnx.Module):
  """Per-example (no BatchNorm) and deterministic (no dropout), as DP-SGD needs."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(16, 32, (3, 3), strides=2, rngs=rngs)
    self.head = nnx.Linear(32 * 4 * 4, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.tanh(self.conv2(nnx.tanh(self.conv1(x))))
    return self.head(x.reshape(x.shape[0], -1))


def main(quick: bool) -> None:
  x_train, y_train, x_test, y_test = digits.load_digits_arrays()
  x_train, x_test = x_train / 16, x_test / 16
  steps = len(x_train) // 256 if quick else 15 * len(x_train) // 128  # 1/2 or 15 epochs.

  # --- dpjax: everything that enters ε comes from one plan. ---
  sampler = dpjax.PoissonSampler(
    num_examples=len(x_train), batch_size=128, seed=secrets.randbits(63)
  )  # Secret: never log it.
  plan = dpjax.PrivacyPlan.create(
    sampler, num_steps=steps, clip_norm=1.0, target_epsilon=3.0, delta=1e-5
  )
  model = CNN(nnx.Rngs(0))
  fm = dpjax.NNXFunctional(model)  # The NNX model as a function of a parameter dict.

  def loss(m, example):  # ONE example's loss.
    logits = m(example['x'][None])[0]
    return optax.softmax_cross_entropy_with_integer_labels(logits, example['y'])

  grad_fn = plan.clipped_grad(fm.loss(loss), method='ghost')
  tx = optax.chain(plan.privatizer(), optax.adam(2e-3))  # Noise once per step, ÷ b.

  @jax.jit
  def accumulate(grad_sum, params, batch, weights):  # += Σ_i w_i·clip_C(g_i) of P rows.
    return grad_sum.add(grad_fn(params, batch, weights)[0])  # Compensated (Kahan).

  @jax.jit
  def update(grad_sum, opt_state, params, t):  # Logical step t: its noise, ÷ b, optimiser.
    updates, opt_state = tx.update(grad_sum.total, opt_state, params, step=t)
    return optax.apply_updates(params, updates), opt_state

  params = fm.params
  opt_state = tx.init(params)
  for batch in plan.batcher(64, opt_state):  # Steps t = 0..T-1, each once: one counter.
    grad_sum = dpjax.GradSum.zeros(params)
    for idx, weights in batch.physical_batches():  # P = 64 rows, padding weighted 0.
      grad_sum = accumulate(grad_sum, params, {'x': x_train[idx], 'y': y_train[idx]}, weights)
    params, opt_state = update(grad_sum, opt_state, params, batch.step)
  # --- end of dpjax. ---

  fm.update(model, params)
  accuracy = np.mean(np.argmax(jax.jit(fm.apply)(params, x_test), -1) == y_test)
  report = plan.epsilon_at(steps)
  print(f'{steps} steps, σ = {plan.noise_multiplier:.3f}, test accuracy {accuracy:.3f}')
  print(
    f'ε = {report.epsilon:.3f} ({report.bound} bound, {report.accountant}), δ = {report.delta:g}'
  )


if __name__ == '__main__':
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='one epoch (for the tests)')
  main(parser.parse_args().quick)
