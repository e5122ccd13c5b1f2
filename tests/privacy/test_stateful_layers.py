"""BatchNorm and Dropout in one's own loop: dpjax's message, and per-example dropout keys.

`clipped_grad` raises `StatefulLayerError` naming the fix where Flax's error said nothing of DP
(`dpjax.privacy.stateful_layers`); examples/own_loop_dropout.py (README, "Dropout and BatchNorm
in your own loop") passes each example's dropout key in the batch; its code path runs here.
"""

import importlib.util
import pathlib

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpjax

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _example():
  """examples/own_loop_dropout.py as a module (its MLP, loss and dropout_keys)."""
  spec = importlib.util.spec_from_file_location(
    'own_loop_dropout', ROOT / 'examples' / 'own_loop_dropout.py'
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _batch(keys):
  """Rows 0, 1 and 2 hold the same example; the dropout keys are the only difference."""
  x = np.tile(np.random.RandomState(0).rand(1, 8, 8).astype(np.float32), (4, 1, 1))
  x[3] = 0.5
  return {'x': x, 'y': np.array([3, 3, 3, 1]), 'dropout_key': keys}


@pytest.mark.slow
def test_per_example_dropout_follows_each_examples_key():
  """The README's own loop with dropout: an example's mask is a function of its key alone (one
  example under two keys gives two losses and gradients; under one key, the same ones whatever
  its row), each row's loss is the one the model gives that example and key outside
  clipped_grad, and ghost clipping agrees with per-example gradients (vmap). Fails on
  da06065: the example did not exist (no such file)."""
  ex = _example()
  model = ex.MLP(nnx.Rngs(0), rate=0.5)
  fm = dpjax.NNXFunctional(model)
  keys = ex.dropout_keys(jax.random.PRNGKey(1), 3, jnp.array([5, 6, 5, 7]))
  batch = _batch(keys)
  with jax.default_matmul_precision('highest'):
    grad_fn = jax.jit(dpjax.clipped_grad(fm.loss(ex.loss), clip_norm=1e6, method='ghost'))
    total, rows = grad_fn(fm.params, batch, jnp.ones(4))
    alone = [grad_fn(fm.params, batch, jnp.eye(4)[i])[0] for i in range(3)]  # g_i, unclipped.
    one_loss = jax.jit(fm.loss(ex.loss))  # No vmap, no clipping: the model on one example.
    direct = [one_loss(fm.params, jax.tree.map(lambda l, i=i: l[i], batch)) for i in range(4)]
    reference = jax.jit(dpjax.clipped_grad(fm.loss(ex.loss), clip_norm=1e6, method='vmap'))(
      fm.params, batch, jnp.ones(4)
    )[0]
  np.testing.assert_allclose(rows.loss, np.array(direct), rtol=1e-6)
  assert rows.loss[0] == rows.loss[2] and rows.norm[0] == rows.norm[2]
  assert abs(rows.loss[0] - rows.loss[1]) > 1e-3 and abs(rows.norm[0] - rows.norm[1]) > 1e-3
  for a, b in zip(jax.tree.leaves(alone[0]), jax.tree.leaves(alone[2])):
    np.testing.assert_array_equal(a, b)
  assert (
    max(
      float(jnp.max(jnp.abs(a - b)))
      for a, b in zip(jax.tree.leaves(alone[0]), jax.tree.leaves(alone[1]))
    )
    > 1e-3
  )
  # No dropout key: the model without its mask (jitted: eager, each op is its own compile).
  without = one_loss(fm.params, {**jax.tree.map(lambda l: l[0], batch), 'dropout_key': None})
  assert abs(float(without) - float(rows.loss[0])) > 1e-3  # The mask drops units.
  for a, b in zip(jax.tree.leaves(total), jax.tree.leaves(reference)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _NNXNet(nnx.Module):
  def __init__(self, layer: str, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(8, 16, rngs=rngs)
    self.layer = (
      nnx.BatchNorm(16, rngs=rngs) if layer == 'batch_norm' else nnx.Dropout(0.5, rngs=rngs)
    )
    self.head = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(self.layer(nnx.relu(self.hidden(x))))


class _LinenNet(nn.Module):
  layer: str

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(16)(x))
    h = (
      nn.BatchNorm(use_running_average=False)(h)
      if self.layer == 'batch_norm'
      else nn.Dropout(0.5, deterministic=False)(h)
    )
    return nn.Dense(3)(h)


def _loss(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y)


@pytest.mark.parametrize('framework', ['nnx', 'linen'])
@pytest.mark.parametrize(
  'layer, fix',
  [
    (
      'batch_norm',
      r'BatchNorm normalises with statistics of the batch.*not DP-compatible across '
      r'examples\. Use GroupNorm or LayerNorm.*use_running_average=True',
    ),
    (
      'dropout',
      r"Dropout.*its own key in the batch.*'dropout_key'.*README, \"Dropout and "
      r'BatchNorm in your own loop\"',
    ),
  ],
  ids=['batch_norm', 'dropout'],
)
def test_batch_norm_and_dropout_state_in_the_loss_name_the_fix(framework, layer, fix):
  """Fails on da06065: Flax's TraceContextError ("Cannot mutate BatchStat / RngCount from a
  different trace level") for NNX, its missing batch_stats collection or dropout RNG for
  linen, with no word of DP or of the fix."""
  x, y = np.random.RandomState(0).randn(4, 8).astype(np.float32), np.array([0, 1, 2, 0])
  if framework == 'nnx':
    fm = dpjax.NNXFunctional(_NNXNet(layer, nnx.Rngs(0)))
    params, loss_fn = fm.params, fm.loss(lambda m, ex: _loss(m(ex['x'][None])[0], ex['y']))
  else:
    net = _LinenNet(layer)
    params = net.init({'params': jax.random.key(0), 'dropout': jax.random.key(1)}, x)['params']
    loss_fn = lambda p, ex: _loss(net.apply({'params': p}, ex['x'][None])[0], ex['y'])
  with pytest.raises(ValueError, match=fix) as info:  # Flax's own errors are no ValueError.
    dpjax.clipped_grad(loss_fn, clip_norm=1.0)(params, {'x': x, 'y': y}, jnp.ones(4))
  assert type(info.value).__name__ == 'StatefulLayerError'
  assert info.value.__cause__ is not None  # Flax's error.
  assert (framework + '.' if framework == 'nnx' else 'linen ') in str(info.value)


def test_a_frozen_batch_norm_is_per_example_and_allowed():
  """BatchNorm(use_running_average=True) reads fixed statistics: a per-example affine map, which
  the refusal above must let through (it passes on da06065 too)."""

  class Frozen(nnx.Module):
    def __init__(self, rngs):
      self.hidden, self.head = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)
      self.norm = nnx.BatchNorm(16, use_running_average=True, rngs=rngs)

    def __call__(self, x):
      return self.head(self.norm(self.hidden(x)))

  fm = dpjax.NNXFunctional(Frozen(nnx.Rngs(0)))
  x = np.random.RandomState(0).randn(4, 8).astype(np.float32)
  grad_fn = dpjax.clipped_grad(
    fm.loss(lambda m, ex: _loss(m(ex['x'][None])[0], ex['y'])), clip_norm=1.0
  )
  _, rows = jax.jit(grad_fn)(fm.params, {'x': x, 'y': np.arange(4) % 3}, jnp.ones(4))
  assert bool(jnp.all(rows.finite))
