"""dpjax.privacy.clipping against a float64 numpy reference and the clipping bound."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.privacy import clipping
from dpjax.privacy import dp_step
from dpjax.privacy import privacy_plan
from dpjax.privacy import samplers
from dpjax.models import factory as models
from dpjax.models import mlp

D, H, K = 6, 16, 3  # Input features, hidden width, classes.
MODEL = mlp.MLP(num_classes=K, hidden_sizes=(H,), activation='tanh')


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """Matmuls in float32 on every backend (GPUs default to TF32): these tests
  compare with float64 or float32 references at float32 tolerances."""
  with jax.default_matmul_precision('highest'):
    yield


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {
    'Dense_0': {
      'kernel': rng.normal(size=(D, H)).astype(np.float32),
      'bias': rng.normal(size=H).astype(np.float32) * 0.1,
    },
    'Dense_1': {
      'kernel': rng.normal(size=(H, K)).astype(np.float32),
      'bias': rng.normal(size=K).astype(np.float32) * 0.1,
    },
  }


def loss_fn(params, example):
  """Single-example loss, written here independently of dpjax.privacy.dp_step."""
  logits = MODEL.apply({'params': params}, example['x'][None])[0]
  return (
    optax.softmax_cross_entropy_with_integer_labels(logits, example['y']),
    {'correct': (jnp.argmax(logits) == example['y']).astype(jnp.float32)},
  )


def _batch(n, seed=1, num_pad=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n + num_pad, D)).astype(np.float32) * 2
  y = rng.integers(0, K, n + num_pad).astype(np.int32)
  w = np.r_[np.ones(n), np.zeros(num_pad)].astype(np.float32)
  return {'x': x, 'y': y, 'weight': w}


def _reference(params, batch, clip_norm):
  """Per-example gradients of the tanh MLP by hand, in float64."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x = np.asarray(batch['x'], np.float64)
  y, w = batch['y'], np.asarray(batch['weight'], np.float64)
  w1, b1 = p['Dense_0']['kernel'], p['Dense_0']['bias']
  w2, b2 = p['Dense_1']['kernel'], p['Dense_1']['bias']
  h = np.tanh(x @ w1 + b1)
  z = h @ w2 + b2
  zmax = z.max(axis=1, keepdims=True)
  lse = zmax[:, 0] + np.log(np.exp(z - zmax).sum(axis=1))
  losses = lse - z[np.arange(len(y)), y]
  dz = np.exp(z - lse[:, None]) - np.eye(K)[y]  # softmax - one_hot
  dpre = (dz @ w2.T) * (1 - h**2)
  g = {
    'Dense_0': {'kernel': x[:, :, None] * dpre[:, None, :], 'bias': dpre},
    'Dense_1': {'kernel': h[:, :, None] * dz[:, None, :], 'bias': dz},
  }
  norms = np.sqrt(sum(np.sum(l.reshape(len(y), -1) ** 2, axis=1) for l in jax.tree.leaves(g)))
  factor = w * np.minimum(1.0, clip_norm / norms)
  total = jax.tree.map(lambda l: np.tensordot(factor, l, axes=1), g)
  stats = {
    'num_clipped': int(np.sum((w > 0) & (norms > clip_norm))),
    'loss_sum': float(np.sum(w * losses)),
    'correct': float(np.sum(w * (z.argmax(1) == y))),
    'grad_norm_sum': float(np.sum(w * norms)),
  }
  return total, stats, norms


clipped_sum = jax.jit(clipping.per_example_clipped_sum, static_argnums=(0, 3))
grad_sum = jax.jit(clipping.grad_sum, static_argnums=0)


def test_matches_float64_reference():
  params, batch = _params(), _batch(12, num_pad=4)
  _, _, norms = _reference(params, batch, math.inf)
  clip = float(np.median(norms[:12]))  # About half the examples are clipped.
  want, want_stats, _ = _reference(params, batch, clip)
  got, stats = clipped_sum(loss_fn, params, batch, clip)
  jax.tree.map(
    lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-6 * np.abs(r).max()), got, want
  )
  assert int(stats.num_clipped) == want_stats['num_clipped'] in (5, 6, 7)
  assert int(stats.num_nonfinite) == 0
  assert float(stats.num_rows) == 12
  np.testing.assert_allclose(stats.loss_sum, want_stats['loss_sum'], rtol=1e-5)
  assert float(stats.correct) == want_stats['correct']
  np.testing.assert_allclose(stats.grad_norm_sum, want_stats['grad_norm_sum'], rtol=1e-5)


def _norm(tree):
  """The global L2 norm of a tree, in float64 on the host."""
  return float(np.sqrt(sum(np.sum(np.asarray(l, np.float64) ** 2) for l in jax.tree.leaves(tree))))


def test_each_contribution_is_bounded_and_unclipped_rows_unchanged():
  params, batch = _params(seed=2), _batch(10, seed=3)
  _, _, norms = _reference(params, batch, math.inf)
  clip = float(np.median(norms))
  raw_grad = jax.jit(jax.grad(lambda p, x, y: loss_fn(p, {'x': x, 'y': y})[0]))
  seen = {'clipped': 0, 'unclipped': 0}
  for i in range(10):
    row = jax.tree.map(lambda a: a[i : i + 1], batch)
    got, stats = clipped_sum(loss_fn, params, row, clip)
    g = raw_grad(params, batch['x'][i], batch['y'][i])
    got_norm, g_norm = _norm(got), _norm(g)  # In NumPy: eager norms compile per leaf shape.
    assert got_norm <= clip * (1 + 1e-6)
    if g_norm <= clip:  # Unchanged.
      seen['unclipped'] += 1
      assert int(stats.num_clipped) == 0
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, g)
    else:  # Rescaled onto the sphere of radius C, same direction.
      seen['clipped'] += 1
      assert int(stats.num_clipped) == 1
      np.testing.assert_allclose(got_norm, clip, rtol=1e-6)
      jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b * (clip / g_norm), rtol=1e-5, atol=1e-7),
        got,
        g,
      )
  assert seen['clipped'] >= 3 and seen['unclipped'] >= 3


def test_padding_rows_contribute_exactly_zero():
  params, real = _params(), _batch(7, seed=4)
  # Garbage in the padding rows, including values that are non-finite.
  garbage = np.array([np.nan, np.inf, -np.inf, 1e30, 3.0, -7.0], np.float32)
  padded = {
    'x': np.r_[real['x'], np.tile(garbage[:D], (5, 1))],
    'y': np.r_[real['y'], np.full(5, K - 1, np.int32)],
    'weight': np.r_[real['weight'], np.zeros(5, np.float32)],
  }
  # The same shape with benign padding (copies of real rows, weight 0): if padding adds exactly
  # zero, the sums are bit-exact whatever the padding holds. (Against the unpadded batch only
  # up to rounding: a longer reduction may be vectorised in another order, e.g. on AMD EPYC.)
  benign = {
    'x': np.r_[real['x'], real['x'][:5]],
    'y': np.r_[real['y'], real['y'][:5]],
    'weight': padded['weight'],
  }
  got, stats = clipped_sum(loss_fn, params, padded, 0.5)
  same_shape, _ = clipped_sum(loss_fn, params, benign, 0.5)
  jax.tree.map(np.testing.assert_array_equal, got, same_shape)  # Bit-exact.
  want, want_stats = clipped_sum(loss_fn, params, real, 0.5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), got, want)
  # Counts exact; float sums up to the rounding of a longer reduction.
  for field in clipping.ClipStats._fields:
    np.testing.assert_allclose(getattr(stats, field), getattr(want_stats, field), rtol=1e-6)
  assert int(stats.num_clipped) == int(want_stats.num_clipped)
  assert int(stats.num_nonfinite) == 0  # Padding is never counted.


def test_nonfinite_examples_are_zeroed_and_counted():
  params, batch = _params(), _batch(8, seed=5)
  bad = jax.tree.map(np.copy, batch)
  bad['x'][2, 0] = np.inf
  bad['x'][5, 3] = np.nan
  clean = jax.tree.map(np.copy, batch)
  clean['weight'][[2, 5]] = 0.0
  want, want_stats = clipped_sum(loss_fn, params, clean, 1.0)
  got, stats = clipped_sum(loss_fn, params, bad, 1.0)
  assert all(np.isfinite(l).all() for l in jax.tree.leaves(got))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, want)
  assert int(stats.num_nonfinite) == 2
  assert float(stats.num_rows) == 8
  np.testing.assert_allclose(stats.loss_sum, want_stats.loss_sum, rtol=1e-6)


@jax.jit
def _batched_weighted_grad(params, batch):
  """Σ_i w_i ∇loss_i by one batched backward pass (independent of clipping)."""

  def total(p):
    logits = MODEL.apply({'params': p}, batch['x'])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])
    return jnp.sum(batch['weight'] * losses)

  return jax.grad(total)(params)


def test_infinite_clip_norm_and_grad_sum_give_the_weighted_gradient():
  params, batch = _params(seed=6), _batch(9, seed=7, num_pad=3)
  want = _batched_weighted_grad(params, batch)
  got_inf, stats = clipped_sum(loss_fn, params, batch, math.inf)
  got_np, np_stats = grad_sum(loss_fn, params, batch)
  for got in (got_inf, got_np):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
  assert int(stats.num_clipped) == 0
  np.testing.assert_allclose(np_stats.loss_sum, stats.loss_sum, rtol=1e-6)
  assert float(np_stats.correct) == float(stats.correct)


def test_grad_sum_drops_and_counts_nonfinite_inputs():
  params, batch = _params(), _batch(6, seed=8, num_pad=2)
  batch['x'][1, 0] = np.inf
  batch['x'][7, 0] = np.nan  # Padding row: dropped, not counted.
  clean = jax.tree.map(np.copy, batch)
  clean['weight'][1] = 0.0
  clean['x'][[1, 7]] = 0.0
  got, stats = grad_sum(loss_fn, params, batch)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    got,
    _batched_weighted_grad(params, clean),
  )
  assert int(stats.num_nonfinite) == 1
  assert np.isfinite(float(stats.loss_sum))


def test_one_hot_labels_match_int_labels():
  params, batch = _params(), _batch(8, seed=9)
  one_hot = dict(batch, y=np.eye(K, dtype=np.float32)[batch['y']])

  def loss_one_hot(p, ex):
    logits = MODEL.apply({'params': p}, ex['x'][None])[0]
    return (
      optax.softmax_cross_entropy(logits, ex['y']),
      {'correct': (jnp.argmax(logits) == jnp.argmax(ex['y'])).astype(jnp.float32)},
    )

  a, sa = clipped_sum(loss_fn, params, batch, 0.7)
  b, sb = clipped_sum(loss_one_hot, params, one_hot, 0.7)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7), a, b)
  assert float(sa.correct) == float(sb.correct)
  assert int(sa.num_clipped) == int(sb.num_clipped)


def test_make_clipped_sum_fn_selects_and_validates():
  params, batch = _params(), _batch(4)
  want, _ = clipped_sum(loss_fn, params, batch, 0.3)
  got, _ = jax.jit(clipping.make_clipped_sum_fn('vmap', loss_fn, 0.3))(params, batch)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  # The MLP is covered, so 'auto' is 'ghost': same sum up to rounding.
  for method in ('auto', 'ghost'):
    fn = clipping.make_clipped_sum_fn(method, loss_fn, 0.3)
    got, _ = jax.jit(fn)(params, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, want)
  with pytest.raises(ValueError, match="valid: \\('auto', 'vmap', 'ghost'\\)"):
    clipping.make_clipped_sum_fn('opacus', loss_fn, 0.3)
  for bad in (0.0, -1.0, math.nan, None, 'one'):
    with pytest.raises(ValueError, match='clip_norm must be a number > 0'):
      clipping.make_clipped_sum_fn('vmap', loss_fn, bad)


def test_ghost_matches_the_float64_reference():
  params, batch = _params(seed=3), _batch(12, seed=10, num_pad=4)
  batch['x'][14] = np.nan  # A padding row.
  _, _, norms = _reference(params, batch, math.inf)
  clip = float(np.median(norms[:12]))
  want, want_stats, _ = _reference(params, dict(batch, x=np.nan_to_num(batch['x'])), clip)

  def ghost(p, b):
    total, rows = clipping.ghost_clipped_sum(loss_fn, p, clipping.examples_of(b), b['weight'], clip)
    return total, clipping.ClipStats.of(rows, b['weight'], clip)

  got, stats = jax.jit(ghost)(params, batch)
  jax.tree.map(
    lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-6 * np.abs(r).max()), got, want
  )
  assert int(stats.num_clipped) == want_stats['num_clipped'] in (5, 6, 7)
  assert int(stats.num_nonfinite) == 0
  np.testing.assert_allclose(stats.grad_norm_sum, want_stats['grad_norm_sum'], rtol=1e-5)


def test_clipped_grad_needs_the_weights_and_padding_copies_of_example_0_add_nothing():
  """Fails on da06065: without `weights` every row counted, and a batcher pads with copies of
  example 0, so example 0 entered the sum 1 + #padding times (up to 17·C at P = 32, b = 16).

  The attack: D = 5 rows (example 0 an outlier) in P = 8 rows, padded as the batcher pads
  (index 0); D' = D minus example 0, padded with its own example 0. The sums, with the
  batcher's weights, differ by at most C; counting the padding (da06065 without weights) they
  differed by 3.6·C.
  """
  c = 0.5
  grad_fn = jax.jit(clipping.clipped_grad(loss_fn, c, has_aux=True, method='vmap'))
  params, rows = _params(), _batch(5, seed=6)
  rows['x'][0] *= 1e3  # Example 0's gradient is far above C.
  pad = lambda idx: {'x': rows['x'][idx], 'y': rows['y'][idx]}
  d = pad([0, 1, 2, 3, 4, 0, 0, 0])
  d_minus = pad([1, 2, 3, 4, 1, 1, 1, 1])
  with pytest.raises(TypeError, match="^clipped_grad's weights are required"):
    grad_fn(params, d)
  with_0, _ = grad_fn(params, d, np.r_[np.ones(5), np.zeros(3)].astype(np.float32))
  without, _ = grad_fn(params, d_minus, np.r_[np.ones(4), np.zeros(4)].astype(np.float32))
  # One float32 program for both norms (eagerly: a program per op and leaf shape, 29 in all).
  norms = jax.jit(lambda a, b: optax.tree.norm(jax.tree.map(jnp.subtract, a, b)))
  diff = float(norms(with_0, without))
  assert 0.99 * c < diff <= c
  # A weight above 1 would multiply a row's sensitivity: weights are taken into [0, 1].
  heavy, _ = grad_fn(params, d, np.r_[17.0, np.zeros(7)].astype(np.float32))
  zero = jax.tree.map(np.zeros_like, heavy)
  assert 0.99 * c < float(norms(heavy, zero)) <= c


def _clip_entry_points():
  """(name, grad_fn(params, rows) -> the rows' clipped sum) for each road to a clipped sum."""
  c = 4.0  # Between the norms of the rows below (0.6 to 7.5).
  sampler = samplers.PoissonSampler(num_examples=100_000, batch_size=1000, seed=0)
  plans = {
    b: privacy_plan.PrivacyPlan.create(
      sampler, num_steps=10, clip_norm=c, delta=1e-6, noise_multiplier=1.0, max_batch_size=b
    )
    for b in (0, 4096)
  }  # 0: the automatic cap (B not given).
  step = dp_step.DPStep.for_model(
    MODEL, optax.sgd(0.1), clip_norm=c, noise_multiplier=1.0, expected_batch_size=10
  )
  entries = {'clipped_grad': clipping.clipped_grad(loss_fn, c, has_aux=True, method='vmap')}
  entries.update(
    {f'plan_B={b or "auto"}': plan.clipped_grad(loss_fn, has_aux=True) for b, plan in plans.items()}
  )  # 'auto': ghost clipping.
  entries = {
    name: jax.jit(lambda p, rows, f=f: f(p, rows, jnp.ones(len(rows['y'])))[0])
    for name, f in entries.items()
  }
  entries['dp_step'] = lambda p, rows: (
    step.accumulate(p, step.init_accumulator(p), dict(rows, weight=np.ones(1, np.float32))).grad_sum
  )
  return c, entries


def test_each_example_is_clipped_at_c_exactly_on_every_road():
  """min(1, C/‖g‖)·g within 1e-5 relative of the float64 clip, whatever B: the library's
  `clipped_grad` (vmap), a plan's (ghost) with B not given and B = 4,096, and the trainer's
  DPStep (ghost). Fails on da06065: they clipped at C/((1 + margin)(1 + sum_margin(B))), 7.2% below C
  when B was not given, 4.9e-3 below at B = 4,096."""
  c, entries = _clip_entry_points()
  params, batch = _params(seed=4), _batch(6, seed=5)
  _, _, norms = _reference(params, batch, math.inf)
  assert np.sum(norms > c) >= 3 and np.sum(norms < c) >= 1  # Both kinds of rows.
  flat = lambda tree: np.concatenate(
    [np.ravel(np.asarray(l, np.float64)) for l in jax.tree.leaves(tree)]
  )
  for i in range(6):
    row = jax.tree.map(lambda l: l[i : i + 1], batch)
    exact, _, _ = _reference(params, row, c)  # min(1, C/‖g‖)·g in float64.
    for name, fn in entries.items():
      got = fn(params, {'x': row['x'], 'y': row['y']})
      err = np.linalg.norm(flat(got) - flat(exact)) / np.linalg.norm(flat(exact))
      assert err <= 1e-5, (name, i, err)
