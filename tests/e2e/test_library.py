"""The library tiers: clipped_grad, the Gaussian privatizer, PrivacyPlan's pieces, the exports."""

import dataclasses
import math
import pydoc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import dpjax
from dpjax.privacy import noise
from dpjax.privacy import precision
from dpjax.privacy import prng
from dpjax.privacy import rounding


def _params():
  return {'w': jnp.zeros((3, 4)), 'b': jnp.zeros((4,))}


def test_privatizer_draws_the_dp_step_noise_of_seed_and_step():
  """ĝ_t = (sum + σC·z_t) / b with z_t from prng.noise_key(seed, t): DPStep's noise."""
  sigma, c, b, seed = 1.3, 0.7, 50.0, 2**40 + 17
  tx = dpjax.gaussian_privatizer(sigma, c, b, seed)
  state = tx.init(_params())
  total = jax.tree.map(lambda p: jnp.full(p.shape, 2.0), _params())
  for t in range(3):
    out, state = tx.update(total, state, step=t)
    z = optax.tree.random_like(prng.noise_key(seed, t), total, jax.random.normal)
    want = jax.tree.map(lambda s, n: (s + sigma * c * n) / b, total, z)
    jax.tree.map(lambda a, w: np.testing.assert_allclose(a, w, rtol=1e-6), out, want)
  assert isinstance(state, dpjax.GaussianNoiseState) and int(state.step) == 3


def test_privatizer_resumes_from_its_state_exactly():
  tx = optax.chain(dpjax.gaussian_privatizer(1.0, 1.0, 10.0, seed=5), optax.adam(0.1))
  grads = jax.tree.map(jnp.ones_like, _params())
  params, state = _params(), tx.init(_params())
  saved = None
  for t in range(4):
    if t == 2:
      saved = (params, jax.tree.map(np.asarray, state))  # A checkpoint (arrays only).
    updates, state = tx.update(grads, state, params, step=t)
    params = optax.apply_updates(params, updates)
  p2, s2 = saved
  for t in range(2, 4):
    updates, s2 = tx.update(grads, s2, p2, step=t)
    p2 = optax.apply_updates(p2, updates)
  jax.tree.map(np.testing.assert_array_equal, params, p2)


@pytest.mark.parametrize('impl', ['threefry', 'rbg', 'unsafe_rbg'])
def test_noise_is_gaussian_with_std_sigma_c(impl):
  """χ² test of the variance and KS test of normality on 200,000 coordinates (fixed seed)."""
  sigma, c, b, n = 2.0, 0.5, 4.0, 200_000
  tx = dpjax.gaussian_privatizer(sigma, c, b, seed=11, noise_impl=impl)
  out, _ = tx.update({'v': jnp.zeros(n)}, tx.init({'v': jnp.zeros(n)}), step=0)
  z = np.asarray(out['v'], np.float64) * b / (sigma * c)
  chi2 = np.sum(z**2)
  assert stats.chi2.cdf(chi2, n) > 1e-4 and stats.chi2.sf(chi2, n) > 1e-4
  assert stats.kstest(z, 'norm').pvalue > 1e-4


def test_bad_arguments_are_refused_naming_them():
  for kwargs, name in (
    ({'noise_multiplier': 0.0}, 'noise_multiplier'),
    ({'clip_norm': math.inf}, 'clip_norm'),
    ({'clip_norm': 0.0}, 'clip_norm'),
    ({'expected_batch_size': 0}, 'expected_batch_size'),
  ):
    args = dict(noise_multiplier=1.0, clip_norm=1.0, expected_batch_size=10, seed=0) | kwargs
    with pytest.raises(ValueError, match=name):
      dpjax.gaussian_privatizer(**args)
  with pytest.raises(ValueError, match='noise PRNG'):
    dpjax.gaussian_privatizer(1.0, 1.0, 10, seed=0, noise_impl='mt19937')
  with pytest.raises(ValueError, match='clip_norm'):
    dpjax.clipped_grad(lambda p, e: 0.0, math.inf)


def _loss(params, example):
  return jnp.sum((example['x'] @ params['w'] + params['b'] - example['y']) ** 2)


@pytest.mark.parametrize('method', ['vmap', 'auto'])
def test_neighbouring_sums_differ_by_at_most_c(method):
  """The attack on the clipped sum: D and D minus one outlier; ‖S(D) − S(D')‖ ≤ C(1 + η),
  the sensitivity the plan's accountant pays for (`rounding.eta` of 16 rows)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 3)).astype(np.float32)
  y = rng.normal(size=(16, 4)).astype(np.float32)
  x[5] *= 1e4  # The outlier's gradient is huge.
  c = 0.3
  grad_fn = jax.jit(dpjax.clipped_grad(_loss, c, method=method))
  params = {'w': jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), 'b': jnp.zeros(4)}
  with_outlier, rows = grad_fn(params, {'x': x, 'y': y}, np.ones(16, np.float32))
  without = np.ones(16, np.float32)
  without[5] = 0
  absent, _ = grad_fn(params, {'x': x, 'y': y}, without)
  diff = math.sqrt(
    sum(
      float(jnp.sum((a - b) ** 2))
      for a, b in zip(jax.tree.leaves(with_outlier), jax.tree.leaves(absent))
    )
  )
  assert diff <= c * (1 + rounding.eta(16, precision.matmul_format('default')))
  assert diff > 0.99 * c  # The outlier was clipped to the bound, not dropped.
  assert float(rows.norm[5]) > 1e3 * c


def test_ghost_clipped_grad_of_a_linen_model_equals_vmap():
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  model = nn.Dense(4)
  rng = np.random.default_rng(1)
  x = rng.normal(size=(8, 3)).astype(np.float32)
  y = rng.normal(size=(8, 4)).astype(np.float32)
  params = model.init(jax.random.key(0), x[:1])['params']
  loss = lambda p, e: jnp.sum((model.apply({'params': p}, e['x']) - e['y']) ** 2)
  with jax.default_matmul_precision('highest'):
    ghost_fn = dpjax.clipped_grad(loss, 0.5, method='ghost')
    ones = np.ones(8, np.float32)
    a, _ = jax.jit(ghost_fn)(params, {'x': x, 'y': y}, ones)
    b, _ = jax.jit(dpjax.clipped_grad(loss, 0.5, method='vmap'))(params, {'x': x, 'y': y}, ones)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), a, b)
  assert 'ghost clipping' in ghost_fn.choice[0]


def test_plan_pieces_share_its_sigma_c_cap_and_seed():
  sampler = dpjax.PoissonSampler(num_examples=1000, batch_size=50, seed=123)
  plan = dpjax.PrivacyPlan.create(
    sampler, num_steps=40, clip_norm=0.8, noise_multiplier=1.1, delta=1e-5
  )
  grad_fn = plan.clipped_grad(_loss)
  assert grad_fn.clip_bound == 0.8  # C itself; its float rounding η is in ε:
  assert (
    plan.accountant.sensitivity
    == 1 + plan.rounding.eta
    == 1 + rounding.eta(plan.max_batch_size, precision.matmul_format('default'))
  )
  tx = plan.privatizer()
  out, _ = tx.update({'v': jnp.zeros(5)}, tx.init({'v': jnp.zeros(5)}), step=0)
  z = optax.tree.random_like(prng.noise_key(123, 0), {'v': jnp.zeros(5)}, jax.random.normal)
  np.testing.assert_allclose(out['v'], 1.1 * 0.8 * z['v'] / 50.0, rtol=1e-6)
  assert plan.batcher(16, tx.init({})).max_batch_size == plan.max_batch_size
  report = plan.epsilon_at(40)
  assert report.bound == 'upper' and 0 < report.epsilon < 10
  with pytest.raises(ValueError, match='noise_multiplier'):
    dpjax.PrivacyPlan.create(sampler, num_steps=40, clip_norm=0.8, noise_multiplier=0.0, delta=1e-5)
  with pytest.raises(ValueError, match='delta'):
    dpjax.PrivacyPlan.create(sampler, num_steps=40, clip_norm=0.8, noise_multiplier=1.0, delta=0.01)


def test_the_privatizer_noises_each_step_once_in_order_and_only_its_plans_state():
  """Fails on da06065: the privatizer took no step and drew the noise of its own counter, so a
  loop could noise a batch twice or pair batch t with noise t' silently.

  The attack on a repeated step: two sums S, S' released under the noise of one t differ by
  exactly (S − S')/b. Now the update told a t other than the state's releases NaN (the jitted
  call cannot raise), the state stays refused, and the host check says so in one line.
  """
  sampler = dpjax.PoissonSampler(num_examples=1000, batch_size=50, seed=1)
  plan = dpjax.PrivacyPlan.create(
    sampler, num_steps=10, clip_norm=1.0, noise_multiplier=1.0, delta=1e-5
  )
  tx = optax.chain(plan.privatizer(), optax.sgd(1.0))
  update = jax.jit(lambda g, s, t: tx.update(g, s, None, step=t))
  zero, one = {'v': jnp.zeros(4)}, {'v': jnp.ones(4)}
  state = tx.init(zero)
  released, state = update(zero, state, 0)
  assert int(state[0].step) == 1 and np.isfinite(released['v']).all()
  again, refused = update(one, state, 0)  # Step 0 again, with another sum.
  assert np.isnan(again['v']).all() and int(refused[0].step) == 2**32 - 1
  after, _ = update(one, refused, 1)  # Refused for good.
  assert np.isnan(after['v']).all()
  with pytest.raises(ValueError, match='^this privatizer state refused an update'):
    plan.batcher(16, refused)
  skipped, _ = update(one, state, 2)
  assert np.isnan(skipped['v']).all()
  other = dpjax.PrivacyPlan.create(
    dataclasses.replace(sampler, seed=2),
    num_steps=10,
    clip_norm=1.0,
    noise_multiplier=1.0,
    delta=1e-5,
  )
  foreign, _ = update(one, optax.chain(other.privatizer(), optax.sgd(1.0)).init(zero), 0)
  assert np.isnan(foreign['v']).all()
  with pytest.raises(
    ValueError,
    match=r'^the privatizer state was not made by the plan: the '
    r'fingerprint \(sampler, N, b',
  ):
    other.batcher(16, state)
  with pytest.raises(TypeError, match='needs step=t'):
    tx.update(one, state, None)
  assert plan.batcher(16, state).next_step == 1


def test_help_shows_the_three_tiers_and_every_export_exists():
  text = pydoc.render_doc(dpjax, renderer=pydoc.plaintext)
  for tier in ('Tier 1', 'Tier 2', 'Tier 3'):
    assert tier in text
  for name in dpjax.__all__:
    assert getattr(dpjax, name) is not None
    assert name in text, name
