"""Per-example losses for the DP step (classification, regression, sequences), and the eval sums.

Models are per-example (no BatchNorm, no dropout: `dpjax.models.factory`), so the
batched forward pass of `eval_step` equals the per-example one.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from dpjax.privacy import clipping as clipping_lib
from dpjax.privacy import precision as precision_lib

Params = clipping_lib.Params
Batch = dict[str, jax.Array]

LABEL_FORMATS = ('int', 'one_hot')
LOSSES = ('softmax_cross_entropy', 'mse', 'sequence_cross_entropy')
HAS_ACCURACY = {'softmax_cross_entropy': True, 'mse': False, 'sequence_cross_entropy': True}


def _cross_entropy(label_format: str):
  return (
    optax.softmax_cross_entropy_with_integer_labels
    if label_format == 'int'
    else optax.softmax_cross_entropy
  )


def output_loss(loss: str, label_format: str = 'int'):
  """`(output_i, y_i) -> (loss_i, correct_i)` of one example's model output.

  softmax_cross_entropy: logits [classes], y an int label or a one-hot vector;
    correct = [argmax = label].
  mse: output [d] (or a scalar) and y alike (floats); loss = mean_j (out_j - y_j)²;
    correct = 0 (no accuracy).
  sequence_cross_entropy: logits [T, vocab], y int tokens [T] (-1 = padding, not
    counted); loss = mean over the sequence's real tokens of the token cross-entropy,
    so each example's loss is one number whatever its length (the unit of privacy
    is the sequence; to protect a user with several sequences, make one example
    per user); correct = the fraction of its real tokens predicted.
  """
  if loss not in LOSSES:
    raise ValueError(f'loss={loss!r}; valid: {LOSSES}.')
  if label_format not in LABEL_FORMATS:
    raise ValueError(f'label_format={label_format!r}; valid: {LABEL_FORMATS}.')
  if loss == 'mse':

    def mse(out, y):
      value = jnp.mean(jnp.square(out - jnp.reshape(y, jnp.shape(out)).astype(out.dtype)))
      return value, jnp.zeros((), jnp.float32)

    return mse
  if loss == 'sequence_cross_entropy':

    def sequence(logits, y):
      real = y >= 0
      tokens = jnp.where(real, y, 0)
      per_token = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
      count = jnp.maximum(jnp.sum(real), 1)
      hit = (jnp.argmax(logits, -1) == tokens) & real
      return (jnp.sum(jnp.where(real, per_token, 0.0)) / count, jnp.sum(hit) / count)

    return sequence
  cross_entropy = _cross_entropy(label_format)

  def classification(logits, y):
    label = jnp.argmax(y, -1) if label_format == 'one_hot' else y
    return cross_entropy(logits, y), (jnp.argmax(logits, -1) == label).astype(jnp.float32)

  return classification


def make_loss_fn(
  model: nn.Module,
  label_format: str = 'int',
  precision: str = 'default',
  views: bool = False,
  loss: str = 'softmax_cross_entropy',
) -> clipping_lib.LossFn:
  """Per-example loss `(params, {'x': x_i, 'y': y_i}) -> (loss_i, {'correct': c_i})`.

  `loss` and `label_format`: see `output_loss`. precision='bfloat16' casts the
  parameters and float inputs to bfloat16 on entry (gradients w.r.t. the
  float32 parameters come back float32) and the output to float32 for the
  loss; see `dpjax.privacy.precision`.

  views=True (augmentation multiplicity, `dpjax.privacy.augmult`): x_i is example i's
  K views [K, ...]; the model runs once on them as a batch of K and the loss
  is the mean over views, (1/K) Σ_k ℓ(θ, v_{i,k}, y_i), whose gradient is the
  view-averaged gradient DP-SGD clips once (correct is that of the mean output
  over views). One model call per example, not a vmap over views, so ghost
  clipping sees each layer's K view rows as extra positions of one example
  (the norm of the averaged gradient, not a sum of per-view norms).
  """
  per_output = output_loss(loss, label_format)
  dtype = precision_lib.compute_dtype(precision)

  def loss_fn(params, example):
    x, y = example['x'], example['y']
    if dtype != jnp.float32:
      params, x = precision_lib.cast_floats((params, x), dtype)
    out = model.apply({'params': params}, x if views else x[None]).astype(jnp.float32)
    if not views:
      value, correct = per_output(out[0], y)
      return value, {'correct': correct}
    values, _ = jax.vmap(per_output, in_axes=(0, None))(out, y)
    _, correct = per_output(jnp.mean(out, axis=0), y)
    return jnp.mean(values), {'correct': correct}

  return loss_fn


@functools.partial(jax.jit, static_argnames=('model', 'label_format', 'loss'))
def eval_step(
  model: nn.Module,
  params: Params,
  batch: Batch,
  label_format: str = 'int',
  loss: str = 'softmax_cross_entropy',
) -> dict[str, jax.Array]:
  """Sums over the real rows of a padded eval batch (sum them over batches).

  Returns {'loss_sum': Σ w_i·loss_i, 'correct': Σ w_i·correct_i, 'num_examples':
  Σ w_i}; accuracy = correct / num_examples. One batched forward pass (valid
  because models never mix examples).
  """
  w = batch['weight'].astype(jnp.float32)
  out = model.apply({'params': params}, batch['x']).astype(jnp.float32)
  losses, correct = jax.vmap(output_loss(loss, label_format))(out, batch['y'])
  return {
    'loss_sum': jnp.sum(jnp.where(w > 0, w * losses, 0.0)),
    'correct': jnp.sum(w * correct),
    'num_examples': jnp.sum(w),
  }
