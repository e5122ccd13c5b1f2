"""The BLT privatizer against an independent float64 computation of C⁻¹z (`blt.inverse_apply`
and a dense triangular solve), the noise covariance (CᵀC)⁻¹ its strategy states, resume from
its state, the DP step, its state's size and its refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import linalg

from dpjax.privacy import correlated_noise
from dpjax.privacy import correlated_optax
from dpjax.privacy import noise
from dpjax.privacy import noise_state
from dpjax.privacy import privacy_plan
from dpjax.privacy import samplers
from dpjax.privacy.correlated import blt
from dpjax.privacy.correlated import strategy
from tests.privacy import step_vs_library

SEED = 4321
STEPS = 7
# Two buffers, c_1 = ω_0 + ω_1 = 0.6 and both decays far from 0 and 1: a wrong decay, weight,
# update order or scale changes the released noise by O(1).
THETA, OMEGA = (0.9, 0.3), (0.4, 0.2)
STRATEGY = strategy.Strategy(
  'blt',
  STEPS,
  decays=THETA,
  weights=OMEGA,
  scale=1.0 / np.linalg.norm(blt.coefs(blt.BLT(np.array(THETA), np.array(OMEGA)), STEPS)),
)
SIGMA, CLIP, B = 1.3, 0.7, 16.0


def _params(size=4000):
  return {'w': jnp.zeros((size // 4, 4), jnp.float32), 'b': jnp.zeros((7,), jnp.float32)}


def _privatizer(seed=SEED, sigma=SIGMA, clip=CLIP, b=B):
  return STRATEGY.privatizer(sigma, clip, b, seed)


_run = step_vs_library.release_steps


def _flat(tree):
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def _dp_sgd_normals(params, steps):
  """DP-SGD's standard normals z_t of (SEED, t), from the Gaussian privatizer's release."""
  gaussian = noise.GaussianPrivatizer.gaussian(SIGMA, CLIP, B, SEED)
  return np.stack(
    [
      _flat(gaussian.release(params, None, np.uint32(t), gaussian.key_data())[0])
      for t in range(steps)
    ]
  ) * (B / (SIGMA * CLIP))


def test_zero_gradient_releases_are_c_inverse_of_dp_sgds_draws():
  """With Σ_t = 0, b·ĝ/(σC) over the n steps is C⁻¹Z for the normalised C = scale·C_blt, Z the
  Gaussian privatizer's z of the same (seed, t): against blt.inverse_apply / scale (float64,
  the recursion's NumPy reference) and a float64 triangular solve with the dense C (which
  `Strategy.dense` builds from the coefficients, not the recursion). A wrong sign, a buffer
  updated before it is read, a missing scale or a weight applied to the wrong decay is O(1)."""
  params = _params(400)
  ours, _ = _run(_privatizer(), params, [params] * STEPS)
  released = np.stack([_flat(g) for g in ours]) * B / (SIGMA * CLIP)
  z = _dp_sgd_normals(params, STEPS)
  by_dense = linalg.solve_triangular(STRATEGY.dense(), z, lower=True)
  by_recursion = blt.inverse_apply(blt.BLT(np.array(THETA), np.array(OMEGA)), z) / STRATEGY.scale
  np.testing.assert_allclose(by_recursion, by_dense, rtol=1e-10, atol=1e-10)
  np.testing.assert_allclose(released, by_dense, rtol=2e-5, atol=2e-5)


def test_noise_covariance_across_steps_is_the_strategys():
  """Cov of σC·(C⁻¹z) over steps is σ²C²(CᵀC)⁻¹ (C the normalised strategy): estimated from
  8000 i.i.d. coordinates of one seed's zero-gradient run, every entry within 5 standard
  errors ((Σ_ii Σ_jj + Σ_ij²)/n). DP-SGD's white noise is off by > 20 errors somewhere."""
  params, steps = _params(8000), STEPS
  ours, _ = _run(_privatizer(), params, [params] * steps)
  noise_ = np.stack([_flat(g) for g in ours]) * B
  n = noise_.shape[1]
  empirical = noise_ @ noise_.T / n
  c = STRATEGY.dense()
  expected = (SIGMA * CLIP) ** 2 * np.linalg.inv(c.T @ c)
  stderr = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected**2) / n)
  assert np.all(np.abs(empirical - expected) <= 5 * stderr), (empirical - expected) / stderr
  white = (SIGMA * CLIP) ** 2 * np.eye(steps)
  assert np.max(np.abs(white - empirical) / stderr) > 20


def test_resume_from_a_host_copy_of_the_state_is_bit_identical():
  """Steps 0-6 straight vs 0-2, the state through numpy, then 3-6: the same bits (the buffers
  are the recursion's only memory; a state missing one buffer or its step differs)."""
  params = _params(400)
  sums = [jax.tree.map(lambda p, t=t: p + 0.01 * t, params) for t in range(STEPS)]
  straight, _ = _run(_privatizer(), params, sums)
  first, state = _run(_privatizer(), params, sums[:3])
  saved = jax.tree.map(np.asarray, state)
  second, _ = _run(
    _privatizer(), params, sums[3:], start_state=jax.tree.map(jnp.asarray, saved), first=3
  )
  for a, b in zip(straight, first + second):
    np.testing.assert_array_equal(_flat(a), _flat(b))


def test_a_step_out_of_order_or_past_the_strategy_is_refused_with_nan():
  """Step 1 first, or step n (C is normalised for n steps only: its first column would grow
  past norm 1): NaN and a refused state."""
  params = _params(40)
  mechanism = _privatizer()
  g, state = mechanism.release(params, mechanism.init(params), np.uint32(1), mechanism.key_data())
  assert np.all(np.isnan(_flat(g))) and int(state.step) == noise_state.REFUSED
  state = mechanism.init(params)._replace(step=jnp.uint32(STEPS))
  g, state = mechanism.release(params, state, np.uint32(STEPS), mechanism.key_data())
  assert np.all(np.isnan(_flat(g))) and int(state.step) == noise_state.REFUSED
  g, state = mechanism.release(params, state, np.uint32(0), mechanism.key_data())
  assert np.all(np.isnan(_flat(g))) and int(state.step) == noise_state.REFUSED


def test_optax_transform_needs_the_step_and_matches_the_mechanism():
  params = _params(40)
  tx = correlated_optax.blt_privatizer(THETA, OMEGA, STRATEGY.scale, STEPS, SIGMA, CLIP, B, SEED)
  state = tx.init(params)
  with pytest.raises(TypeError, match='step=t'):
    tx.update(params, state)
  released, state = tx.update(params, state, step=0)
  mechanism = _privatizer()
  expected, _ = mechanism.release(params, mechanism.init(params), 0, mechanism.key_data())
  np.testing.assert_array_equal(_flat(released), _flat(expected))
  assert int(state.step) == 1


def test_state_bytes_are_buffers_copies_of_the_parameters():
  """d × params × 4 bytes (a bfloat16 leaf's buffers are float32), as `init` allocates."""
  params = {'a': jnp.zeros((10, 3), jnp.float32), 'b': jnp.zeros((5,), jnp.bfloat16)}
  mechanism = _privatizer()
  assert mechanism.state_bytes(params) == 2 * (30 + 5) * 4 == 280
  assert sum(x.nbytes for x in jax.tree.leaves(mechanism.init(params).buffers)) == 280
  assert STRATEGY.state_vectors == mechanism.num_buffers == 2


@pytest.mark.parametrize(
  'decays, weights, scale, match',
  [
    ((1.0,), (0.5,), 1.0, 'decays must be numbers in'),
    ((0.5,), (-0.1,), 1.0, 'weights finite numbers >= 0'),
    ((0.5,), (0.5,), 1.0, 'unit max column norm'),  # C_blt itself: column norm > 1.
    ((0.5,), (0.5,), -1.0, 'scale must be'),
  ],
)
def test_bad_parameters_get_one_line(decays, weights, scale, match):
  with pytest.raises(ValueError, match=match):
    correlated_noise.BLTPrivatizer.blt(decays, weights, scale, STEPS, SIGMA, CLIP, B, SEED)


def test_the_dp_step_carries_the_state_and_equals_the_library_loop():
  """`DPStep(loss_fn, optimizer, BLTPrivatizer)` carries the buffers in the optimiser state; for
  one seed and the same batches its parameters equal `clipped_grad` + `GradSum` +
  `blt_privatizer` + the optimizer's: the trainer's step and the library release the same
  correlated noise."""
  c, seed = 0.3, 2**33 + 1
  state, lib_state = step_vs_library.run_both(
    STRATEGY.privatizer(SIGMA, c, 6.0, seed),
    correlated_optax.blt_privatizer(THETA, OMEGA, STRATEGY.scale, STEPS, SIGMA, c, 6.0, seed),
    c,
  )
  assert int(state[0].step) == 4 and int(lib_state[0].step) == 4
  buffers = np.asarray(state[0].buffers['w'])
  np.testing.assert_allclose(buffers, np.asarray(lib_state[0].buffers['w']), rtol=2e-6, atol=1e-7)
  assert buffers.shape == (2, step_vs_library.D) and np.all(buffers != 0)


def test_a_blt_plan_makes_its_strategy_from_num_buffers():
  """`PrivacyPlan.create(..., noise='blt', num_buffers=2)` on a deterministic sampler: the plan
  makes the BLT strategy for its T steps once; its privatizer is that strategy's (BLT state) and
  its accountant accounts it by its sensitivity (the matrix mechanism); 'blt' without buffers
  is one line."""
  sampler = samplers.make('deterministic', 60, 20)
  plan = privacy_plan.PrivacyPlan.create(
    sampler,
    num_steps=6,
    clip_norm=1.0,
    noise_multiplier=2.0,
    delta=1e-5,
    noise='blt',
    num_buffers=2,
  )
  assert plan.strategy == strategy.for_run('blt', 6, num_buffers=2)
  assert plan.accountant.options.strategy is plan.strategy
  assert isinstance(plan.mechanism(), correlated_noise.BLTPrivatizer)
  state = plan.privatizer().init({'w': jnp.zeros(3)})
  assert isinstance(state, correlated_noise.BLTNoiseState)
  assert plan.epsilon_at(6).details['strategy_sensitivity_exact'] is True
  with pytest.raises(ValueError, match='needs num_buffers'):
    privacy_plan.PrivacyPlan.create(
      sampler, num_steps=6, clip_norm=1.0, noise_multiplier=2.0, delta=1e-5, noise='blt'
    )
