"""The JAX PRNG streams derived from config.seed: initial parameters and DP noise.

Each stream is fold_in(PRNGKey(seed), stream id); the noise of step t is
fold_in(noise stream, t), a pure function of (seed, t), so a resumed run redraws
exactly the noise of an uninterrupted one. The sampler and batcher use their own
numpy streams; these never share a key. Threefry is reproducible, not a
cryptographically secure sampler (the usual caveat for floating-point DP).
"""

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dpjax import models

# fold_in ids of the JAX PRNG streams derived from config.seed. The sampler
# and batcher use their own (numpy) streams; these never share a key.
NOISE_STREAM = 1
INIT_STREAM = 2


def check_seed(seed: int) -> None:
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f'config.seed must be an int >= 0, got {seed!r}.')


def noise_key(seed: int, step: int) -> jax.Array:
  """The key of step's noise: fold_in(fold_in(key(seed), NOISE_STREAM), step).

  A pure function of (seed, step): resuming from a checkpoint at step t
  redraws exactly the noise of an uninterrupted run.
  """
  check_seed(seed)
  if isinstance(step, bool) or not isinstance(step, int) or not (
      0 <= step < 2**32):
    raise ValueError(f'step must be an int in [0, 2**32), got {step!r}.')
  return fold_noise_key(seed, step)


def fold_noise_key(seed: int, step) -> jax.Array:
  """`noise_key` without checks; `step` may be traced (uint32 bits of step)."""
  root = jax.random.fold_in(jax.random.PRNGKey(seed), NOISE_STREAM)
  return jax.random.fold_in(root, step)


def init_params(model: nn.Module, seed: int, input_shape: Sequence[int],
                input_dtype: Any = None) -> Any:
  """Initial parameters from key fold_in(PRNGKey(seed), INIT_STREAM)."""
  check_seed(seed)
  dtype = models.input_dtype(model) if input_dtype is None else input_dtype
  key = jax.random.fold_in(jax.random.PRNGKey(seed), INIT_STREAM)
  variables = model.init(key, jnp.zeros((1, *input_shape), dtype))
  extra = set(variables) - {'params'}
  if extra:
    raise ValueError(f'model has non-parameter collections {sorted(extra)} '
                     '(e.g. batch statistics); DP training needs a stateless, '
                     'per-example model.')
  return variables['params']
