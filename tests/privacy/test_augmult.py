"""Augmentation multiplicity: view-averaged gradients clipped once, exact resumable views."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.privacy import augmult
from dpjax.privacy import clipping
from dpjax.models import factory as models
from dpjax.models import mlp
from tests.privacy.ghost_clipping import harness

SHAPE = (6, 6, 1)
MODEL = mlp.MLP(num_classes=3, hidden_sizes=(8,), activation='tanh')


def loss_fn(params, example):
  """Single-example loss, written here independently of dpjax.privacy.dp_step."""
  logits = MODEL.apply({'params': params}, example['x'][None])[0]
  return optax.softmax_cross_entropy_with_integer_labels(logits, example['y']), logits


def _setup(p=5, k=4, seed=0):
  rng = np.random.default_rng(seed)
  # From NumPy: an eager MODEL.init compiles a program per op and leaf shape.
  params = harness.init(MODEL, np.zeros((1, *SHAPE), np.float32), seed)
  x = jnp.asarray(rng.normal(size=(p, *SHAPE)), jnp.float32) * 2
  y = jnp.asarray(rng.integers(0, 3, p), jnp.int32)
  views = augmult.make_views(
    x, jnp.arange(10, 10 + p), 7, seed=3, num_views=k, crop_padding=2, flip=True
  )
  return params, x, y, views


def _clipped_sum_of_view_means(params, batch, clip_norm):
  total, stats = clipping.per_example_clipped_sum(
    augmult.mean_over_views(loss_fn), params, batch, clip_norm
  )
  return total, stats.num_clipped


@pytest.mark.slow
def test_clipped_sum_is_the_view_mean_clipped_once():
  params, _, y, views = _setup()
  p, k = views.shape[:2]
  w = np.array([1, 1, 1, 1, 0], np.float32)  # The last row is padding.
  with jax.default_matmul_precision('highest'):
    # Independently: every per-view gradient by a double vmap, then averaged over views.
    # Jitted: op by op, each primitive of the vmapped grads compiled alone took ~10 s.
    per_view = jax.jit(
      jax.vmap(
        jax.vmap(
          jax.grad(lambda q, v, t: loss_fn(q, {'x': v, 'y': t})[0]), in_axes=(None, 0, None)
        ),
        in_axes=(None, 0, 0),
      )
    )(params, views, y)
    mean_g = jax.tree.map(lambda g: np.asarray(g, np.float64).mean(axis=1), per_view)
    norms = np.sqrt(sum(np.sum(g.reshape(p, -1) ** 2, 1) for g in jax.tree.leaves(mean_g)))
    c = float(np.median(norms[:4]))  # Some rows are clipped, some not.
    scale = w * np.minimum(1.0, c / norms)
    expected = jax.tree.map(lambda g: np.tensordot(scale, g, 1), mean_g)
    got, num_clipped = jax.jit(_clipped_sum_of_view_means)(
      params, {'x': views, 'y': y, 'weight': w}, c
    )
  for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(g), e, rtol=1e-5, atol=1e-6)
  # Clipped once, on the view mean: the clip count is that of ‖ḡ_i‖ > C.
  assert int(num_clipped) == int(np.sum(norms[:4] > c))
  # Clipping each view then averaging would give something else (so this test can fail).
  view_norms = np.sqrt(
    sum(
      np.sum(np.asarray(g, np.float64).reshape(p, k, -1) ** 2, 2) for g in jax.tree.leaves(per_view)
    )
  )
  per_view_scale = np.minimum(1.0, c / view_norms) * w[:, None] / k
  wrong = jax.tree.map(
    lambda g: np.einsum('pk,pk...->...', per_view_scale, np.asarray(g)), per_view
  )
  assert (
    max(np.max(np.abs(a - b)) for a, b in zip(jax.tree.leaves(wrong), jax.tree.leaves(expected)))
    > 1e-3
  )
  total = math.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(got)))
  assert total <= 4 * c * (1 + 1e-6)  # ≤ C per real row: the sensitivity is unchanged.


@pytest.mark.slow
def test_one_view_equals_todays_loss():
  params, x, y, _ = _setup()
  wrapped = augmult.mean_over_views(loss_fn)
  # Two programs (eagerly, each op of each was compiled alone), not one: XLA could merge the
  # two computations inside one program and make them equal by construction.
  one_view = jax.jit(lambda p, x, y: wrapped(p, {'x': x[None], 'y': y}))
  today = jax.jit(lambda p, x, y: loss_fn(p, {'x': x, 'y': y}))
  for i in range(3):
    got_loss, got_logits = one_view(params, x[i], y[i])
    loss, logits = today(params, x[i], y[i])
    np.testing.assert_array_equal(np.asarray(got_loss), np.asarray(loss))
    np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(logits))
  batch = {'x': x, 'y': y, 'weight': jnp.ones(x.shape[0])}
  clipped_sum = jax.jit(  # Jitted: op by op, each primitive compiled alone took seconds.
    lambda f, q, b: clipping.per_example_clipped_sum(f, q, b, 1.0)[0], static_argnums=0
  )
  g1 = clipped_sum(loss_fn, params, batch)
  views = augmult.make_views(
    x, jnp.arange(x.shape[0]), 0, seed=0, num_views=1, crop_padding=0, flip=False
  )
  g2 = clipped_sum(wrapped, params, {**batch, 'x': views})
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_views_are_crops_and_flips_of_the_reflect_padded_image():
  x = jnp.arange(36, dtype=jnp.float32).reshape(1, *SHAPE)
  views = np.asarray(
    augmult.make_views(x, jnp.array([4]), 2, seed=1, num_views=32, crop_padding=2, flip=True)
  )
  padded = np.pad(np.asarray(x[0]), ((2, 2), (2, 2), (0, 0)), mode='reflect')
  candidates = [
    c
    for dy in range(5)
    for dx in range(5)
    for c in (padded[dy : dy + 6, dx : dx + 6], padded[dy : dy + 6, dx : dx + 6][:, ::-1])
  ]
  for v in views[0]:
    assert any(np.array_equal(v, c) for c in candidates)
  assert len({v.tobytes() for v in views[0]}) > 8  # 32 draws from 50 distinct views.


def test_views_are_a_pure_function_of_seed_step_and_index():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, *SHAPE)), jnp.float32)
  kw = dict(seed=5, num_views=3, crop_padding=2, flip=True)
  a = augmult.make_views(x, jnp.array([0, 1, 2, 3]), 11, **kw)
  # The same example at another position of the batch gets the same views (resume-exact).
  b = augmult.make_views(x[::-1], jnp.array([3, 2, 1, 0]), 11, **kw)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[::-1])
  c = augmult.make_views(x, jnp.array([0, 1, 2, 3]), 12, **kw)
  assert not np.array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize(
  'args, match',
  [
    ((-1, 0, False), 'augmult.num_views'),
    ((4, -2, False), 'augmult.crop_padding'),
    ((4, 0, 1), 'augmult.flip'),
    ((4, 2, True, (64,)), r'images \[H, W, C\]'),
    ((4, 6, False, (6, 6, 1)), 'min'),
  ],
)
def test_bad_config(args, match):
  with pytest.raises(ValueError, match=match):
    augmult.check_config(*args)
  augmult.check_config(4, 0, False, (64,))  # Identity views of a non-image are fine.
