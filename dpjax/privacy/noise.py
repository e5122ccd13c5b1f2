"""The Gaussian mechanism of DP-SGD as an optax transform: noise once per logical step, then ÷ b.

  ĝ_t = (Σ_i w_i · clip_C(g_i) + N(0, σ²C² I)) / b

(Abadi et al. 2016, Alg. 1): the input is the *sum* of the clipped per-example
gradients of logical step t, the noise std on that sum is σ·C, and b is the
sampler's expected batch size (q·N for Poisson, b for fixed-size samplers),
never the realised count (dividing by a data-dependent count changes the
sensitivity; seed 002).

The noise of step t is drawn from fold_in(noise stream of the seed, t)
(`dpjax.privacy.prng`): a pure function of (seed, t), so a run resumed from a saved
`GaussianNoiseState` redraws exactly the noise of an uninterrupted one. The
state holds only the step count; the seed is an argument of the transform and
never enters the optimiser state (which checkpoints save). The guarantee needs
the seed to be secret (draw it with `secrets.randbits(63)`).

  privatizer = dpjax.gaussian_privatizer(noise_multiplier=1.1, clip_norm=1.0,
                                         expected_batch_size=256, seed=seed)
  tx = optax.chain(privatizer, optax.adam(1e-3))   # update(clipped_sum, state, params)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpjax.privacy import checks as _checks
from dpjax.privacy import prng


class GaussianNoiseState(NamedTuple):
  """The number of logical steps privatised so far (the t of the next noise key)."""
  step: jax.Array  # uint32 scalar.


def check_noise_multiplier(noise_multiplier, name: str = 'noise_multiplier') -> float:
  """σ: a finite number > 0 (σ = 0 releases the clipped sum without noise: no guarantee)."""
  return _checks.check_number(name, noise_multiplier, low=0.0)


def check_clip_norm(clip_norm, name: str = 'clip_norm') -> float:
  """C: a finite number > 0 (C = ∞ makes the noise σ·C infinite or the sensitivity unbounded)."""
  return _checks.check_number(name, clip_norm, low=0.0)


def check_expected_batch_size(expected_batch_size, name: str = 'expected_batch_size') -> float:
  """b: a finite number > 0 (the sampler's expected_batch_size)."""
  return _checks.check_number(name, expected_batch_size, low=0.0)


def add_noise(grad_sum: Any, key: jax.Array, std: float) -> Any:
  """grad_sum + N(0, std² I), one standard normal per coordinate from `key`."""
  noise = optax.tree.random_like(key, grad_sum, jax.random.normal)
  return jax.tree.map(lambda s, z: s + std * z.astype(s.dtype), grad_sum, noise)


def gaussian_privatizer(noise_multiplier: float, clip_norm: float,
                        expected_batch_size: float, seed: int, *,
                        noise_impl: str = 'threefry') -> optax.GradientTransformation:
  """An optax transform mapping Σ_i w_i · clip_C(g_i) of step t to ĝ_t (module docstring).

  Args:
    noise_multiplier: σ > 0 (finite); the noise std on the sum is σ·C.
    clip_norm: C (finite, > 0), the bound each clipped contribution obeys.
    expected_batch_size: b, the sampler's `expected_batch_size`.
    seed: the run's secret seed, an integer in [0, 2**64).
    noise_impl: the JAX generator (`prng.NOISE_IMPLS`: 'threefry', 'rbg', 'unsafe_rbg').
  """
  sigma = check_noise_multiplier(noise_multiplier)
  std = sigma * check_clip_norm(clip_norm)
  b = check_expected_batch_size(expected_batch_size)
  stream = prng.noise_stream_data(seed, noise_impl)

  def init(params):
    del params
    return GaussianNoiseState(jnp.zeros((), jnp.uint32))

  def update(updates, state, params=None):
    del params
    key = prng.step_noise_key(stream, state.step, noise_impl)
    noisy = add_noise(updates, key, std)
    return (jax.tree.map(lambda g: g / b, noisy),
            GaussianNoiseState(state.step + jnp.uint32(1)))

  return optax.GradientTransformation(init, update)
