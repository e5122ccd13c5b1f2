"""The sums of one DP-SGD logical step: accumulated over its physical batches, then released.

`grad_sum` is Σ_i w_i · clip_C(g_i) over the K physical batches, added with Kahan's
compensation (Higham 2002, "Accuracy and Stability of Numerical Algorithms", §4.3), so
its float32 rounding error is (2u + O(K·u²))·Σ|batch sums| rather than O(K·u)·Σ|...|
(`dpjax.privacy.rounding`: η relies on it). Library loops sum their physical batches with
`GradSum`, the same sum.

`release` takes an optax step on ĝ = (Σ_i w_i · clip_C(g_i) + N(0, σ²C² I)) / b, computed by
the step's privatizer (`noise.GaussianPrivatizer`: `noise.noisy_mean`, the function the
library's `gaussian_privatizer` runs too). The noise
is added ONCE per logical step, to the sum over all K physical batches (Abadi et al. 2016,
"Deep Learning with Differential Privacy", Alg. 1; docs/accounting.md: noise std on the
*sum* of clipped gradients is σ·C), and the divisor is the sampler's `expected_batch_size`
b (q·N for Poisson, b for fixed-size samplers), never the realised number of rows:
dividing by a data-dependent count would change the sensitivity (seed 002; optax's
`differentially_private_aggregate` makes this mistake for padded / Poisson batches).

The metrics are monitoring values from the raw batch: NOT differentially private.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpjax.privacy import clipping as clipping_lib
from dpjax.privacy import rounding

Params = Any


class Accumulator(NamedTuple):
  """Running sums over the physical batches of one logical step.

  `grad_sum` is a compensated (Kahan) sum over the physical batches: `compensation`
  holds the low-order bits each float32 addition lost, so the sum's rounding error does
  not grow with the number of batches (`dpjax.privacy.rounding`).
  """

  grad_sum: Params  # Σ_i w_i · clip_C(g_i) (private) or Σ_i w_i · g_i.
  stats: clipping_lib.ClipStats
  compensation: Params  # −(the rounding error of grad_sum so far), per coordinate.


class GradSum(NamedTuple):
  """One logical step's clipped sums of its physical batches, added by `rounding.kahan_add` (for
  loops of one's own: the η that ε pays for assumes a compensated sum across batches).

    grad_sum = GradSum.zeros(params)
    for idx, weights in logical.physical_batches():   # logical: an item of plan.batcher(P, ...)
      grad_sum = grad_sum.add(grad_fn(params, batch(idx), weights)[0])
    updates, opt_state = tx.update(grad_sum.total, opt_state, params, step=logical.step)
  """

  total: Params
  compensation: Params

  @classmethod
  def zeros(cls, params: Params) -> 'GradSum':
    zero_tree = lambda: jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    return cls(zero_tree(), zero_tree())

  def add(self, g: Params) -> 'GradSum':
    return GradSum(*rounding.kahan_add(self.total, self.compensation, g))


def zeros(params: Params) -> Accumulator:
  """Zero float32 sums with the structure of `params`."""
  zero_tree = lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  return Accumulator(zero_tree(), clipping_lib.ClipStats.zeros(), zero_tree())


def add(acc: Accumulator, g: Params, stats: clipping_lib.ClipStats) -> Accumulator:
  """acc + one physical batch's clipped sum `g` and statistics."""
  total, compensation = rounding.kahan_add(acc.grad_sum, acc.compensation, g)
  return Accumulator(total, jax.tree.map(jnp.add, acc.stats, stats), compensation)


def metrics(acc: Accumulator, noisy_grad: Params, expected_batch_size: float) -> dict:
  """The step's monitoring values (not private) from its sums and the released ĝ."""
  s = acc.stats
  finite_rows = s.num_rows - s.num_nonfinite.astype(jnp.float32)
  return {
    'loss': s.loss_sum / jnp.maximum(finite_rows, 1.0),
    'accuracy': s.correct / jnp.maximum(s.num_rows, 1.0),
    'num_examples': s.num_rows,
    'num_clipped': s.num_clipped,
    'num_nonfinite': s.num_nonfinite,
    # ‖Σ_i w_i clip(g_i)‖ / b: the mean clipped gradient before noise.
    'grad_norm': optax.tree.norm(acc.grad_sum) / expected_batch_size,
    'noisy_grad_norm': optax.tree.norm(noisy_grad),
    # Mean per-example ‖g_i‖ before clipping (helps choose C); 0 when
    # not private (no per-example gradients are formed).
    'example_grad_norm': s.grad_norm_sum / jnp.maximum(finite_rows, 1.0),
  }


def init_state(params: Params, optimizer: optax.GradientTransformation, privatizer) -> Any:
  """The step's optimiser state: the optimizer's, with a stateful privatizer's state before it
  as (noise state, optimiser state); a stateless one (Gaussian) adds nothing."""
  inner = optimizer.init(params)
  return (privatizer.init(params), inner) if privatizer.stateful else inner


def release(
  params: Params,
  opt_state: optax.OptState,
  acc: Accumulator,
  step,
  key_data,
  optimizer: optax.GradientTransformation,
  privatizer,
):
  """ĝ = the privatizer's release of acc.grad_sum at step t (`noise.Privatizer`: the Gaussian
  one is (Σ + N(0, σ²C² I)) / b, `noise.noisy_mean`), one optax step on ĝ, and the metrics.

  key_data: the privatizer's `key_data()`, an argument of the compiled program.
  opt_state: as `init_state` made it (a stateful privatizer's state first).

  Returns:
    (params, opt_state, metrics).
  """
  noise_state, inner = opt_state if privatizer.stateful else (None, opt_state)
  g, noise_state = privatizer.release(acc.grad_sum, noise_state, step, key_data)
  updates, inner = optimizer.update(g, inner, params)
  params = optax.apply_updates(params, updates)
  opt_state = (noise_state, inner) if privatizer.stateful else inner
  return params, opt_state, metrics(acc, g, privatizer.expected_batch_size)
