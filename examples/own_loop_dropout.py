"""Dropout in your own DP-SGD loop: an NNX MLP on the digits, each example with its own key.

  python examples/own_loop_dropout.py            # 10 epochs, ~1 min on 2 CPU cores
  python examples/own_loop_dropout.py --quick    # half an epoch

DP-SGD differentiates one example's loss at a time, so an NNX Dropout cannot draw from an
RNG stored in the model (Flax's TraceContextError; dpjax says what to do). Instead each
example's key travels in the batch, like its features: the mask of an example depends on its
key alone, and the same keys give the same masks. The keys are public randomness: ε does not
depend on them (each example's clipped gradient is bounded whatever its mask). The model,
loss and keys are tested in tests/privacy/test_stateful_layers.py; the loop is
examples/own_loop_nnx.py's.
"""

import secrets
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import dpjax
from dpjax.data import digits


class MLP(nnx.Module):
  """Dropout built without rngs: each call is given its example's key (none: evaluation)."""

  def __init__(self, rngs: nnx.Rngs, rate: float = 0.2):
    self.hidden = nnx.Linear(64, 256, rngs=rngs)
    self.drop = nnx.Dropout(rate)
    self.head = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x, dropout_key=None):
    h = nnx.tanh(self.hidden(x.reshape(x.shape[0], -1)))
    h = self.drop(h, rngs=dropout_key, deterministic=dropout_key is None)
    return self.head(h)


def loss(m, example):  # ONE example's loss, with its own dropout key.
  logits = m(example['x'][None], example['dropout_key'])[0]
  return optax.softmax_cross_entropy_with_integer_labels(logits, example['y'])


def dropout_keys(root, step, idx):  # One key per (step, example): rows differ, reruns agree.
  return jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(root, step), i))(idx)


def main(quick: bool) -> None:
  x_train, y_train, x_test, y_test = digits.load_digits_arrays()
  x_train, x_test = x_train / 16, x_test / 16
  steps = len(x_train) // 256 if quick else 10 * len(x_train) // 128  # 1/2 or 10 epochs.
  sampler = dpjax.PoissonSampler(
    num_examples=len(x_train), batch_size=128, seed=secrets.randbits(63)
  )  # Secret: never log it.
  plan = dpjax.PrivacyPlan.create(
    sampler, num_steps=steps, clip_norm=1.0, target_epsilon=3.0, delta=1e-5
  )
  model = MLP(nnx.Rngs(0))
  fm = dpjax.NNXFunctional(model)
  grad_fn = plan.clipped_grad(fm.loss(loss), method='ghost')
  tx = optax.chain(plan.privatizer(), optax.adam(2e-3))

  @jax.jit
  def accumulate(grad_sum, params, batch, weights):
    return grad_sum.add(grad_fn(params, batch, weights)[0])  # Compensated (Kahan).

  @jax.jit
  def update(grad_sum, opt_state, params, t):  # Logical step t: its noise, ÷ b, optimiser.
    updates, opt_state = tx.update(grad_sum.total, opt_state, params, step=t)
    return optax.apply_updates(params, updates), opt_state

  # --- dropout: each example's key in the batch. ---
  root = jax.random.PRNGKey(0)  # Dropout's randomness is public: ε does not depend on it.
  params = fm.params
  opt_state = tx.init(params)
  for logical in plan.batcher(64, opt_state):  # Steps t = 0..T-1, each once: one counter.
    t = logical.step
    grad_sum = dpjax.GradSum.zeros(params)
    for idx, weights in logical.physical_batches():
      batch = {'x': x_train[idx], 'y': y_train[idx], 'dropout_key': dropout_keys(root, t, idx)}
      grad_sum = accumulate(grad_sum, params, batch, weights)
    params, opt_state = update(grad_sum, opt_state, params, t)
  # --- end of dropout. ---

  logits = jax.jit(fm.apply)(params, x_test)  # No key: evaluation without dropout.
  report = plan.epsilon_at(steps)
  print(
    f'{steps} steps with dropout: test accuracy {np.mean(np.argmax(logits, -1) == y_test):.3f}'
    f' at ε = {report.epsilon:.3f} ({report.bound} bound), δ = {report.delta:g}'
  )


if __name__ == '__main__':
  main(quick='--quick' in sys.argv[1:])
