"""The static-shape batcher: padding, truncation, the cap B, one compilation."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from scipy import stats

from dpjax.privacy import batching
from dpjax.privacy import samplers


def make_sampler(name, num_examples, batch_size, seed=0):
  return samplers.make(name, num_examples, batch_size, seed)


@pytest.mark.parametrize('name', samplers.SAMPLER_NAMES)
def test_physical_batches_hold_the_logical_batch_then_zero_weight_padding(name):
  sampler = make_sampler(name, 1000, 100, seed=1)
  batcher = batching.Batcher(sampler, physical_batch_size=32, max_batch_size=1024)
  for step in range(12):
    logical = batcher.logical_batch(step)
    expected = sampler.indices(step)
    n = len(expected)
    assert logical.size == n and not logical.truncated
    assert logical.indices.shape == (math.ceil(n / 32), 32) == logical.weights.shape
    flat_idx, flat_w = logical.indices.ravel(), logical.weights.ravel()
    np.testing.assert_array_equal(flat_idx[:n], expected)
    assert np.all(flat_w[:n] == 1) and np.all(flat_w[n:] == 0) and np.all(flat_idx[n:] == 0)
    assert flat_w.dtype == np.float32 and flat_idx.dtype == np.int64


def test_empty_poisson_batch_has_no_physical_batches():
  sampler = make_sampler('poisson', 1000, 1, seed=0)
  batcher = batching.Batcher(sampler, 8, 64)
  sizes = {batcher.logical_batch(t).size: batcher.logical_batch(t) for t in range(20)}
  assert 0 in sizes  # Pr[n = 0] = 0.999^1000 ≈ 0.37 per step.
  assert sizes[0].indices.shape == (0, 8)


def test_truncation_keeps_a_uniform_subset_of_the_sampled_batch():
  sampler = make_sampler(
    'poisson', 200, 100, seed=3
  )  # n ~ Binomial(200, 0.5) > 64 always in practice.
  batcher = batching.Batcher(sampler, physical_batch_size=16, max_batch_size=64)
  kept_rank = np.zeros(10)
  for step in range(400):
    logical = batcher.logical_batch(step)
    original = sampler.indices(step)
    assert logical.truncated and logical.size == len(original)
    assert logical.indices.shape == (4, 16) and logical.weights.sum() == 64
    kept = logical.indices.ravel()
    assert len(np.unique(kept)) == 64 and np.isin(kept, original).all()
    # Rank of each kept example within the sampled batch, in deciles: uniform if the subset is.
    ranks = np.searchsorted(original, kept) / len(original)
    kept_rank += np.histogram(ranks, bins=10, range=(0, 1))[0]
  assert stats.chisquare(kept_rank).pvalue > 1e-4
  # Same step → same subset (pure function of (seed, step)).
  np.testing.assert_array_equal(batcher.logical_batch(5).indices, batcher.logical_batch(5).indices)


def test_log_truncation_probability_matches_scipy_and_survives_large_n():
  sampler = make_sampler('poisson', 10_000, 100)
  for cap in (100, 130, 150):
    assert batching.truncation_probability(sampler, cap) == pytest.approx(
      stats.binom.sf(cap, 10_000, 0.01), rel=1e-9
    )
  big = make_sampler('poisson', 10**7, 256)
  log_p = batching.log_truncation_probability(big, 1024)
  assert math.isfinite(log_p) and log_p < -300  # sf itself underflows to 0 here.
  assert batching.log_truncation_probability(make_sampler('fixed_size', 100, 10), 16) == -math.inf


def test_automatic_cap_is_the_smallest_multiple_within_the_budget():
  sampler = make_sampler('poisson', 10_000, 100)
  delta, steps, p = 1e-5, 5000, 10
  cap = batching.resolve_max_batch_size(sampler, p, 0, num_steps=steps, delta=delta)
  assert cap % p == 0
  budget = batching.DEFAULT_TRUNCATION_BUDGET * delta
  assert steps * stats.binom.sf(cap, 10_000, 0.01) <= budget
  assert steps * stats.binom.sf(cap - p, 10_000, 0.01) > budget
  bb = make_sampler('balls_and_bins', 10**7, 256)
  cap = batching.resolve_max_batch_size(bb, 64, 0, num_steps=10**6, delta=1e-6)
  assert 256 < cap <= 512 and cap % 64 == 0  # About 13 std above the mean 256.


def test_automatic_cap_keeps_the_deterministic_balls_and_bins_bound_finite():
  # Regression (experiments/06_truncation): with τ <= δ/1000 the TV penalty (1 + e^ε)·τ of
  # the deterministic bound (ε ≈ 11.5 at σ = 1, 5 epochs) exceeded δ, so ε was ∞.
  from dpjax.privacy.accounting import balls_and_bins

  sampler = make_sampler('balls_and_bins', 60_000, 256)
  steps, delta = 5 * sampler.steps_per_epoch, 1e-5
  cap = batching.resolve_max_batch_size(sampler, 64, 0, num_steps=steps, delta=delta)
  tau = steps * math.exp(batching.log_truncation_probability(sampler, cap))
  untruncated = balls_and_bins.deterministic_epsilon(1.0, 5, delta)
  truncated = balls_and_bins.deterministic_epsilon(1.0, 5, delta, penalty_mass=tau)
  assert 11 < untruncated < 12
  assert (1 + math.exp(untruncated)) * tau < delta / 1000
  assert truncated == pytest.approx(untruncated, rel=1e-3)


def test_cap_for_fixed_size_samplers_and_overrides():
  fixed = make_sampler('fixed_size', 1000, 100)
  assert batching.resolve_max_batch_size(fixed, 32) == 128
  assert batching.resolve_max_batch_size(fixed, 32, 256) == 128  # Never above what can occur.
  poisson = make_sampler('poisson', 1000, 100)
  assert batching.resolve_max_batch_size(poisson, 32, 64) == 64  # A user cap is honoured.
  assert batching.resolve_max_batch_size(poisson, 32, 4096) == 1024  # B > N + 1: no truncation.


@pytest.mark.parametrize(
  'kwargs,message',
  [
    (dict(physical_batch_size=-1), 'physical_batch_size'),
    (dict(physical_batch_size=32, requested=100), 'multiple of'),
    (dict(physical_batch_size=32, requested=-32), 'max_batch_size'),
  ],
)
def test_bad_caps_name_the_field(kwargs, message):
  with pytest.raises(ValueError, match=message):
    batching.resolve_max_batch_size(make_sampler('poisson', 1000, 100), **kwargs)


def test_fixed_size_cap_below_batch_size_is_rejected():
  with pytest.raises(ValueError, match='max_batch_size'):
    batching.resolve_max_batch_size(make_sampler('shuffle', 1000, 100), 32, 64)


@pytest.mark.parametrize('name', ['poisson', 'balls_and_bins'])
def test_a_jitted_step_compiles_once_over_an_epoch_of_variable_batches(name):
  sampler = make_sampler(name, 500, 40, seed=2)
  cap = batching.resolve_max_batch_size(sampler, 16, num_steps=sampler.steps_per_epoch)
  batcher = batching.Batcher(sampler, 16, cap)
  data = jnp.arange(500, dtype=jnp.float32)

  @jax.jit
  def weighted_sum(indices, weights):
    return jnp.sum(data[indices] * weights)

  sizes = set()
  for step in range(sampler.steps_per_epoch):
    logical = batcher.logical_batch(step)
    sizes.add(logical.size)
    total = sum(float(weighted_sum(i, w)) for i, w in logical.physical_batches())
    assert total == float(np.sum(sampler.indices(step)))  # Padding contributes exactly 0.
  assert len(sizes) > 3  # The logical size really varied...
  assert weighted_sum._cache_size() == 1  # ...and the step compiled once.


def test_automatic_p_resolves_b_to_the_row_and_a_cap_need_not_be_a_multiple_of_p():
  poisson = make_sampler('poisson', 1000, 100)
  to_the_row = batching.resolve_max_batch_size(poisson, 0, num_steps=10)
  assert to_the_row == batching.resolve_max_batch_size(poisson, 1, num_steps=10)
  assert batching.resolve_max_batch_size(poisson, 32, num_steps=10) == -(-to_the_row // 32) * 32
  batcher = batching.Batcher(poisson, physical_batch_size=32, max_batch_size=to_the_row)
  assert batcher.max_physical_batches == -(-to_the_row // 32)
  logical = batcher.logical_batch(3)
  assert logical.indices.shape[1] == 32 and logical.weights.sum() == min(logical.size, to_the_row)
