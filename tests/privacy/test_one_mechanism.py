"""The trainer's step and the library tier run one mechanism (issue 35, item 1).

ĝ_t = (Σ_i w_i · clip_C(g_i) + N(0, σ²C² I)) / b exists once, `noise.noisy_mean`; the
trainer's `DPStep` and the library's `clipped_grad` + `GradSum` + `gaussian_privatizer` both
run it, so for one plan, one seed and the same batches their updates are the same numbers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpjax
from dpjax.models import mlp
from dpjax.privacy import accumulator
from dpjax.privacy import dp_step
from dpjax.privacy import losses
from dpjax.privacy import noise
from tests.privacy import step_vs_library

D, K, P = 6, 3, 4
MODEL = mlp.MLP(num_classes=K, hidden_sizes=(16,), activation='tanh')


@pytest.fixture(autouse=True)
def _float32_matmuls():
  with jax.default_matmul_precision('highest'):
    yield


def _params():
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda: MODEL.init(jax.random.PRNGKey(0), jnp.zeros((1, D))))
  return jax.tree.map(
    lambda s: (rng.normal(size=s.shape) / np.sqrt(s.shape[0])).astype(np.float32), shapes['params']
  )


def _library_step(tx):
  """The library tier's release and optimizer step, `tx.update` then `optax.apply_updates`,
  jitted as a user would (eager, each of its ops was compiled alone)."""

  def step(total, state, params, t):
    updates, state = tx.update(total, state, params, step=t)
    return optax.apply_updates(params, updates), state

  return jax.jit(step)


def _logical_batches(num_steps: int):
  """Per step: K_max = 3 physical batches of P rows, the first k real (k = 2, 0, 3)."""
  rng = np.random.default_rng(1)
  out = []
  for k in (2, 0, 3)[:num_steps]:
    x = rng.normal(size=(3, P, D)).astype(np.float32) * 3
    y = rng.integers(0, K, (3, P)).astype(np.int32)
    w = np.ones((3, P), np.float32)
    w[k - 1 if k else 0, P - 1] = 0.0  # One padded row in the last real batch.
    out.append(({'x': x, 'y': y, 'weight': w}, k))
  return out


@pytest.mark.parametrize('method', ['vmap', 'ghost'])
def test_the_trainers_step_and_the_library_give_the_same_update(method):
  sampler = dpjax.PoissonSampler(num_examples=400, batch_size=8, seed=2**40 + 3)
  plan = dpjax.PrivacyPlan.create(
    sampler,
    num_steps=3,
    clip_norm=0.4,
    noise_multiplier=1.3,
    delta=1e-5,
    physical_batch_size=P,
    max_batch_size=3 * P,
  )
  opt = optax.sgd(0.7, momentum=0.5)
  step = dp_step.DPStep.from_plan(MODEL, opt, plan, clipping=method, physical_loop='device')
  params, opt_state = _params(), opt.init(_params())

  grad_fn = jax.jit(plan.clipped_grad(losses.make_loss_fn(MODEL), has_aux=True, method=method))
  tx = optax.chain(plan.privatizer(), opt)
  lib_step = _library_step(tx)
  lib_params, lib_state = _params(), tx.init(_params())
  for t, (buffer, k) in enumerate(_logical_batches(3)):
    params, opt_state, _ = step.train_step(
      params, opt_state, jax.tree.map(np.copy, buffer), np.int32(k), np.uint32(t)
    )
    total = accumulator.GradSum.zeros(lib_params)
    for i in range(k):
      rows = {'x': buffer['x'][i], 'y': buffer['y'][i]}
      total = total.add(grad_fn(lib_params, rows, buffer['weight'][i])[0])
    lib_params, lib_state = lib_step(total.total, lib_state, lib_params, np.uint32(t))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(lib_params)):
      np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
  assert int(lib_state[0].step) == 3
  moved = sum(
    np.abs(np.asarray(a) - b).sum()
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(_params()))
  )
  assert moved > 0.1  # The comparison is of updates that happened.


@jax.jit
def _mechanism(total, key):
  """z of the key, and noisy_mean with σC = 0.6, b = 8 and with no noise, b = 2: one program
  (eager, each op compiled alone)."""
  z = optax.tree.random_like(key, total, jax.random.normal)['v']
  return (
    z,
    noise.noisy_mean(total, key, 0.6, 8.0)['v'],
    noise.noisy_mean(total, key, None, 2.0)['v'],
  )


def test_the_mechanism_is_one_function():
  """σ·C noise on the sum, then ÷ b, never ÷ the rows present; None: the non-private mean."""
  v = np.arange(4.0, dtype=np.float32)
  z, noisy, mean = jax.device_get(_mechanism({'v': v}, jax.random.key(7)))
  assert np.std(z) > 0.1  # Noise was drawn.
  np.testing.assert_allclose(noisy, (v + 0.6 * z) / 8.0, rtol=1e-6)
  np.testing.assert_array_equal(mean, v / 2.0)


def test_the_step_of_a_loss_fn_is_clipped_grad_then_the_privatizer_then_the_optimizer():
  """`DPStep(loss_fn, optimizer, privatizer)` takes the library tier's per-example loss (no
  Flax model, no aux): its update equals `clipped_grad(loss_fn)` summed by `GradSum`, then
  `gaussian_privatizer`, then the optimizer, for one seed and the same batches."""
  sigma, c, b, seed = 0.9, 0.3, 6.0, 2**33 + 1
  step_vs_library.run_both(
    noise.GaussianPrivatizer.gaussian(sigma, c, b, seed),
    noise.gaussian_privatizer(sigma, c, b, seed),
    c,
    counts=(2, 0, 3),
  )
