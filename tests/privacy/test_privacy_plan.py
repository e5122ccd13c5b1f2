"""dpjax.privacy.privacy_plan: one object makes the batcher, the step and the accountant (issue 24, items 7, 10).

On the main before this change: an `Accountant` built without the batcher's cap reported
ε = 4.07 where the truth with truncation was 16.39, `DPStep(private=True)` accepted σ = 0 and
C = ∞, δ ≥ 1/N was reported as a provable bound, and noise keys were caller-supplied.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
import optax
import pytest

from dpjax.privacy import dp_step
from dpjax.privacy import privacy_plan
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy import prng


def _sampler(n=1000, b=100, seed=3):
  return samplers.make('poisson', n, b, seed)


def test_the_plan_binds_the_cap_the_batcher_and_the_accountant_use():
  """A small cap truncates often: the plan's accountant pays for it; one built apart did not."""
  sampler = _sampler()
  # Both on a 10x coarser PLD grid than the default: the exact truncated event (N and N + 1)
  # costs 13 s on the default one and 0.9 s here, with the same ε to 6 digits (16.2994 vs 5.1483).
  grid = {'value_discretization_interval': 1e-3}
  plan = privacy_plan.PrivacyPlan.create(sampler, num_steps=50, clip_norm=1.0, delta=1e-5,
                                         noise_multiplier=1.0, max_batch_size=104, **grid)
  batcher = plan.batcher(physical_batch_size=8)
  assert batcher.max_batch_size == plan.accountant.max_batch_size == plan.max_batch_size == 104
  assert any(batcher.logical_batch(t).truncated for t in range(50))
  apart = accountant_lib.Accountant(sampler, 1.0, 1e-5, **grid)  # The old low-level mistake.
  assert plan.epsilon_at(50).epsilon > 2 * apart.epsilon(50)


def test_the_step_made_from_the_plan_has_its_sigma_c_b_seed_and_precision():
  plan = privacy_plan.PrivacyPlan.create(_sampler(), num_steps=10, clip_norm=0.5, delta=1e-5,
                                         noise_multiplier=1.3, precision='highest')
  model = nn.Dense(3)
  step = dp_step.DPStep.from_plan(model, optax.sgd(0.1), plan)
  assert (step.noise_multiplier, step.clip_norm, step.expected_batch_size, step.seed,
          step.precision) == (1.3, 0.5, 100.0, 3, 'highest')
  with pytest.raises(TypeError, match='noise_multiplier come from the plan'):
    dp_step.DPStep.from_plan(model, optax.sgd(0.1), plan, noise_multiplier=0.1)
  with pytest.raises(TypeError, match='precision come from the plan'):  # Its η is accounted.
    dp_step.DPStep.from_plan(model, optax.sgd(0.1), plan, precision='bfloat16')


@pytest.mark.parametrize('kwargs,match', [
    (dict(noise_multiplier=0.0), 'noise_multiplier must be a finite number > 0'),
    (dict(noise_multiplier=-1.0), 'noise_multiplier must be a finite number > 0'),
    (dict(noise_multiplier=math.inf), 'noise_multiplier must be a finite number > 0'),
    (dict(clip_norm=math.inf), 'clip_norm must be a finite number > 0'),
    (dict(clip_norm=0.0), 'clip_norm must be a finite number > 0'),
    (dict(clip_norm=math.nan), 'clip_norm must be a finite number > 0'),
    (dict(delta=1e-3), r'delta = 0.001 is >= 1/N'),
    (dict(delta=0.0), 'delta must be a finite number > 0'),
    (dict(noise_multiplier=None), 'noise_multiplier or target_epsilon'),
])
def test_the_plan_and_the_step_refuse_what_has_no_guarantee(kwargs, match):
  args = dict(num_steps=10, clip_norm=1.0, delta=1e-5, noise_multiplier=1.0)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    privacy_plan.PrivacyPlan.create(_sampler(), **args)
  if set(kwargs) <= {'noise_multiplier', 'clip_norm'} and kwargs != dict(noise_multiplier=None):
    step_args = dict(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8.0)
    step_args.update(kwargs)
    with pytest.raises(ValueError, match=match):
      dp_step.DPStep(nn.Dense(3), optax.sgd(0.1), **step_args)


def test_large_delta_needs_the_flag_and_a_warning_above_a_tenth_of_one_over_n():
  with pytest.warns(privacy_plan.LargeDeltaWarning, match='exceeds 1/'):
    privacy_plan.PrivacyPlan.create(_sampler(), num_steps=10, clip_norm=1.0, delta=5e-4,
                                    noise_multiplier=1.0)
  plan = privacy_plan.PrivacyPlan.create(_sampler(), num_steps=10, clip_norm=1.0, delta=0.5,
                                         noise_multiplier=1.0, allow_large_delta=True)
  assert plan.delta == 0.5
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    privacy_plan.PrivacyPlan.create(_sampler(), num_steps=10, clip_norm=1.0, delta=1e-5,
                                    noise_multiplier=1.0)


def test_calibration_and_the_budget():
  plan = privacy_plan.PrivacyPlan.create(_sampler(), num_steps=20, clip_norm=1.0, delta=1e-5,
                                         target_epsilon=2.0)
  assert plan.noise_multiplier_source == 'calibrated'
  assert 0.99 * 2.0 <= plan.final_report(estimates=False).epsilon <= 2.0
  with pytest.raises(privacy_plan.BudgetExceededError, match='above target_epsilon = 2'):
    privacy_plan.PrivacyPlan.create(_sampler(), num_steps=20, clip_norm=1.0, delta=1e-5,
                                    target_epsilon=2.0,
                                    noise_multiplier=0.95 * plan.noise_multiplier)


def test_the_noise_of_a_step_is_keyed_by_the_steps_own_seed_and_step():
  """`apply` takes the step t, not a key: the noise is that of (the step's seed, t)."""
  plan = privacy_plan.PrivacyPlan.create(_sampler(seed=9), num_steps=10, clip_norm=1.0,
                                         delta=1e-5, noise_multiplier=2.0)
  model = nn.Dense(2)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 3)))['params']
  step = dp_step.DPStep.from_plan(model, optax.sgd(1.0), plan)
  acc = step.init_accumulator(params)
  new, _, _ = step.apply(params, step.optimizer.init(params), acc, 4)
  noise = optax.tree.random_like(prng.noise_key(9, 4), params, jax.random.normal)
  want = jax.tree.map(lambda p, z: p - 2.0 * 1.0 * z / 100.0, params, noise)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), new, want)
