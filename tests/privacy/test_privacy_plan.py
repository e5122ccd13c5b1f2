"""dpjax.privacy.privacy_plan: one object makes the batcher, the step and the accountant (issue 24, items 7, 10; issue 34, item 5).

Before issue 24: an `Accountant` built without the batcher's cap reported ε = 4.07 where the
truth with truncation was 16.39, `DPStep(private=True)` accepted σ = 0 and C = ∞, δ ≥ 1/N was
reported as a provable bound, and noise keys were caller-supplied. On da06065 (issue 34): a
loop restarting t each epoch reused the identical batches without a word, a loop resumed
with another num_steps took a new σ, and a standalone Accountant still took no cap.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
import optax
import pytest

from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from dpjax.privacy import batching
from dpjax.privacy import checks
from dpjax.privacy import dp_step
from dpjax.privacy import privacy_plan
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy import prng


def _sampler(n=1000, b=100, seed=3):
  return samplers.make('poisson', n, b, seed)


@pytest.mark.slow
def test_the_plan_binds_the_cap_the_batcher_and_the_accountant_use():
  """A small cap truncates often: the plan's accountant pays for it; one built apart did not."""
  sampler = _sampler()
  # Both on a 10x coarser PLD grid than the default: the exact truncated event (N and N + 1)
  # costs 13 s on the default one and 0.9 s here, with the same ε to 6 digits (16.2994 vs 5.1483).
  grid = {'value_discretization_interval': 1e-3}
  plan = privacy_plan.PrivacyPlan.create(
    sampler,
    num_steps=50,
    clip_norm=1.0,
    delta=1e-5,
    noise_multiplier=1.0,
    max_batch_size=104,
    **grid,
  )
  batcher = plan.batcher(8, plan.privatizer().init({}))
  assert batcher.max_batch_size == plan.accountant.max_batch_size == plan.max_batch_size == 104
  assert any(batch.truncated for batch in batcher)
  # The old low-level mistake, now said explicitly (test_an_accountant_needs_the_cap_...).
  apart = accountant_lib.Accountant(sampler, 1.0, 1e-5, max_batch_size=None, **grid)
  assert plan.epsilon_at(50).epsilon > 2 * apart.epsilon(50)


@pytest.mark.parametrize('name', ['poisson', 'balls_and_bins'])
def test_an_accountant_needs_the_cap_of_a_sampler_whose_batcher_truncates(name):
  """Fails on da06065: `Accountant(sampler, σ, δ)` of a Poisson sampler answered as if no batch
  were truncated (4.07 where the batcher's cap made it 16.39, test above)."""
  sampler = samplers.make(name, 1000, 100, 3)
  with pytest.raises(
    ValueError,
    match=r'^max_batch_size is required for the '
    rf'{name} sampler: its batch sizes are Binomial',
  ):
    accountant_lib.Accountant(sampler, 1.0, 1e-5)
  assert accountant_lib.Accountant(sampler, 1.0, 1e-5, max_batch_size=104).max_batch_size == 104
  assert accountant_lib.Accountant(sampler, 1.0, 1e-5, max_batch_size=None).max_batch_size is None
  # Fixed-size batches are never larger than b: nothing to truncate, nothing to say.
  assert (
    accountant_lib.Accountant(samplers.make('shuffle', 1000, 100, 3), 1.0, 1e-5).max_batch_size
    is None
  )


def test_the_step_made_from_the_plan_has_its_sigma_c_b_seed_and_precision():
  plan = privacy_plan.PrivacyPlan.create(
    _sampler(), num_steps=10, clip_norm=0.5, delta=1e-5, noise_multiplier=1.3, precision='highest'
  )
  model = nn.Dense(3)
  step = dp_step.DPStep.from_plan(model, optax.sgd(0.1), plan)
  assert (
    step.noise_multiplier,
    step.clip_norm,
    step.expected_batch_size,
    step.seed,
    step.precision,
  ) == (1.3, 0.5, 100.0, 3, 'highest')
  with pytest.raises(TypeError, match='noise_multiplier come from the plan'):
    dp_step.DPStep.from_plan(model, optax.sgd(0.1), plan, noise_multiplier=0.1)
  with pytest.raises(TypeError, match='precision come from the plan'):  # Its η is accounted.
    dp_step.DPStep.from_plan(model, optax.sgd(0.1), plan, precision='bfloat16')


@pytest.mark.parametrize(
  'kwargs,match',
  [
    (dict(noise_multiplier=0.0), 'noise_multiplier must be a finite number > 0'),
    (dict(noise_multiplier=-1.0), 'noise_multiplier must be a finite number > 0'),
    (dict(noise_multiplier=math.inf), 'noise_multiplier must be a finite number > 0'),
    (dict(clip_norm=math.inf), 'clip_norm must be a finite number > 0'),
    (dict(clip_norm=0.0), 'clip_norm must be a finite number > 0'),
    (dict(clip_norm=math.nan), 'clip_norm must be a finite number > 0'),
    (dict(delta=1e-3), r'delta = 0.001 is >= 1/N'),
    (dict(delta=0.0), 'delta must be a finite number > 0'),
    (dict(noise_multiplier=None), 'noise_multiplier or target_epsilon'),
  ],
)
def test_the_plan_and_the_step_refuse_what_has_no_guarantee(kwargs, match):
  args = dict(num_steps=10, clip_norm=1.0, delta=1e-5, noise_multiplier=1.0)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    privacy_plan.PrivacyPlan.create(_sampler(), **args)
  if set(kwargs) <= {'noise_multiplier', 'clip_norm'} and kwargs != dict(noise_multiplier=None):
    step_args = dict(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8.0)
    step_args.update(kwargs)
    with pytest.raises(ValueError, match=match):
      dp_step.DPStep.for_model(nn.Dense(3), optax.sgd(0.1), **step_args)


def test_large_delta_needs_the_flag_and_a_warning_above_a_tenth_of_one_over_n():
  with pytest.warns(checks.LargeDeltaWarning, match='exceeds 1/'):
    privacy_plan.PrivacyPlan.create(
      _sampler(), num_steps=10, clip_norm=1.0, delta=5e-4, noise_multiplier=1.0
    )
  plan = privacy_plan.PrivacyPlan.create(
    _sampler(), num_steps=10, clip_norm=1.0, delta=0.5, noise_multiplier=1.0, allow_large_delta=True
  )
  assert plan.delta == 0.5
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    privacy_plan.PrivacyPlan.create(
      _sampler(), num_steps=10, clip_norm=1.0, delta=1e-5, noise_multiplier=1.0
    )


@pytest.mark.slow
def test_calibration_and_the_budget():
  plan = privacy_plan.PrivacyPlan.create(
    _sampler(), num_steps=20, clip_norm=1.0, delta=1e-5, target_epsilon=2.0
  )
  assert plan.noise_multiplier_source == 'calibrated'
  assert 0.99 * 2.0 <= plan.final_report(estimates=False).epsilon <= 2.0
  with pytest.raises(privacy_plan.BudgetExceededError, match='above target_epsilon = 2'):
    privacy_plan.PrivacyPlan.create(
      _sampler(),
      num_steps=20,
      clip_norm=1.0,
      delta=1e-5,
      target_epsilon=2.0,
      noise_multiplier=0.95 * plan.noise_multiplier,
    )


def test_the_noise_of_a_step_is_keyed_by_the_steps_own_seed_and_step():
  """`apply` takes the step t, not a key: the noise is that of (the step's seed, t)."""
  plan = privacy_plan.PrivacyPlan.create(
    _sampler(seed=9), num_steps=10, clip_norm=1.0, delta=1e-5, noise_multiplier=2.0
  )
  model = nn.Dense(2)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 3)))['params']
  step = dp_step.DPStep.from_plan(model, optax.sgd(1.0), plan)
  acc = step.init_accumulator(params)
  new, _, _ = step.apply(params, step.optimizer.init(params), acc, 4)
  noise = optax.tree.random_like(prng.noise_key(9, 4), params, jax.random.normal)
  want = jax.tree.map(lambda p, z: p - 2.0 * 1.0 * z / 100.0, params, noise)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), new, want)


COARSE = {'value_discretization_interval': 1e-2}  # ε to ~1e-5 here, at 1/100 of the cost.


def _epsilon(*events_and_counts, delta=1e-5):
  """ε of a composition, by dp_accounting directly (an independent computation)."""
  acct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-2)
  for event, count in events_and_counts:
    acct.compose(event, count)
  return acct.get_epsilon(delta)


def test_a_loop_restarting_t_each_epoch_is_refused():
  """Fails on da06065: the README's loop written per epoch drew the identical batches again.

  N = 1000, b = 100 (10 steps an epoch), σ = 1, 5 epochs. Restarting t reuses batch t in every
  epoch under fresh noise: what an observer of the 50 releases sees is the subsampled Gaussian
  at σ/√5 composed 10 times, ε = 15.5, while the plan's ε for 50 steps is 5.15.
  """
  sampler, epochs = samplers.make('poisson', 1000, 100, 7), 5
  plan = privacy_plan.PrivacyPlan.create(
    sampler, num_steps=50, clip_norm=1.0, delta=1e-5, noise_multiplier=1.0, **COARSE
  )
  pure = batching.Batcher(sampler, 16, plan.max_batch_size)  # What the loop drew, per epoch.
  np.testing.assert_array_equal(pure.logical_batch(3).indices, pure.logical_batch(3).indices)
  batcher = plan.batcher(16, plan.privatizer().init({}))
  first_epoch = [batcher.logical_batch(t) for t in range(10)]
  assert [b.step for b in first_epoch] == list(range(10))
  with pytest.raises(
    ValueError,
    match=r'^logical_batch\(0\): step 0 was drawn already \(the '
    r'next is 10, of num_steps = 50\)',
  ):
    batcher.logical_batch(0)  # Epoch 2, t restarted.
  with pytest.raises(ValueError, match=r'logical_batch\(11\) skips steps'):
    batcher.logical_batch(11)
  rest = list(batcher)  # Iterating continues across epochs, and stops at T.
  assert [b.step for b in rest] == list(range(10, 50)) and list(batcher) == []
  np.testing.assert_array_equal(rest[0].indices, pure.logical_batch(10).indices)
  claim = plan.epsilon_at(50).epsilon
  reused = _epsilon(
    (dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(1.0 / math.sqrt(epochs))), 10)
  )
  assert claim == pytest.approx(5.148, abs=1e-2) and reused == pytest.approx(15.51, abs=1e-2)


def test_resuming_with_another_num_steps_keeps_sigma_or_is_refused():
  """Fails on da06065: a resumed loop's plan with another num_steps took a new σ silently.

  20 of 40 steps ran at σ = 1.0; a plan for 40 steps at σ = 1.3 (what re-calibrating gave)
  would claim ε(40 steps at 1.3) = 2.90 for a run whose ε is that of 20 steps at 1.0 and 20
  at 1.3, 4.01. Its batcher refuses the state, naming σ; `resume_from` keeps σ = 1.0 (and the
  whole run's ε, 4.69 at 40 steps, must meet the budget).
  """
  sampler = samplers.make('poisson', 1000, 100, 5)
  first = privacy_plan.PrivacyPlan.create(
    sampler, num_steps=20, clip_norm=1.0, delta=1e-5, noise_multiplier=1.0, **COARSE
  )
  tx = optax.chain(first.privatizer(), optax.sgd(0.1))
  state = tx.init({'w': jnp.zeros(2)})
  state = (state[0]._replace(step=jnp.uint32(20)), *state[1:])  # As after 20 updates.
  again = privacy_plan.PrivacyPlan.create(
    sampler, num_steps=40, clip_norm=1.0, delta=1e-5, noise_multiplier=1.3, **COARSE
  )
  with pytest.raises(
    ValueError,
    match=r"noise_multiplier: the state's 1.0 \(what ran\) vs "
    r"the plan's 1.3.*resume_from=opt_state",
  ):
    again.batcher(16, state)
  poisson = lambda sigma: dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(sigma))
  claim, ran = again.epsilon_at(40).epsilon, _epsilon((poisson(1.0), 20), (poisson(1.3), 20))
  assert claim == pytest.approx(2.90, abs=0.01) and ran == pytest.approx(4.01, abs=0.01)
  with pytest.raises(
    ValueError,
    match=r'noise_multiplier = 1.3 differs from the 1.0 of the '
    'state to resume',
  ):
    privacy_plan.PrivacyPlan.create(
      sampler, num_steps=40, clip_norm=1.0, delta=1e-5, noise_multiplier=1.3, resume_from=state
    )
  with pytest.raises(privacy_plan.BudgetExceededError, match='noise_multiplier = 1 over 40'):
    privacy_plan.PrivacyPlan.create(
      sampler,
      num_steps=40,
      clip_norm=1.0,
      delta=1e-5,
      target_epsilon=4.0,
      resume_from=state,
      **COARSE,
    )
  resumed = privacy_plan.PrivacyPlan.create(
    sampler,
    num_steps=40,
    clip_norm=1.0,
    delta=1e-5,
    target_epsilon=5.0,
    resume_from=state,
    **COARSE,
  )
  assert (resumed.noise_multiplier, resumed.noise_multiplier_source, resumed.max_batch_size) == (
    1.0,
    'checkpoint',
    first.max_batch_size,
  )
  assert resumed.batcher(16, state).next_step == 20
  with pytest.raises(
    ValueError,
    match=r"clip_norm: the state's 1.0 \(what ran\) vs the "
    r"resumed plan's 0.5",
  ):
    privacy_plan.PrivacyPlan.create(
      sampler, num_steps=40, clip_norm=0.5, delta=1e-5, resume_from=state
    )
  # On another platform (GPU: TF32 matmuls) η differs, and so does the fingerprint: the
  # refusal names what a user can change (the message named only sampler, N, b, δ, ...).
  with pytest.raises(
    ValueError,
    match=r'the fingerprint \(.*matmul format and η of the '
    r'precision and platform',
  ):
    privacy_plan.PrivacyPlan.create(
      sampler, num_steps=40, clip_norm=1.0, delta=1e-5, resume_from=state, platform='gpu', **COARSE
    )
