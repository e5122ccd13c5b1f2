"""Per-example softmax cross-entropy for the DP step, and the eval sums.

Models are per-example (no BatchNorm, no dropout: `dpjax.models`), so the
batched forward pass of `eval_step` equals the per-example one.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax import clipping as clipping_lib
from dpjax import data
from dpjax import precision as precision_lib
from dpjax import sharding

Params = clipping_lib.Params
Batch = dict[str, jax.Array]

LABEL_FORMATS = ('int', 'one_hot')


def make_loss_fn(model: nn.Module, label_format: str = 'int',
                 precision: str = 'default', views: bool = False) -> clipping_lib.LossFn:
  """Per-example softmax cross-entropy (params, x_i, y_i) -> (loss, logits).

  precision='bfloat16' casts the parameters and float inputs to bfloat16 on
  entry (gradients w.r.t. the float32 parameters come back float32) and the
  logits to float32 for the loss; see `dpjax.precision`.

  views=True (augmentation multiplicity, `dpjax.augmult`): x_i is example i's
  K views [K, ...]; the model runs once on them as a batch of K and the loss
  is the mean over views, (1/K) Σ_k ℓ(θ, v_{i,k}, y_i), whose gradient is the
  view-averaged gradient DP-SGD clips once (the logits returned are the mean
  over views). One model call per example, not a vmap over views, so ghost
  clipping sees each layer's K view rows as extra positions of one example
  (the norm of the averaged gradient, not a sum of per-view norms).
  """
  if label_format not in LABEL_FORMATS:
    raise ValueError(f'label_format={label_format!r}; valid: {LABEL_FORMATS}.')
  dtype = precision_lib.compute_dtype(precision)
  cross_entropy = (optax.softmax_cross_entropy_with_integer_labels if label_format == 'int'
                   else optax.softmax_cross_entropy)

  def loss_fn(params, x, y):
    if dtype != jnp.float32:
      params, x = precision_lib.cast_floats((params, x), dtype)
    logits = model.apply({'params': params}, x if views else x[None]).astype(jnp.float32)
    if not views:
      return cross_entropy(logits[0], y), logits[0]
    labels = jnp.broadcast_to(y, (logits.shape[0],) + jnp.shape(y))
    return jnp.mean(cross_entropy(logits, labels)), jnp.mean(logits, axis=0)
  return loss_fn


@functools.partial(jax.jit, static_argnames=('model', 'label_format'))
def eval_step(model: nn.Module, params: Params, batch: Batch,
              label_format: str = 'int') -> dict[str, jax.Array]:
  """Sums over the real rows of a padded eval batch (sum them over batches).

  Returns {'loss_sum': Σ w_i·loss_i, 'correct': Σ w_i·[argmax = label],
  'num_examples': Σ w_i}; accuracy = correct / num_examples. One batched
  forward pass (valid because models never mix examples).
  """
  w = batch['weight'].astype(jnp.float32)
  logits = model.apply({'params': params}, batch['x'])
  y = batch['y']
  if label_format == 'int':
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    labels = y
  else:
    losses = optax.softmax_cross_entropy(logits, y)
    labels = jnp.argmax(y, axis=-1)
  return {
      'loss_sum': jnp.sum(jnp.where(w > 0, w * losses, 0.0)),
      'correct': jnp.sum(w * (jnp.argmax(logits, -1) == labels)),
      'num_examples': jnp.sum(w),
  }


def evaluate(step_fn, params, source: data.DataSource, physical_batch_size: int,
             mesh: jax.sharding.Mesh) -> dict[str, float]:
  """Loss and accuracy over a whole split, in zero-weight-padded batches sharded like training."""
  rows = sharding.local_rows(mesh, physical_batch_size)
  totals = None
  for start in range(0, len(source), physical_batch_size):
    indices = np.arange(start, min(start + physical_batch_size, len(source)))
    weights = np.zeros(physical_batch_size, np.float32)
    weights[:len(indices)] = 1
    padded = np.zeros(physical_batch_size, np.int64)
    padded[:len(indices)] = indices
    batch = source.gather(padded[rows])
    batch['weight'] = weights[rows]
    out = step_fn(params, sharding.shard_batch(mesh, batch))
    totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
  totals = jax.device_get(totals)
  return {'eval_loss': float(totals['loss_sum'] / totals['num_examples']),
          'eval_accuracy': float(totals['correct'] / totals['num_examples'])}
