"""Drivers of the privatizer tests: `release_steps` (a privatizer's releases step by step, from a
state) and `run_both`, the trainer's `DPStep` against the library tier's loop (`clipped_grad` +
`GradSum` + an optax privatizer + the optimizer) on a logistic model: the check that the step
and the library release the same mechanism (Gaussian and correlated privatizers)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax.privacy import accumulator
from dpjax.privacy import clipping
from dpjax.privacy import dp_step

D, P = 6, 4


def logistic_loss(w, ex):
  return jnp.log1p(jnp.exp(-ex['y'] * (jnp.dot(ex['x'], w['w']) + w['b'])))


def run_both(privatizer, privatizer_tx, clip_norm, counts=(2, 0, 3, 1)):
  """Steps t = 0, 1, … with counts[t] real physical batches of P rows (some rows padded) run by
  `DPStep(logistic_loss, opt, privatizer)` and by the library loop with `privatizer_tx`;
  asserts equal parameters after every step (float32, rtol 2e-6) and returns the two final
  optimiser states (the step's, the library's)."""
  opt = optax.sgd(0.5, momentum=0.5)
  step = dp_step.DPStep(logistic_loss, opt, privatizer, clipping='vmap')
  rng = np.random.default_rng(3)
  params = {'w': rng.normal(size=D).astype(np.float32), 'b': np.float32(0.1)}
  grad_fn = jax.jit(clipping.clipped_grad(logistic_loss, clip_norm, method='vmap'))
  tx = optax.chain(privatizer_tx, opt)

  @jax.jit
  def lib_step(total, state, w, t):
    updates, state = tx.update(total, state, w, step=t)
    return optax.apply_updates(w, updates), state

  w, state, lib_w, lib_state = params, step.init_opt_state(params), params, tx.init(params)
  with jax.default_matmul_precision('highest'):
    for t, k in enumerate(counts):
      buf = {
        'x': rng.normal(size=(3, P, D)).astype(np.float32),
        'y': rng.choice([-1.0, 1.0], size=(3, P)).astype(np.float32),
        'weight': (rng.random((3, P)) < 0.8).astype(np.float32),
      }
      w, state, _ = step.train_step(w, state, jax.tree.map(np.copy, buf), k, np.uint32(t))
      total = accumulator.GradSum.zeros(lib_w)
      for i in range(k):
        rows = {'x': buf['x'][i], 'y': buf['y'][i]}
        total = total.add(grad_fn(lib_w, rows, buf['weight'][i])[0])
      lib_w, lib_state = lib_step(total.total, lib_state, lib_w, np.uint32(t))
      for a, want in zip(jax.tree.leaves(w), jax.tree.leaves(lib_w)):
        np.testing.assert_allclose(a, want, rtol=2e-6, atol=1e-7)
  assert np.abs(np.asarray(w['w']) - params['w']).sum() > 0.1  # Updates that happened.
  return state, lib_state


def release_steps(privatizer, params, sums, start_state=None, first=0):
  """(releases, final state) of steps first, first + 1, … for `sums` (one per step), from
  `start_state` (None: `privatizer.init(params)`), the release jitted once."""
  release = jax.jit(privatizer.release)
  state = privatizer.init(params) if start_state is None else start_state
  out = []
  for t, grad_sum in enumerate(sums, start=first):
    g, state = release(grad_sum, state, np.uint32(t), privatizer.key_data())
    out.append(g)
  return out, state
