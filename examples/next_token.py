"""DP next-token prediction: a tiny NNX transformer on a character corpus made here.

Each example is one window of text; its loss is the mean of its tokens' cross-entropies,
so the unit of privacy is the window (to protect a writer with several windows, make one
example per writer). Ghost clipping covers the embedding, attention and MLP layers.

  python examples/next_token.py            # 8 epochs
  python examples/next_token.py --quick    # 1 epoch of a smaller corpus (the test suite)
"""

import argparse
import secrets

import jax
import numpy as np
import optax
from flax import nnx

import dpjax

WORDS = (
  'the cat sat on the mat',
  'a dog ran in the park',
  'we like to eat apples',
  'the sun is bright today',
  'she reads a good book',
  'birds fly over the sea',
)
LENGTH = 24


def make_corpus(num_windows: int, seed: int = 0):
  """Windows of LENGTH + 1 characters of a random text made from WORDS."""
  rng = np.random.default_rng(seed)
  text = '. '.join(WORDS[i] for i in rng.integers(0, len(WORDS), num_windows * 2))
  vocab = sorted(set(text))
  ids = np.array([vocab.index(c) for c in text], np.int32)
  starts = rng.integers(0, len(ids) - LENGTH - 1, num_windows)
  windows = np.stack([ids[s : s + LENGTH + 1] for s in starts])
  return windows[:, :-1], windows[:, 1:], len(vocab)


class TinyTransformer(nnx.Module):
  def __init__(self, vocab: int, width: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (LENGTH, width)))
    self.norm1, self.norm2 = nnx.LayerNorm(width, rngs=rngs), nnx.LayerNorm(width, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(4, width, decode=False, keep_rngs=False, rngs=rngs)
    self.mlp_in, self.mlp_out = (
      nnx.Linear(width, 4 * width, rngs=rngs),
      nnx.Linear(4 * width, width, rngs=rngs),
    )
    self.head = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, tokens):  # [n, LENGTH] -> logits [n, LENGTH, vocab]
    x = self.embed(tokens) + self.position
    causal = nnx.make_causal_mask(tokens)
    x = x + self.attention(self.norm1(x), mask=causal, deterministic=True)
    x = x + self.mlp_out(nnx.gelu(self.mlp_in(self.norm2(x))))
    return self.head(x)


def main(quick: bool) -> None:
  x_train, y_train, vocab = make_corpus(600 if quick else 4000)
  x_test, y_test, _ = make_corpus(200 if quick else 500, seed=1)
  epochs = 1 if quick else 8
  sampler = dpjax.PoissonSampler(
    num_examples=len(x_train), batch_size=100 if quick else 200, seed=secrets.randbits(63)
  )
  steps = epochs * sampler.steps_per_epoch
  plan = dpjax.PrivacyPlan.create(
    sampler, num_steps=steps, clip_norm=1.0, target_epsilon=8.0, delta=1e-5
  )
  model = TinyTransformer(vocab, 32 if quick else 64, nnx.Rngs(0))
  fm = dpjax.NNXFunctional(model)

  def loss(m, example):  # Mean token cross-entropy of ONE window.
    logits = m(example['x'][None])[0]
    return optax.softmax_cross_entropy_with_integer_labels(logits, example['y']).mean()

  grad_fn = plan.clipped_grad(fm.loss(loss), method='ghost')
  tx = optax.chain(plan.privatizer(), optax.adam(3e-3))

  @jax.jit
  def accumulate(grad_sum, params, batch, weights):  # += Σ_i w_i·clip_C(g_i) of P rows.
    return grad_sum.add(grad_fn(params, batch, weights)[0])  # Compensated (Kahan).

  @jax.jit
  def update(grad_sum, opt_state, params, t):  # Logical step t: its noise, ÷ b, optimiser.
    updates, opt_state = tx.update(grad_sum.total, opt_state, params, step=t)
    return optax.apply_updates(params, updates), opt_state

  params = fm.params
  opt_state = tx.init(params)
  for batch in plan.batcher(128, opt_state):  # Steps t = 0..T-1, each once.
    grad_sum = dpjax.GradSum.zeros(params)
    for idx, weights in batch.physical_batches():
      grad_sum = accumulate(grad_sum, params, {'x': x_train[idx], 'y': y_train[idx]}, weights)
    params, opt_state = update(grad_sum, opt_state, params, batch.step)
  fm.update(model, params)

  @jax.jit
  def evaluate(params):  # One program: op by op, each op would compile its own.
    logits = fm.apply(params, x_test)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y_test).mean(), logits

  test_loss, logits = evaluate(params)
  test_loss = float(test_loss)
  accuracy = float(np.mean(np.argmax(np.asarray(logits), -1) == y_test))
  report = plan.epsilon_at(steps)
  print(
    f'{steps} steps: test loss {test_loss:.3f} nats/char (uniform: {np.log(vocab):.3f}), '
    f'next-character accuracy {accuracy:.3f}'
  )
  print(
    f'ε = {report.epsilon:.3f} ({report.bound} bound, {report.accountant}), δ = {report.delta:g}'
  )


if __name__ == '__main__':
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='one epoch (for the tests)')
  main(parser.parse_args().quick)
