"""The banded (BandMF) privatizer against an independent float64 computation of C⁻¹z, the noise
covariance (CᵀC)⁻¹ its strategy states, DP-SGD at one band, and resume from its state."""

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
from tests.privacy import step_vs_library

SEED = 1234
# Three bands, unit norm, c_0 ≠ 1 (the division by c_0 is exercised), CᵀC ≥ 0.
COEFS = tuple(np.array([1.0, 0.6, 0.3]) / np.linalg.norm([1.0, 0.6, 0.3]))
SIGMA, CLIP, B = 1.3, 0.7, 16.0


def _params(size=4000):
  return {'w': jnp.zeros((size // 4, 4), jnp.float32), 'b': jnp.zeros((7,), jnp.float32)}


_run = step_vs_library.release_steps


def _dense_toeplitz(coefs, n):
  col = np.zeros(n)
  col[: len(coefs)] = coefs
  return linalg.toeplitz(col, np.zeros(n))


def _flat(tree):
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def test_one_band_is_the_gaussian_privatizer_bit_for_bit():
  """C = I: the release is DP-SGD's, the same z of (seed, t), the same arithmetic."""
  params = _params(400)
  sums = [jax.tree.map(lambda p, t=t: p + 0.1 * t + 1.0, params) for t in range(3)]
  banded = correlated_noise.BandedPrivatizer.banded((1.0,), SIGMA, CLIP, B, SEED)
  gaussian = noise.GaussianPrivatizer.gaussian(SIGMA, CLIP, B, SEED)
  ours, _ = _run(banded, params, sums)
  release = jax.jit(gaussian.release)  # Both compiled, as the step runs them.
  for t, grad_sum in enumerate(sums):
    theirs, _ = release(grad_sum, None, np.uint32(t), gaussian.key_data())
    for a, b in zip(jax.tree.leaves(ours[t]), jax.tree.leaves(theirs)):
      np.testing.assert_array_equal(a, b)


def test_zero_gradient_releases_are_c_inverse_of_dp_sgds_draws():
  """With Σ_t = 0, b·ĝ/(σC) stacked over T steps is C⁻¹ Z, Z the Gaussian privatizer's standard
  normals of the same (seed, t): against a float64 triangular solve with the dense C. A wrong
  sign, band order, missing division by c_0 or a history not shifted differs by O(1)."""
  params, steps = _params(400), 7
  zeros = [params] * steps
  banded = correlated_noise.BandedPrivatizer.banded(COEFS, SIGMA, CLIP, B, SEED)
  ours, _ = _run(banded, params, zeros)
  released = np.stack([_flat(g) for g in ours]) * B / (SIGMA * CLIP)
  gaussian = noise.GaussianPrivatizer.gaussian(SIGMA, CLIP, B, SEED)
  z = np.stack(
    [
      _flat(gaussian.release(params, None, np.uint32(t), gaussian.key_data())[0])
      for t in range(steps)
    ]
  ) * (B / (SIGMA * CLIP))
  expected = linalg.solve_triangular(_dense_toeplitz(COEFS, steps), z, lower=True)
  np.testing.assert_allclose(released, expected, rtol=2e-5, atol=2e-5)


def test_noise_covariance_across_steps_is_the_strategys():
  """Cov of σC·(C⁻¹z) over steps is σ²C²(CᵀC)⁻¹: estimated from 8000 i.i.d. coordinates of one
  seed's zero-gradient run, every entry within 5 standard errors (Var of an empirical
  covariance: (Σ_ii Σ_jj + Σ_ij²)/n). Uncorrelated noise (DP-SGD's I) is off by > 20 errors in
  the first sub-diagonal."""
  params, steps = _params(8000), 6
  banded = correlated_noise.BandedPrivatizer.banded(COEFS, SIGMA, CLIP, B, SEED)
  ours, _ = _run(banded, params, [params] * steps)
  noise_ = np.stack([_flat(g) for g in ours]) * B  # [T, d]
  n = noise_.shape[1]
  empirical = noise_ @ noise_.T / n
  c = _dense_toeplitz(COEFS, steps)
  expected = (SIGMA * CLIP) ** 2 * np.linalg.inv(c.T @ c)
  stderr = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected**2) / n)
  assert np.all(np.abs(empirical - expected) <= 5 * stderr), (empirical - expected) / stderr
  white = (SIGMA * CLIP) ** 2 * np.eye(steps)
  assert np.max(np.abs(white - empirical) / stderr) > 20


def test_resume_from_a_host_copy_of_the_state_is_bit_identical():
  """Steps 0-5 straight vs steps 0-2, the state through numpy (a checkpoint's round trip), then
  3-5: the same bits (the history is the only memory of the recursion)."""
  params = _params(400)
  sums = [jax.tree.map(lambda p, t=t: p + 0.01 * t, params) for t in range(6)]
  banded = correlated_noise.BandedPrivatizer.banded(COEFS, SIGMA, CLIP, B, SEED)
  straight, _ = _run(banded, params, sums)
  first, state = _run(banded, params, sums[:3])
  saved = jax.tree.map(np.asarray, state)
  second, _ = _run(banded, params, sums[3:], start_state=jax.tree.map(jnp.asarray, saved), first=3)
  for a, b in zip(straight, first + second):
    np.testing.assert_array_equal(_flat(a), _flat(b))


def test_a_step_out_of_order_is_refused_with_nan():
  params = _params(40)
  banded = correlated_noise.BandedPrivatizer.banded(COEFS, SIGMA, CLIP, B, SEED)
  state = banded.init(params)
  g, state = banded.release(params, state, np.uint32(1), banded.key_data())  # Expects 0.
  assert np.all(np.isnan(_flat(g)))
  assert int(state.step) == noise_state.REFUSED
  g, state = banded.release(params, state, np.uint32(0), banded.key_data())
  assert np.all(np.isnan(_flat(g))) and int(state.step) == noise_state.REFUSED


def test_optax_transform_needs_the_step_and_matches_the_mechanism():
  params = _params(40)
  tx = correlated_optax.banded_privatizer(COEFS, SIGMA, CLIP, B, SEED)
  state = tx.init(params)
  with pytest.raises(TypeError, match='step=t'):
    tx.update(params, state)
  released, state = tx.update(params, state, step=0)
  mechanism = correlated_noise.BandedPrivatizer.banded(COEFS, SIGMA, CLIP, B, SEED)
  expected, _ = mechanism.release(params, mechanism.init(params), 0, mechanism.key_data())
  np.testing.assert_array_equal(_flat(released), _flat(expected))
  assert int(state.step) == 1


def test_state_bytes_are_bands_minus_one_copies_of_the_parameters():
  params = {'a': jnp.zeros((10, 3), jnp.float32), 'b': jnp.zeros((5,), jnp.bfloat16)}
  banded = correlated_noise.BandedPrivatizer.banded(COEFS, SIGMA, CLIP, B, SEED)
  assert banded.state_bytes(params) == 2 * (30 + 5) * 4  # bfloat16's history is float32.
  assert sum(x.nbytes for x in jax.tree.leaves(banded.init(params).history)) == 280


@pytest.mark.parametrize(
  'coefs, match',
  [
    ((), 'non-empty'),
    ((1.0, np.nan), 'finite'),
    ((-1.0,), r'coefficients\[0\] must be > 0'),
    ((1.0, 0.5), 'unit l2 norm'),
    ([[1.0]], '1-D'),
  ],
)
def test_bad_coefficients_get_one_line(coefs, match):
  with pytest.raises(ValueError, match=match):
    correlated_noise.BandedPrivatizer.banded(coefs, SIGMA, CLIP, B, SEED)


def test_the_dp_step_carries_the_state_and_equals_the_library_loop():
  """`DPStep(loss_fn, optimizer, BandedPrivatizer)`: the state rides in the optimiser state
  ((noise state, optimiser state)); for one seed and the same batches the step's parameters
  equal `clipped_grad` + `GradSum` + `banded_privatizer` + the optimizer's, so the trainer's
  step and the library release the same correlated noise."""

  c, seed = 0.3, 2**33 + 1
  privatizer = correlated_noise.BandedPrivatizer.banded(COEFS, SIGMA, c, 6.0, seed)
  state, lib_state = step_vs_library.run_both(
    privatizer, correlated_optax.banded_privatizer(COEFS, SIGMA, c, 6.0, seed), c
  )
  assert int(state[0].step) == 4 and int(lib_state[0].step) == 4
  history = np.asarray(state[0].history['w'])
  np.testing.assert_allclose(history, np.asarray(lib_state[0].history['w']), rtol=2e-6, atol=1e-7)
  assert history.shape == (2, step_vs_library.D) and np.all(history != 0)  # The last two w's, kept.


def test_a_bandmf_plan_gives_the_library_its_privatizer_batcher_and_accountant():
  """`PrivacyPlan.create(..., noise='bandmf', num_bands=3)` with cyclic Poisson (3 groups): the
  plan's strategy is what its accountant reads and what its optax privatizer runs (the same
  release as `plan.mechanism()`), and its batcher starts at the step of the privatizer state it
  is given (a loop resumed after 2 steps draws step 2 next)."""
  sampler = samplers.make('cyclic_poisson', 600, 20, seed=5, num_groups=3)
  plan = privacy_plan.PrivacyPlan.create(
    sampler,
    num_steps=9,
    clip_norm=CLIP,
    noise_multiplier=SIGMA,
    delta=1e-5,
    noise='bandmf',
    num_bands=3,
  )
  assert plan.strategy.bands == 3 and plan.accountant.options.strategy is plan.strategy
  assert plan.epsilon_at(9).details['participations'] == 3
  params = _params(40)
  tx = plan.privatizer()
  state = tx.init(params)
  mechanism = plan.mechanism()
  expected_state = mechanism.init(params)
  for t in range(2):
    released, state = tx.update(params, state, step=t)
    want, expected_state = mechanism.release(params, expected_state, t, mechanism.key_data())
    np.testing.assert_array_equal(_flat(released), _flat(want))
  batches = plan.batcher(8, state)
  assert next(iter(batches)).step == 2


def test_a_state_of_another_privatizer_is_refused():
  """The history is the recursion of one seed's noise under one strategy: a state made by a
  privatizer with another seed, or other coefficients, would continue a different C⁻¹z. Its
  release is NaN and the state refused; the library's batcher refuses it in one line."""
  params = _params(40)
  mine = correlated_noise.BandedPrivatizer.banded(COEFS, SIGMA, CLIP, B, SEED)
  for other in (
    correlated_noise.BandedPrivatizer.banded(COEFS, SIGMA, CLIP, B, SEED + 1),
    correlated_noise.BandedPrivatizer.banded(COEFS[::-1], SIGMA, CLIP, B, SEED),
  ):
    g, state = mine.release(params, other.init(params), np.uint32(0), mine.key_data())
    assert np.all(np.isnan(_flat(g))) and int(state.step) == noise_state.REFUSED
  # σ, C and b do not enter the recursion (w is unscaled): a state of another σ continues.
  louder = correlated_noise.BandedPrivatizer.banded(COEFS, 2 * SIGMA, CLIP, B, SEED)
  g, state = mine.release(params, louder.init(params), np.uint32(0), mine.key_data())
  assert np.all(np.isfinite(_flat(g))) and int(state.step) == 1
  plans = [
    privacy_plan.PrivacyPlan.create(
      samplers.make('cyclic_poisson', 600, 20, seed=seed, num_groups=3),
      num_steps=9,
      clip_norm=CLIP,
      noise_multiplier=SIGMA,
      delta=1e-5,
      noise='bandmf',
      num_bands=3,
    )
    for seed in (5, 6)
  ]
  state = plans[1].privatizer().init(params)
  with pytest.raises(ValueError, match='made by another privatizer'):
    plans[0].batcher(8, state)
