"""dpjax.privacy.noise, the Gaussian mechanism of DP-SGD, and the trainer's `accumulator.release`.

ĝ_t = (Σ_i w_i · clip_C(g_i) + σC · z_t) / b, z_t ~ N(0, I) from fold_in(noise stream of the
seed, t) (Abadi et al. 2016, "Deep Learning with Differential Privacy", Alg. 1). Checked here:
the std is σ·C per coordinate to 1 % (χ², fixed seed, its power stated), the mean is zero, no
two coordinates or leaves share noise, z_t is a pure function of (seed, t) and independent
across either, a run resumed from a checkpoint after t draws the straight run's z_t, and the
divisor is the expected batch size b, never the rows present (the attack: D and D minus one
record).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from scipy import stats

from dpjax.privacy import accumulator
from dpjax.privacy import clipping
from dpjax.privacy import noise
from dpjax.privacy import prng

SIGMA, C, B = 1.3, 0.7, 50.0
ALPHA = 1e-4  # Two-sided level of every statistical test here (fixed seeds: deterministic).
# One tree for the statistical tests (each new leaf shape costs compilations): 780,288
# coordinates, two leaves of one shape and one of another size.
TREE = {'a': jnp.zeros((512, 512)), 'b': jnp.zeros((512, 512)), 'c': jnp.zeros((256_000,))}


def _z(tree, t, seed=7, **kwargs):
  """The standard normals of step t: the privatizer's release of a zero sum, × b / (σC)."""
  tx = noise.gaussian_privatizer(SIGMA, C, B, seed, **kwargs)
  state = tx.init(tree)._replace(step=np.uint32(t))  # The state a run holds at step t.
  out, _ = tx.update(jax.tree.map(jnp.zeros_like, tree), state, step=t)
  return jax.tree.map(lambda v: np.asarray(v, np.float64) * B / (SIGMA * C), out)


def _flat(tree):
  return np.concatenate([np.ravel(l) for l in jax.tree.leaves(tree)])


def _chi2_accepts(z, scale=1.0):
  """The two-sided χ²_n test at ALPHA of 'Σ (scale·z)² ~ χ²_n', i.e. std(z) = 1/scale."""
  t, n = np.sum((scale * z) ** 2), z.size
  return min(stats.chi2.cdf(t, n), stats.chi2.sf(t, n)) > ALPHA / 2


def _corr_bound(n):
  """|corr| of two independent length-n normal vectors exceeds this with probability < 1e-6."""
  return 5 / np.sqrt(n)


def test_noise_std_is_sigma_c_per_coordinate_within_one_percent():
  """χ² on n = 780,288 coordinates: σ off by 1 % (either way) is rejected.

  Power: under std (1 ± 0.01)·σC, Σ z² / (1 ± 0.01)² ~ χ²_n, so the test accepts with
  probability cdf(hi / (1 ± 0.01)², n) − cdf(lo / (1 ± 0.01)², n) < 1e-15: the shift
  ≈ 0.02·n is 12.5 null standard deviations (√(2n)) against a critical value of 3.9. The
  fixed seed's draw itself is rejected when rescaled by 1.01 or 0.99.
  """
  z = _flat(_z(TREE, t=3))
  n = z.size
  assert n == 780_288
  lo, hi = stats.chi2.ppf(ALPHA / 2, n), stats.chi2.isf(ALPHA / 2, n)
  for off in (1.01, 0.99):
    miss = stats.chi2.cdf(hi / off**2, n) - stats.chi2.cdf(lo / off**2, n)
    assert miss < 1e-15, (off, miss)
    assert not _chi2_accepts(z, off)
  assert _chi2_accepts(z), np.std(z)
  assert abs(np.mean(z)) < 4.4 / np.sqrt(n)  # Mean zero: two-sided at 1e-5.
  assert stats.kstest(z, 'norm').pvalue > ALPHA


def test_no_two_leaves_or_neighbouring_coordinates_share_noise():
  """Leaves of equal and of different sizes: pairwise uncorrelated (a key reused across leaves
  gives equal or prefix-equal draws), each with std σC, and no lag-1 correlation inside one."""
  leaves = [np.ravel(l) for l in jax.tree.leaves(_z(TREE, t=0))]
  m = min(u.size for u in leaves)
  for i, u in enumerate(leaves):
    assert _chi2_accepts(u), i
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < _corr_bound(u.size)
    for v in leaves[i + 1 :]:
      assert abs(np.corrcoef(u[:m], v[:m])[0, 1]) < _corr_bound(m)


def test_grouped_draws_are_optax_random_like_bit_for_bit():
  """`standard_normals_like` draws leaves of one size and dtype with one vmapped sampler; every
  bit equals `optax.tree.random_like(key, tree, normal)` in a compiled program, on leaves of equal
  size and different shapes, a scalar, an empty leaf and bfloat16 (a grouping that mixed up keys,
  rows, dtypes or the flat order changes bits, so the noise of every existing run is kept)."""
  tree = {
    'w': jnp.zeros((3, 4)),
    'v': jnp.zeros((12,)),
    'u': jnp.zeros((2, 6)),
    's': jnp.zeros(()),
    'e': jnp.zeros((0, 3)),
    'h': jnp.zeros((5, 2), jnp.bfloat16),
    'g': jnp.zeros((10,), jnp.bfloat16),
    'n': [jnp.zeros((7,)), jnp.zeros((4, 3))],
  }
  key = prng.noise_key(3, 11)
  want = jax.jit(lambda k, t: optax.tree.random_like(k, t, jax.random.normal))(key, tree)
  got = jax.jit(noise.standard_normals_like)(key, tree)  # As every step runs it: compiled.
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_noise_is_a_pure_function_of_seed_and_step():
  """Equal (seed, t) → equal bits from two privatizers; another t, or a seed differing only in
  its high 32 bits (which `jax.random.PRNGKey` drops), → uncorrelated noise; rbg too."""
  tree = {'a': TREE['a']}
  n = tree['a'].size
  for impl, steps in (('threefry', (0, 5, 2**31)), ('rbg', (5,))):
    base = _flat(_z(tree, t=4, seed=2**40 + 17, noise_impl=impl))
    np.testing.assert_array_equal(_flat(_z(tree, t=4, seed=2**40 + 17, noise_impl=impl)), base)
    others = [_flat(_z(tree, t=t, seed=2**40 + 17, noise_impl=impl)) for t in steps]
    others.append(_flat(_z(tree, t=4, seed=17, noise_impl=impl)))
    others.append(_flat(_z(tree, t=4, seed=2**40 + 18, noise_impl=impl)))
    for other in others:
      assert abs(np.corrcoef(base, other)[0, 1]) < _corr_bound(n), impl
  # The threefry noise of step t is the documented key's: z_t = N(0, I) of prng.noise_key.
  want = optax.tree.random_like(prng.noise_key(9, 6), tree, jax.random.normal)
  np.testing.assert_allclose(_flat(_z(tree, t=6, seed=9)), _flat(want), rtol=1e-6, atol=1e-6)


def test_a_run_resumed_from_a_checkpoint_after_t_draws_the_straight_runs_noise(tmp_path):
  """Straight run: steps 0..4. Resumed: the optimizer state saved by orbax after step 2,
  restored into a new privatizer of the same seed: steps 2..4 release the same bits."""
  params = {'w': jnp.zeros((64, 32)), 'b': jnp.zeros((32,))}
  zero = jax.tree.map(jnp.zeros_like, params)
  make = lambda: optax.chain(noise.gaussian_privatizer(SIGMA, C, B, seed=123), optax.sgd(1.0))
  tx = make()
  state, straight = tx.init(params), []
  for t in range(5):
    if t == 2:
      with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / 'ckpt', state)
    out, state = tx.update(zero, state, params, step=t)
    straight.append(out)
  resumed = make()
  with ocp.StandardCheckpointer() as checkpointer:
    state = checkpointer.restore(tmp_path / 'ckpt', resumed.init(params))
  for t in range(2, 5):
    out, state = resumed.update(zero, state, params, step=t)
    jax.tree.map(np.testing.assert_array_equal, out, straight[t])
  assert len({float(jnp.sum(o['w'])) for o in straight}) == 5  # Each step its own noise.


def _stats(rows):
  return clipping.ClipStats(
    jnp.float32(rows), jnp.int32(0), jnp.int32(0), jnp.float32(0), jnp.float32(0), jnp.float32(0)
  )


def _release(grad_sum, rows, t=0, seed=5):
  """The trainer's release with SGD(lr = 1) from zero parameters: returns ĝ."""
  acc = accumulator.add(accumulator.zeros(grad_sum), grad_sum, _stats(rows))
  params = jax.tree.map(jnp.zeros_like, grad_sum)
  opt = optax.sgd(1.0)
  mechanism = noise.GaussianPrivatizer.gaussian(SIGMA, C, B, seed)
  new, _, _ = accumulator.release(
    params, opt.init(params), acc, np.uint32(t), mechanism.key_data(), opt, mechanism
  )
  return jax.tree.map(lambda v: -np.asarray(v, np.float64), new)


def _privatize(grad_sum, t=0, seed=5):
  tx = noise.gaussian_privatizer(SIGMA, C, B, seed)
  state = tx.init(grad_sum)._replace(step=np.uint32(t))
  return jax.tree.map(lambda v: np.asarray(v, np.float64), tx.update(grad_sum, state, step=t)[0])


@pytest.mark.parametrize('release', [_privatize, _release], ids=['privatizer', 'trainer'])
def test_divides_by_the_expected_batch_size_not_the_rows_present(release):
  """Attack: D (10 rows) and D' = D minus record j (9 rows), b = 50, same (seed, t).

  ĝ(D) − ĝ(D') = clip(g_j) / b exactly, with ‖·‖ ≤ C/b: the σC/b noise hides it. Dividing by
  the rows present would release (S + σCz)/10 against (S − g_j + σCz)/9: noise energies in the
  ratio (10/9)², which an observer reads off 10⁴ coordinates at once. And ĝ(D) is the closed
  form (S + σC·z_t)/b with z_t drawn here from `prng.noise_key`.
  """
  rng = np.random.default_rng(0)
  shapes = {'w': (100, 100), 'b': (100,)}
  rows = {k: rng.normal(size=(10, *s)) for k, s in shapes.items()}
  norms = np.sqrt(sum(np.sum(r.reshape(10, -1) ** 2, 1) for r in rows.values()))
  clipped = {
    k: r * np.minimum(1, C / norms).reshape(-1, *[1] * (r.ndim - 1)) for k, r in rows.items()
  }
  total = {k: jnp.asarray(v.sum(0), jnp.float32) for k, v in clipped.items()}
  minus_j = {k: jnp.asarray(v[1:].sum(0), jnp.float32) for k, v in clipped.items()}
  args = ((total, 10), (minus_j, 9)) if release is _release else ((total,), (minus_j,))
  with_j, without_j = release(*args[0], t=3), release(*args[1], t=3)
  for k in shapes:
    np.testing.assert_allclose(with_j[k] - without_j[k], clipped[k][0] / B, atol=2e-6)
  z = optax.tree.random_like(prng.noise_key(5, 3), total, jax.random.normal)
  for k in shapes:
    want = (np.asarray(total[k], np.float64) + SIGMA * C * np.asarray(z[k], np.float64)) / B
    np.testing.assert_allclose(with_j[k], want, rtol=1e-5, atol=1e-7)
  if release is _release:  # The noise released does not depend on the rows counted.
    zero = jax.tree.map(jnp.zeros_like, total)
    jax.tree.map(np.testing.assert_array_equal, _release(zero, 10), _release(zero, 0))
