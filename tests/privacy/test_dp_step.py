"""dpjax.privacy.dp_step: the logical DP-SGD step against closed forms."""

import ast
import functools
import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats as scipy_stats

from dpjax.configs import digits_mlp
from dpjax.privacy import batching
from dpjax.trainer.planning import plan as plan_lib
from dpjax.privacy import clipping
from dpjax.data import sources as data
from dpjax.data import device as device_data
from dpjax.privacy import dp_step
from dpjax.trainer.planning import physical_batch
from dpjax.models import factory as models
from dpjax.privacy import samplers
from dpjax.privacy import sharding
from dpjax.models import mlp
from dpjax.privacy import losses
from dpjax.privacy import noise
from dpjax.privacy import prng
from tests import executions

# Every sampler but cyclic_poisson, whose batches are Poisson's (Binomial sizes, the same
# program) and whose step runs in tests/e2e/test_train.py's SIGKILL test (BandMF).
STEP_SAMPLERS = tuple(n for n in samplers.SAMPLER_NAMES if n != 'cyclic_poisson')

D, K = 8, 4  # Input features, classes.
MODEL = mlp.MLP(num_classes=K, hidden_sizes=(32,), activation='tanh')


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """Matmuls in float32 on every backend (GPUs default to TF32): these tests
  compare with float64 or float32 references at float32 tolerances."""
  with jax.default_matmul_precision('highest'):
    yield


@functools.cache
def _param_shapes(model, d):
  """model.init's parameter shapes, traced once per (model, d) for the file's 24 `_params`."""
  return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, d))))['params']


def _params(model=MODEL, d=D, seed=0):
  """Fan-in scaled numpy parameters (avoids compiling jax.random in init)."""
  rng = np.random.default_rng(seed)
  shapes = _param_shapes(model, d)
  return jax.tree.map(
    lambda s: (rng.normal(size=s.shape) / np.sqrt(s.shape[0])).astype(np.float32), shapes
  )


def _rows(n, seed=1):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(n, D)).astype(np.float32) * 2, rng.integers(0, K, n).astype(np.int32))


def _physical_batches(x, y, p, garbage=False):
  """Split n real rows into ceil(n/p) batches of p rows, padding the last."""
  n = len(y)
  num = -(-n // p)
  pad = num * p - n
  fill = np.nan if garbage else 0.0
  xs = np.r_[x, np.full((pad, D), fill, np.float32)]
  ys = np.r_[y, np.full(pad, K - 1, np.int32)]
  ws = np.r_[np.ones(n), np.zeros(pad)].astype(np.float32)
  return [
    {'x': xs[i * p : (i + 1) * p], 'y': ys[i * p : (i + 1) * p], 'weight': ws[i * p : (i + 1) * p]}
    for i in range(num)
  ]


@functools.cache
def _standard_step(label_format='int'):
  """One DPStep shared by tests (each instance costs an XLA compile), which compare updates
  under one noise: it may apply a step again (`test_apply_refuses_a_repeated_step` says why
  nothing else may)."""
  return dp_step.DPStep.for_model(
    MODEL,
    optax.sgd(0.5),
    clip_norm=0.5,
    noise_multiplier=1.0,
    expected_batch_size=10,
    label_format=label_format,
    allow_repeated_steps=True,
  )


def _run_step(step, params, batches, t=0, optimizer_state=None):
  """init_accumulator, accumulate each batch, apply with the noise of (step.seed, t)."""
  opt_state = step.optimizer.init(params) if optimizer_state is None else optimizer_state
  acc = step.init_accumulator(params)
  for b in batches:
    acc = step.accumulate(params, acc, b)
  return step.apply(params, opt_state, acc, np.uint32(t))


@jax.jit
def _mean_loss_grad(params, x, y):
  """∇ of the mean loss by one batched pass: the non-private reference."""

  def mean_loss(p):
    logits = MODEL.apply({'params': p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return jax.grad(mean_loss)(params)


# References below do their arithmetic in NumPy: eagerly, each jnp op and leaf shape is its own
# XLA compilation (test_unclipped_sums... compiled 25 programs, test_noise_std... 17).
def _assert_trees_close(a, b, **kw):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **kw), a, b)


def test_unclipped_sums_are_the_gradient_sum_and_the_divisor_is_b():
  """A private step whose C exceeds every gradient norm accumulates Σ_i g_i; the non-private
  step (no clipping, no noise) is SGD on Σ_i g_i / b with b the expected batch size."""
  params, (x, y) = _params(), _rows(10)
  lr = 0.3
  g = _mean_loss_grad(params, x, y)  # Σ_i g_i / 10.
  batches = _physical_batches(x, y, 4)  # K = 3, two padding rows.
  private = dp_step.DPStep.for_model(
    MODEL, optax.sgd(lr), clip_norm=1e6, noise_multiplier=1.0, expected_batch_size=10
  )
  acc = private.init_accumulator(params)
  for batch in batches:
    acc = private.accumulate(params, acc, batch)
  _assert_trees_close(
    acc.grad_sum, jax.tree.map(lambda v: 10 * np.asarray(v), g), rtol=1e-5, atol=1e-6
  )
  assert int(acc.stats.num_clipped) == 0
  # Non-private, b = 16 != 10 rows: the divisor is the expected batch size.
  nonprivate = dp_step.DPStep.for_model(
    MODEL,
    optax.sgd(lr),
    clip_norm=None,
    noise_multiplier=None,
    expected_batch_size=16,
    private=False,
  )
  new, _, metrics = _run_step(nonprivate, params, batches)
  want = jax.tree.map(lambda p, g: np.asarray(p) - lr * np.asarray(g) * 10 / 16, params, g)
  _assert_trees_close(new, want, rtol=1e-5, atol=1e-6)
  assert int(metrics['num_clipped']) == 0
  assert float(metrics['num_examples']) == 10


def test_padded_batches_give_the_same_update():
  params, (x, y) = _params(), _rows(5, seed=2)
  step = _standard_step()  # clipping='auto': ghost clipping for the MLP.
  a, _, ma = _run_step(step, params, _physical_batches(x, y, 8), t=3)
  b, _, mb = _run_step(
    step,
    params,  # P = 8: three NaN padding rows.
    _physical_batches(x, y, 8, garbage=True),
    t=3,
  )
  jax.tree.map(np.testing.assert_array_equal, a, b)  # Bit-exact.
  for k in ma:
    np.testing.assert_array_equal(ma[k], mb[k])
  # P = 5 (no padding): the same sums, reduced in another order.
  c, _, mc = _run_step(step, params, _physical_batches(x, y, 5), t=3)
  _assert_trees_close(c, a, rtol=1e-6, atol=1e-7)
  for k in ma:
    np.testing.assert_allclose(mc[k], ma[k], rtol=1e-6)


def test_accumulating_k_batches_equals_the_one_shot_clipped_sum():
  params, (x, y) = _params(), _rows(10, seed=3)
  step = _standard_step()
  acc = step.init_accumulator(params)
  for b in _physical_batches(x, y, 4):
    acc = step.accumulate(params, acc, b)
  one_shot = jax.jit(clipping.per_example_clipped_sum, static_argnums=(0, 3))
  want, want_stats = one_shot(
    losses.make_loss_fn(MODEL), params, _physical_batches(x, y, 12)[0], step.clip_bound
  )
  _assert_trees_close(acc.grad_sum, want, rtol=1e-6, atol=1e-7)
  for field in clipping.ClipStats._fields:
    np.testing.assert_allclose(getattr(acc.stats, field), getattr(want_stats, field), rtol=1e-6)
  assert int(acc.stats.num_clipped) > 0


def test_noise_is_added_once_and_signal_scaled_by_one_over_b():
  """update(K batches) − update(K = 0) with the same key = −lr·Σclip(g)/b."""
  params, (x, y) = _params(), _rows(10, seed=4)
  step = _standard_step()
  lr, b = 0.5, step.expected_batch_size
  batches = _physical_batches(x, y, 4)
  with_data, _, _ = _run_step(step, params, batches, t=5)
  noise_only, _, metrics = _run_step(step, params, [], t=5)  # K = 0.
  acc = step.init_accumulator(params)
  for batch in batches:
    acc = step.accumulate(params, acc, batch)
  diff = jax.tree.map(lambda u, v: np.asarray(u) - np.asarray(v), with_data, noise_only)
  _assert_trees_close(
    diff, jax.tree.map(lambda s: -lr * np.asarray(s) / b, acc.grad_sum), rtol=1e-4, atol=1e-6
  )
  assert float(metrics['num_examples']) == 0
  assert float(metrics['loss']) == 0 and float(metrics['grad_norm']) == 0


def test_noise_std_is_sigma_c_over_b():
  """K = 0 and SGD(lr=1): update = −σC/b · z, z ~ N(0, I), on ~100k coords."""
  model = mlp.MLP(num_classes=10, hidden_sizes=(128,))
  params = _params(model, d=784)
  sigma, c, b = 1.3, 0.7, 50.0
  steps = [
    dp_step.DPStep.for_model(
      model,
      optax.sgd(1.0),
      clip_norm=c,
      noise_multiplier=sigma,
      expected_batch_size=b,
      seed=seed,
      allow_repeated_steps=True,
    )
    for seed in (0, 1)
  ]
  step = steps[0]
  opt_state = step.optimizer.init(params)

  def z(t, seed=0):
    new, _, _ = steps[seed].apply(params, opt_state, step.init_accumulator(params), np.uint32(t))
    leaves = jax.tree.map(
      lambda p, q: (np.asarray(p) - np.asarray(q)) / np.float32(-sigma * c / b), new, params
    )
    return leaves, np.concatenate([np.ravel(l) for l in jax.tree.leaves(leaves)]).astype(np.float64)

  leaves, z0 = z(0)
  n = z0.size
  assert n == 784 * 128 + 128 + 128 * 10 + 10
  # Σ z² ~ χ²(n): two-sided test at 1e-4 (std within ~1%).
  chi2 = np.sum(z0**2)
  p = 2 * min(scipy_stats.chi2.cdf(chi2, n), scipy_stats.chi2.sf(chi2, n))
  assert p > 1e-4, np.sqrt(chi2 / n)
  assert abs(z0.mean()) < 5 / np.sqrt(n)
  assert scipy_stats.kstest(z0, 'norm').pvalue > 1e-4
  for leaf in jax.tree.leaves(leaves):  # Every leaf gets its own noise.
    if leaf.size >= 128:
      assert abs(np.std(leaf) - 1) < 6 / np.sqrt(2 * leaf.size)
  # A pure function of (seed, step), fresh for each step and each seed.
  np.testing.assert_array_equal(z(0)[1], z0)
  for other in (z(1)[1], z(0, seed=1)[1]):
    assert abs(np.corrcoef(z0, other)[0, 1]) < 5 / np.sqrt(n)
  assert step.compile_count('apply') == 1


def test_compiles_once_across_steps_with_varying_k():
  params, (x, y) = _params(), _rows(40, seed=5)
  opt = optax.sgd(0.1, momentum=0.9)
  for private in (True, False):
    step = dp_step.DPStep.for_model(
      MODEL, opt, clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, private=private
    )
    opt_state, p = opt.init(params), params
    start = 0
    for t, k in enumerate((0, 1, 3, 0, 2, 1)):
      acc = step.init_accumulator(p)
      for _ in range(k):
        rows = slice(start % 36, start % 36 + 4)
        start += 4
        batch = {
          'x': x[rows],
          'y': y[rows],
          'weight': np.r_[np.ones(3), np.zeros(1)].astype(np.float32),
        }
        acc = step.accumulate(p, acc, batch)
      p, opt_state, metrics = step.apply(p, opt_state, acc, np.uint32(t))
      assert float(metrics['num_examples']) == 3 * k
    assert step.compile_count('accumulate') == 1
    assert step.compile_count('apply') == 1
    assert step.compile_count() == 2
    assert all(np.isfinite(l).all() for l in jax.tree.leaves(p))


@jax.jit
def _logits_and_losses(params, x, y):
  """The MLP's logits and per-example cross-entropy losses (jitted: one compilation)."""
  logits = MODEL.apply({'params': params}, x)
  return logits, optax.softmax_cross_entropy_with_integer_labels(logits, y)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _direct_metrics_reference(params, x, y, c, seed):
  """Per-example losses, logits, gradient norms and clipped gradients of the MLP, and the noise
  normals z_0 of prng.noise_key(seed, 0): one jitted program (eager, each op compiled alone)."""
  logits, example_losses = _logits_and_losses(params, x, y)
  loss_fn = losses.make_loss_fn(MODEL)
  grads = jax.vmap(
    jax.grad(lambda p, xi, yi: loss_fn(p, {'x': xi, 'y': yi})[0]), in_axes=(None, 0, 0)
  )(params, x, y)
  n = x.shape[0]
  norms = jnp.sqrt(
    sum(jnp.sum(jnp.reshape(g, (n, -1)) ** 2, axis=1) for g in jax.tree.leaves(grads))
  )
  clipped = jax.tree.map(lambda g: jnp.tensordot(jnp.minimum(1, c / norms), g, axes=1), grads)
  z = optax.tree.random_like(prng.noise_key(seed, 0), params, jax.random.normal)
  return logits, example_losses, norms, clipped, z


def test_metrics_match_direct_computation():
  params, (x, y) = _params(), _rows(10, seed=6)
  step = _standard_step()
  c, b, lr = step.clip_bound, step.expected_batch_size, 0.5
  new, _, m = _run_step(step, params, _physical_batches(x, y, 4))
  logits, example_losses, norms, clipped, z = jax.device_get(
    _direct_metrics_reference(params, x, y, c, step.seed)
  )
  np.testing.assert_allclose(m['loss'], np.mean(example_losses), rtol=1e-5)
  np.testing.assert_allclose(m['accuracy'], np.mean(logits.argmax(1) == y))
  assert int(m['num_clipped']) == int(np.sum(norms > c)) > 0
  np.testing.assert_allclose(m['example_grad_norm'], norms.mean(), rtol=1e-5)
  np.testing.assert_allclose(m['grad_norm'], _norm(clipped) / b, rtol=1e-5)
  # SGD: the update is −lr · ĝ, so ‖Δparams‖ / lr is the noisy gradient norm.
  delta = jax.tree.map(lambda u, v: np.asarray(u, np.float64) - v, jax.device_get(new), params)
  np.testing.assert_allclose(m['noisy_grad_norm'], _norm(delta) / lr, rtol=1e-4)
  # ĝ = (Σclip + σC·z_0)/b exactly, z_0 the normals of prng.noise_key(seed, 0) (σ off by
  # 1e-4 fails; the noise's distribution: tests/privacy/test_noise.py).
  sigma_c = step.noise_multiplier * step.clip_norm
  noisy = jax.tree.map(lambda s, n: (s + sigma_c * n) / b, clipped, z)
  np.testing.assert_allclose(m['noisy_grad_norm'], _norm(noisy), rtol=1e-5)


def _norm(tree):
  """The global L2 norm of a tree, in float64 on the host."""
  return np.sqrt(sum(np.sum(np.asarray(l, np.float64) ** 2) for l in jax.tree.leaves(tree)))


def test_nonfinite_example_does_not_poison_the_step():
  params, (x, y) = _params(), _rows(6, seed=7)
  bad_x = x.copy()
  bad_x[2] = np.inf
  step = _standard_step()
  new, _, m = _run_step(step, params, _physical_batches(bad_x, y, 6))
  keep = np.array([0, 1, 3, 4, 5])
  batch = _physical_batches(x[keep], y[keep], 6)  # Same real rows minus one.
  want, _, _ = _run_step(step, params, batch)
  assert int(m['num_nonfinite']) == 1
  assert np.isfinite(float(m['loss']))
  _assert_trees_close(new, want, rtol=1e-6, atol=1e-7)


def test_eval_step_sums_real_rows_only():
  params, (x, y) = _params(), _rows(7, seed=8)
  batch = _physical_batches(x, y, 10, garbage=True)[0]
  out = losses.eval_step(MODEL, params, batch)
  logits, example_losses = jax.device_get(_logits_and_losses(params, x, y))
  np.testing.assert_allclose(out['loss_sum'], np.sum(example_losses), rtol=1e-5)
  assert float(out['correct']) == np.sum(logits.argmax(1) == y)
  assert float(out['num_examples']) == 7
  one_hot = dict(batch, y=np.eye(K, dtype=np.float32)[batch['y']])
  out_oh = losses.eval_step(MODEL, params, one_hot, label_format='one_hot')
  np.testing.assert_allclose(out_oh['loss_sum'], out['loss_sum'], rtol=1e-6)


def test_one_hot_labels_give_the_same_step():
  params, (x, y) = _params(), _rows(6, seed=9)
  batch = _physical_batches(x, y, 8)[0]
  one_hot = dict(batch, y=np.eye(K, dtype=np.float32)[batch['y']])
  a, b = _standard_step(), _standard_step('one_hot')
  pa, _, ma = _run_step(a, params, [batch])
  pb, _, mb = _run_step(b, params, [one_hot])
  _assert_trees_close(pa, pb, rtol=1e-6, atol=1e-7)
  assert float(ma['accuracy']) == float(mb['accuracy'])


def test_keys_and_init_are_pure_functions_of_seed():
  data = jax.random.key_data
  k = data(prng.noise_key(3, 7))
  np.testing.assert_array_equal(k, data(prng.noise_key(3, 7)))
  others = [
    data(prng.noise_key(3, 8)),
    data(prng.noise_key(4, 7)),
    data(jax.random.fold_in(jax.random.PRNGKey(3), prng.INIT_STREAM)),
  ]
  assert all(not np.array_equal(k, o) for o in others)
  p1 = prng.init_params(MODEL, 3, (D,))
  p2 = prng.init_params(MODEL, 3, (D,))
  p3 = prng.init_params(MODEL, 4, (D,))
  jax.tree.map(np.testing.assert_array_equal, p1, p2)
  assert not np.array_equal(p1['Dense_0']['kernel'], p3['Dense_0']['kernel'])
  assert jax.tree.map(np.shape, p1) == jax.tree.map(np.shape, _params())
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError, match='seed'):
      prng.noise_key(bad, 0)
  with pytest.raises(ValueError, match='step'):
    prng.noise_key(0, -1)


@pytest.mark.parametrize(
  'kwargs,error,match',
  [
    (dict(expected_batch_size=0), ValueError, 'expected_batch_size'),
    (dict(expected_batch_size=math.inf), ValueError, 'expected_batch_size'),
    (dict(noise_multiplier=-1.0), ValueError, 'noise_multiplier'),
    (dict(noise_multiplier=None), ValueError, 'noise_multiplier'),
    (dict(noise_multiplier=math.nan), ValueError, 'noise_multiplier'),
    (dict(noise_multiplier=0.0), ValueError, 'noise_multiplier must be a finite number > 0'),
    (dict(clip_norm=0.0), ValueError, 'clip_norm must be a finite number > 0'),
    (dict(clip_norm=None), ValueError, 'clip_norm must be a finite number > 0'),
    (dict(clip_norm=math.inf), ValueError, 'clip_norm must be a finite number > 0'),
    (dict(label_format='onehot'), ValueError, 'label_format'),
    (dict(clipping='opacus'), ValueError, 'clipping'),
    (dict(clipping='opacus', private=False), ValueError, 'clipping'),
  ],
)
def test_bad_arguments_raise_before_compute(kwargs, error, match):
  args = dict(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8)
  args.update(kwargs)
  with pytest.raises(error, match=match):
    dp_step.DPStep.for_model(MODEL, optax.sgd(0.1), **args)


class _Scaled(nn.Module):
  """A parameter no ghost-clipping rule covers."""

  @nn.compact
  def __call__(self, x):
    return x * self.param('gain', nn.initializers.ones, (x.shape[-1],))


def test_ghost_on_an_uncovered_model_raises_before_compute():
  model = nn.Sequential([nn.Dense(4), _Scaled(), nn.Dense(K)])
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, D))))['params']
  params = jax.tree.map(lambda s: np.ones(s.shape, np.float32), params)
  step = dp_step.DPStep.for_model(
    model,
    optax.sgd(0.1),
    clip_norm=1.0,
    noise_multiplier=1.0,
    expected_batch_size=8,
    clipping='ghost',
  )
  batch = _physical_batches(*_rows(4), 4)[0]
  with pytest.raises(ValueError, match='layers_1/gain'):
    step.accumulate(params, step.init_accumulator(params), batch)


# --- The fused logical step: one program, one dispatch per logical step. ---


def _buffer(batches, k_max):
  """Stack physical batches into the [K_max, P, ...] buffer (zero-filled)."""
  buf = {
    name: np.zeros((k_max,) + np.shape(value), np.asarray(value).dtype)
    for name, value in batches[0].items()
  }
  for i, batch in enumerate(batches):
    for name, value in batch.items():
      buf[name][i] = value
  return buf


def _copy(tree):
  return jax.tree.map(np.array, tree)  # train_step donates its inputs.


_THREE_CALL_STEPS = ((3, 0), (0, 1), (2, 7))  # (K, t): K = 3 and 2 of K_max = 4, and none.


def _three_call_step(clipping_method, private, mesh, loop):
  return dp_step.DPStep.for_model(
    MODEL,
    optax.sgd(0.3, momentum=0.9),
    clip_norm=0.5,
    noise_multiplier=1.0,
    expected_batch_size=10,
    private=private,
    clipping=clipping_method,
    seed=5,
    mesh=sharding.make_mesh(1) if mesh else None,
    physical_loop=loop,
    allow_repeated_steps=True,
  )  # The two paths of one step, under one noise.


@functools.cache
def _three_call_path(clipping_method, private, mesh):
  """The device-loop step of a case and its three-call updates {(K, t): (params, opt_state,
  metrics)}, computed once: the host-loop case of the same step compares its train_step with
  them (`accumulate` and `apply` do not depend on the loop; the host loop runs two programs of
  its own), instead of compiling them again in a step of its own."""
  step = _three_call_step(clipping_method, private, mesh, 'device')
  params, (x, y) = _params(), _rows(10, seed=11)
  batches = _physical_batches(x, y, 4)
  opt_state = step.optimizer.init(params)
  wants = {
    (k, t): _run_step(step, params, batches[:k], t=t, optimizer_state=_copy(opt_state))
    for k, t in _THREE_CALL_STEPS
  }
  return step, wants


@pytest.mark.parametrize(
  'clipping_method,private,mesh,loop',
  [
    ('vmap', True, False, 'device'),
    ('ghost', True, False, 'device'),
    ('ghost', True, True, 'device'),
    ('vmap', False, False, 'device'),
    ('ghost', True, False, 'host'),
    ('ghost', True, True, 'host'),
  ],
)
def test_train_step_equals_the_three_call_path(clipping_method, private, mesh, loop):
  params, (x, y) = _params(), _rows(10, seed=11)
  step, wants = _three_call_path(clipping_method, private, mesh)
  if loop == 'host':
    step = _three_call_step(clipping_method, private, mesh, loop)
  batches = _physical_batches(x, y, 4)
  opt_state = step.optimizer.init(params)
  for k, t in _THREE_CALL_STEPS:
    want = wants[k, t]
    buf = _buffer(batches, 4)
    buf['weight'][k:] = 0  # Batches K.. must not be read: make them real.
    got = step.train_step(_copy(params), _copy(opt_state), buf, np.int32(k), np.uint32(t))
    for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2])):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for name in want[2]:
      np.testing.assert_allclose(got[2][name], want[2][name], rtol=1e-5, err_msg=name)
    assert float(got[2]['num_examples']) == min(10, 4 * k)
  assert step.loop_mode(params) == loop
  assert step.compile_count('train_step') == (1 if loop == 'device' else 2)


def test_auto_loop_runs_convolutions_from_the_host_on_the_cpu():
  """XLA:CPU is slow at conv weight gradients inside loops: 'auto' avoids them there."""
  step = _standard_step()
  assert step.physical_loop == 'auto'
  cnn = {'Conv_0': {'kernel': np.zeros((3, 3, 1, 4), np.float32)}}
  cpu = jax.default_backend() == 'cpu'
  assert step.loop_mode(_params()) == 'device'
  assert step.loop_mode(cnn) == ('host' if cpu else 'device')
  with pytest.raises(ValueError, match="physical_loop='gpu'; valid"):
    dp_step.DPStep.for_model(
      MODEL,
      optax.sgd(0.1),
      clip_norm=1.0,
      noise_multiplier=1.0,
      expected_batch_size=8,
      physical_loop='gpu',
    )


def test_train_step_draws_noise_key_seed_step_bit_for_bit():
  """K = 0, SGD(lr=1): the update is exactly −σC/b · normal(noise_key(seed, t))."""
  params = _params()
  step = dp_step.DPStep.for_model(
    MODEL,
    optax.sgd(1.0),
    clip_norm=0.5,
    noise_multiplier=1.0,
    expected_batch_size=10,
    seed=9,
    allow_repeated_steps=True,
  )  # Steps out of order: only the keys.
  buf = _buffer(_physical_batches(*_rows(4), 4), 2)
  opt_state = step.optimizer.init(params)
  for t in (0, 3, 2**31 + 5):
    fused, _, _ = step.train_step(_copy(params), _copy(opt_state), buf, np.int32(0), np.uint32(t))
    three, _, _ = step.apply(params, opt_state, step.init_accumulator(params), np.uint32(t))
    jax.tree.map(np.testing.assert_array_equal, fused, three)
  other, _, _ = step.train_step(_copy(params), _copy(opt_state), buf, np.int32(0), np.uint32(4))
  assert not np.array_equal(other['Dense_0']['kernel'], fused['Dense_0']['kernel'])


@functools.cache
def _digits_setup():
  """(train, dataset, model) of the digits MLP, loaded once for the samplers' test."""
  config = digits_mlp.get_config()
  train, _ = data.make_sources(config.data)
  model = models.make_model(config.model, train.num_classes, train.input_shape)
  return train, device_data.put_on_device(train), model


@functools.cache
def _every_samplers_cap():
  """The largest two-epoch cap B of any sampler of the digits config: with it every sampler's
  buffer [K_max, P] has one shape (the others get more padding slots)."""
  config, train = digits_mlp.get_config(), _digits_setup()[0]
  caps = []
  for name in samplers.SAMPLER_NAMES:
    config.sampler.name = name
    sampler = plan_lib.make_sampler(config, len(train))
    caps.append(
      batching.resolve_max_batch_size(
        sampler, 64, 0, num_steps=2 * sampler.steps_per_epoch, delta=1e-5
      )
    )
  return max(caps)


@functools.cache
def _sampler_step(expected_batch_size):
  """One DPStep per b for the samplers' test (each new DPStep traces, lowers and compiles its
  program again): the samplers with one b share its one program, which the test counts (a
  sampler whose steps needed another program would compile it again). Every case runs steps
  0, 1, ...: repeated steps allowed (a host-side check, not in the program)."""
  return dp_step.DPStep.for_model(
    _digits_setup()[2],
    optax.sgd(0.5),
    clip_norm=1.0,
    noise_multiplier=1.0,
    expected_batch_size=expected_batch_size,
    allow_repeated_steps=True,
  )


@pytest.mark.slow
@pytest.mark.parametrize('sampler_name', STEP_SAMPLERS)
def test_one_compilation_and_one_dispatch_per_logical_step(sampler_name, monkeypatch):
  """Two epochs of every sampler (K varies from step to step under Poisson): one program,
  executed once a step, never recompiled. The executions are counted where jax runs a
  compiled program (`tests.executions`), not by the test's own loop (`calls += 1` before, which
  could not fail): a step that runs a second program is seen (planted: an eager
  `jnp.asarray(step) + 0` in `train_step`: 36 executions for 12 steps; the old count passed).
  The samplers with one b share one DPStep (`_sampler_step`): its program is compiled once for
  all of them, and still counted as one."""
  train, dataset, model = _digits_setup()
  config = digits_mlp.get_config()
  config.sampler.name = sampler_name
  sampler = plan_lib.make_sampler(config, len(train))
  batcher = batching.Batcher(sampler, 64, _every_samplers_cap())
  step = _sampler_step(sampler.expected_batch_size)
  params = prng.init_params(model, 0, train.input_shape)
  opt_state = step.optimizer.init(params)
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: (
      compiles.append(name) if name == '/jax/core/compile/backend_compile_duration' else None
    )
  )
  ks, num_steps = set(), 2 * sampler.steps_per_epoch
  counts = executions.count_executions(monkeypatch)
  for t in range(num_steps):
    buf, k = device_data.index_buffer(
      batcher.logical_batch(t), batcher.max_physical_batches, num_rows=len(dataset)
    )
    ks.add(int(k))
    if t == 1:
      compiles.clear()  # Step 0 compiled the program (and nothing after).
    params, opt_state, metrics = step.train_step(params, opt_state, buf, k, np.uint32(t), dataset)
  jax.block_until_ready(metrics)
  if sampler_name == 'poisson':
    assert len(ks) > 1  # K really varied.
  assert counts == {'jit(logical_step)': num_steps}, counts  # The only program, once a step.
  assert step.compile_count() == 1
  assert step.compile_count('train_step') == 1
  assert compiles == []


@pytest.mark.slow
def test_choose_physical_batch_size_is_the_largest_that_fits():
  step = dp_step.DPStep.for_model(
    MODEL,
    optax.sgd(0.1),
    clip_norm=1.0,
    noise_multiplier=1.0,
    expected_batch_size=64,
    clipping='vmap',
  )
  params = _params()
  opt_state = step.optimizer.init(params)
  example = {'x': np.zeros(D, np.float32), 'y': np.int32(0)}
  # B = 16: buffers [4, 4], [2, 8], [1, 16], the only programs compiled (each search below
  # finds its P's bytes cached: one compilation per shapes).
  used = {
    p: physical_batch.compiled_step_bytes(step, params, opt_state, example, p, 16)
    for p in (4, 8, 16)
  }
  assert used[4] < used[8] < used[16]  # vmap: P per-example gradients.
  lines = []
  limit = (used[8] + used[16]) / 2
  chosen = physical_batch.choose_physical_batch_size(
    step,
    params,
    opt_state,
    example,
    16,
    num_devices=4,
    memory_bytes=limit,
    fraction=1.0,
    log=lines.append,
  )
  assert chosen == 8 and lines[-1].endswith('chose P = 8.')
  assert [l.split(':')[0] for l in lines[:-1]] == [f'physical batch size {p}' for p in (4, 8, 16)]
  # Everything fits: stops at the first power-of-two multiple of D >= B (B = 10 -> 16).
  lines = []
  assert (
    physical_batch.choose_physical_batch_size(
      step, params, opt_state, example, 10, num_devices=16, memory_bytes=2**40, log=lines.append
    )
    == 16
  )
  assert len(lines) == 2
  with pytest.raises(ValueError, match='physical_batch_size = 4 .* needs'):
    physical_batch.choose_physical_batch_size(
      step, params, opt_state, example, 16, num_devices=4, memory_bytes=1, log=lambda _: None
    )
  with pytest.raises(ValueError, match='max_batch_size must be an int >= 1'):
    physical_batch.choose_physical_batch_size(step, params, opt_state, example, 0)
  assert step.sizing_compiles == 3  # The searches compiled nothing new.


# test_train_step_on_four_devices_equals_one_device: in tests/privacy/test_sharding.py, whose
# 4-device child process computes it (one child process instead of two).


def test_apply_refuses_a_repeated_step():
  """Fails on da06065: `apply` noised step t twice. The attack it allowed: two sums released
  under the noise of one (seed, t) differ by exactly lr·(S − S')/b, noise-free, so an observer
  of both updates reads the difference of the clipped sums (here, whether a row was in)."""
  params, (x, y) = _params(), _rows(6, seed=3)
  step = dp_step.DPStep.for_model(
    MODEL, optax.sgd(1.0), clip_norm=0.5, noise_multiplier=1.0, expected_batch_size=4
  )
  opt_state, acc = step.optimizer.init(params), step.init_accumulator(params)
  first, _, _ = step.apply(params, opt_state, step.init_accumulator(params), np.uint32(2))
  for t in (2, 1):  # The same step, then an earlier one: refused before any compute.
    with pytest.raises(
      ValueError,
      match=rf'^DPStep: step {t} is not after step 2, the '
      'last one noised',
    ):
      step.apply(params, opt_state, acc, np.uint32(t))
  later, _, _ = step.apply(params, opt_state, acc, np.uint32(3))  # acc was not donated.
  assert not np.allclose(first['Dense_0']['kernel'], later['Dense_0']['kernel'])
  # What the refusal prevents, on the tests' step that is told to allow it (lr 0.5, b = 10).
  replay = _standard_step()
  with_row, without_row = _physical_batches(x, y, 8), _physical_batches(x[1:], y[1:], 8)
  a, _, _ = _run_step(replay, params, with_row, t=2)
  b, _, _ = _run_step(replay, params, without_row, t=2)
  sums = []
  for batches in (with_row, without_row):
    acc = replay.init_accumulator(params)
    for batch in batches:
      acc = replay.accumulate(params, acc, batch)
    sums.append(acc.grad_sum)
  _assert_trees_close(
    jax.tree.map(lambda u, v: np.asarray(u) - np.asarray(v), b, a),
    jax.tree.map(lambda s, r: 0.5 * (np.asarray(s) - np.asarray(r)) / 10, *sums),
    rtol=1e-4,
    atol=1e-6,
  )


def test_train_step_refuses_a_step_it_already_noised():
  """The attacker's road after the merge: `train_step` (one compiled logical step) had no
  check, so two logical steps told t = 0 drew one noise and the neighbours' released updates
  differed by lr·clip(g_r)/b within 4.5e-8 (attacks/a3 on the branch `attack`). Now it keeps
  the same order as `apply`: each step once, forward only, in one DPStep."""
  params = _params()
  step = dp_step.DPStep.for_model(
    MODEL, optax.sgd(1.0), clip_norm=0.5, noise_multiplier=1.0, expected_batch_size=10, seed=9
  )
  buf = _buffer(_physical_batches(*_rows(4), 4), 2)
  opt_state = step.optimizer.init(params)
  step.train_step(params, opt_state, buf, np.int32(1), np.uint32(0))
  with pytest.raises(ValueError, match=r'^DPStep: step 0 is not after step 0'):
    step.train_step(params, opt_state, buf, np.int32(1), np.uint32(0))
  with pytest.raises(ValueError, match=r'^DPStep: step 0 is not after step 0'):
    step.apply(params, opt_state, step.init_accumulator(params), np.uint32(0))
  step.train_step(params, opt_state, buf, np.int32(1), np.uint32(1))  # The next one runs.


def test_accumulate_takes_weights_into_zero_one_as_clipped_grad_does():
  """A caller's own weights (DPStep outside the trainer): a weight of 17 multiplied a row's
  contribution to 17·C and a negative one subtracted a row; now each row adds at most C,
  as in `clipping.clipped_grad` (review of the merge: only the library's function clamped)."""
  params, (x, y) = _params(), _rows(3, seed=7)
  x = x * 1e3  # Every row's gradient is far above C.
  step = _standard_step()
  for weight, bound in ((17.0, 0.5), (-5.0, 0.0), (np.nan, 0.0)):
    batch = {'x': x[:1], 'y': y[:1], 'weight': np.array([weight], np.float32)}
    acc = step.accumulate(params, step.init_accumulator(params), batch)
    norm = _norm(acc.grad_sum)
    assert norm <= bound * (1 + 1e-6) and (bound == 0 or norm > 0.99 * bound), (weight, norm)


def test_a_mesh_is_a_sharding_of_the_one_program():
  """Issue 35, item 1: mesh or no mesh is a sharding argument of one traced body (before, each
  of six programs was written twice). A 1-device mesh and none give the same update, bit for
  bit, from one compilation each."""
  rng = np.random.default_rng(4)
  params = {'w': rng.normal(size=D).astype(np.float32)}
  buf = {
    'x': rng.normal(size=(3, 4, D)).astype(np.float32),
    'y': rng.normal(size=(3, 4)).astype(np.float32),
    'weight': np.ones((3, 4), np.float32),
  }
  loss_fn = lambda p, ex: 0.5 * (jnp.dot(ex['x'], p['w']) - ex['y']) ** 2
  privatizer = noise.GaussianPrivatizer.gaussian(1.0, 0.5, 6.0, seed=3)
  out = {}
  for name, mesh in (('none', None), ('mesh', sharding.make_mesh(1))):
    options = dp_step.StepOptions(mesh=mesh, physical_loop='device')
    step = dp_step.DPStep(loss_fn, optax.sgd(0.4), privatizer, clipping='vmap', options=options)
    state = step.init_opt_state(params)
    out[name] = step.train_step(_copy(params), state, _copy(buf), 2, np.uint32(1))
    assert step.compile_count() == step.compile_count('train_step') == 1
  jax.tree.map(np.testing.assert_array_equal, out['none'], out['mesh'])
  assert np.abs(np.asarray(out['none'][0]['w']) - params['w']).sum() > 0.01


def _antithetic_privatizer(*args):
  """A stateful privatizer written only here: ĝ_t = (Σ + σC(z_t − z_{t−1})) / b with z_{−1} = 0,
  its state z_{t−1} carried from step to step (the shape of a correlated-noise mechanism)."""

  class Antithetic(noise.GaussianPrivatizer):
    stateful = True

    def init(self, params):
      return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)

    def release(self, grad_sum, state, step, key_data):
      key = prng.step_noise_key(key_data, step)
      z = optax.tree.random_like(key, grad_sum, jax.random.normal)
      noisy = jax.tree.map(lambda s, a, b: s + self.noise_std * (a - b), grad_sum, z, state)
      return jax.tree.map(lambda g: g / self.expected_batch_size, noisy), z

  return Antithetic(*args)


def test_a_stateful_privatizer_is_one_new_object_and_nothing_else():
  """The privatizer is the step's extension point (issue 35, item 1): a mechanism with its own
  state (here antithetic noise) runs by passing it to `DPStep`; its state is carried beside
  the optimiser's across steps. With K = 0 and SGD(lr = 1) the noise telescopes: after steps
  0..t, θ = θ₀ − σC·z_t/b, z_t drawn here from `prng.noise_key(seed, t)`."""
  sigma, c, b, seed = 1.5, 0.5, 4.0, 11
  privatizer = _antithetic_privatizer(sigma, c, b, seed)
  loss_fn = lambda p, ex: 0.5 * (jnp.dot(ex['x'], p['w']) - ex['y']) ** 2
  step = dp_step.DPStep(loss_fn, optax.sgd(1.0), privatizer, clipping='vmap')
  params = {'w': np.linspace(-1, 1, 5).astype(np.float32)}
  buf = {
    'x': np.ones((1, 2, 5), np.float32),
    'y': np.ones((1, 2), np.float32),
    'weight': np.ones((1, 2), np.float32),
  }
  state = step.init_opt_state(params)
  p = _copy(params)
  for t in range(3):
    p, state, _ = step.train_step(p, state, _copy(buf), 0, np.uint32(t))
    z = optax.tree.random_like(prng.noise_key(seed, t), params, jax.random.normal)
    np.testing.assert_allclose(p['w'], params['w'] - sigma * c * z['w'] / b, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(state[0]['w'], z['w'])
  assert step.compile_count('train_step') == 1


def test_the_physical_batch_search_reads_no_private_attribute_of_the_step():
  """Memory sizing is public (`DPStep.compiled_bytes`): trainer/planning/physical_batch.py reaches no
  `obj._attr` of another object (it read and wrote `DPStep._step_bytes`, `_traces` and
  `_train_step`, 7 accesses, on da06065)."""
  tree = ast.parse(pathlib.Path(physical_batch.__file__).read_text())
  reaches = [
    f'{ast.unparse(n.value)}.{n.attr} (line {n.lineno})'
    for n in ast.walk(tree)
    if isinstance(n, ast.Attribute) and n.attr.startswith('_') and not n.attr.startswith('__')
  ]
  assert reaches == []
