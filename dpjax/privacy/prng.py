"""The JAX PRNG streams derived from the run's seed: initial parameters and DP noise.

The root key holds all 64 bits of the seed (`root_key`; `jax.random.PRNGKey`
keeps only the low 32 bits when 64-bit types are off, which would leave a
drawn 63-bit seed 2^32 guesses from an adversary). Each stream is
fold_in(root, stream id), the ids named once in `dpjax.privacy.random_streams.Stream`;
the noise of step t is fold_in(noise stream, t), a pure function of (seed, t), so a
resumed run redraws exactly the noise of an uninterrupted one. The sampler, truncation
and audit use numpy streams of the same registry (SeedSequence over the full seed);
no two consumers share a key.

Privacy: the guarantee needs the seed to be secret (the trainer draws it from OS
entropy by default, `dpjax.trainer.workdir.run_seed`). Threefry is reproducible, not a
cryptographically secure sampler, and floating-point Gaussian samples are not
exactly Gaussian (docs/threat_model.md).
"""

from collections.abc import Sequence
import secrets
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.privacy.random_streams import Stream

# fold_in ids of the JAX PRNG streams derived from the seed (`random_streams.Stream`).
NOISE_STREAM = Stream.NOISE
INIT_STREAM = Stream.INIT
MAX_SEED = 2**64 - 1
# JAX generators the noise may be drawn with (`noise_stream_data`). None is a cryptographic
# sampler; threefry is the default and the reference (counter-based, the same bits on
# every backend); 'rbg' and 'unsafe_rbg' use the XLA RngBitGenerator, much faster on
# CPU and GPU, their bits may differ between backends and JAX versions ('unsafe_rbg'
# also derives keys by a weak hash: streams of different steps are less well separated).
NOISE_IMPLS = {'threefry': 'threefry2x32', 'rbg': 'rbg', 'unsafe_rbg': 'unsafe_rbg'}


def draw_seed() -> int:
  """A secret seed: 63 bits from the OS's cryptographically secure generator."""
  return secrets.randbits(63)


def check_seed(seed: int) -> None:
  if (
    isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not (0 <= seed <= MAX_SEED)
  ):
    raise ValueError(f'seed must be an integer in [0, 2**64), got {seed!r}.')


def root_key(seed: int) -> jax.Array:
  """The threefry key holding all 64 bits of `seed` (= PRNGKey(seed) for seed < 2**32)."""
  check_seed(seed)
  seed = int(seed)
  return jax.random.wrap_key_data(
    np.asarray([seed >> 32, seed & 0xFFFFFFFF], np.uint32), impl='threefry2x32'
  )


def stream_key(seed: int, stream: Stream) -> jax.Array:
  """fold_in(root_key(seed), stream): one independent stream per consumer."""
  return jax.random.fold_in(root_key(seed), int(Stream(stream)))


def key_data(key: jax.Array) -> np.ndarray:
  """The uint32 words of a threefry key: what compiled programs take as an argument, so that
  a program does not depend on the (secret, per-run) seed and one compilation serves every
  run, its persistent cache entry included."""
  return np.asarray(jax.random.key_data(key), np.uint32)


def from_data(data, impl: str = 'threefry') -> jax.Array:
  """The key of `key_data` (traced or not) for a `NOISE_IMPLS` generator."""
  return jax.random.wrap_key_data(jnp.asarray(data, jnp.uint32), impl=NOISE_IMPLS[impl])


def check_noise_impl(impl: str) -> str:
  if impl not in NOISE_IMPLS:
    raise ValueError(f'noise PRNG {impl!r}; valid: {tuple(NOISE_IMPLS)}.')
  return impl


def noise_stream_data(seed: int, impl: str = 'threefry') -> np.ndarray:
  """Key data of the noise stream for generator `impl`: the threefry stream key itself,
  or (rbg, unsafe_rbg) a key of that generator seeded from its bits."""
  key = stream_key(seed, NOISE_STREAM)
  if check_noise_impl(impl) == 'threefry':
    return key_data(key)
  shape = jax.random.key_data(jax.random.key(0, impl=NOISE_IMPLS[impl])).shape
  return np.asarray(jax.random.bits(key, shape, jnp.uint32), np.uint32)


def step_noise_key(stream_data, step, impl: str = 'threefry') -> jax.Array:
  """fold_in(noise stream key, step): step t's noise key from the stream's key data (traced
  or not); for threefry equal to `noise_key(seed, step)`."""
  return jax.random.fold_in(from_data(stream_data, impl), jnp.asarray(step, jnp.uint32))


def noise_key(seed: int, step: int) -> jax.Array:
  """The key of step's noise: fold_in(fold_in(root_key(seed), NOISE_STREAM), step).

  A pure function of (seed, step): resuming from a checkpoint at step t
  redraws exactly the noise of an uninterrupted run.
  """
  check_seed(seed)
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not (0 <= step < 2**32):
    raise ValueError(f'step must be an int in [0, 2**32), got {step!r}.')
  return fold_noise_key(seed, step)


def fold_noise_key(seed: int, step) -> jax.Array:
  """`noise_key` without checks; `step` may be traced (uint32 bits of step)."""
  return jax.random.fold_in(stream_key(seed, NOISE_STREAM), step)


def init_params(model, seed: int, input_shape: Sequence[int], input_dtype: Any = None) -> Any:
  """Initial parameters of a linen model from key fold_in(root_key(seed), INIT_STREAM).

  `input_dtype` defaults to `model.input_dtype` if the model declares one, else float32.
  `model.init` runs as one compiled program (as Flax advises), not op by op: eagerly each
  initializer, reshape and dtype is a program of its own (WRN-16-4's first init in a process
  took 6.7 s of CPU, now 3.3 s; an MLP's 0.8 s, now 0.6 s), and the program is one entry of
  the persistent compilation cache, which the next process reads. The values are those of the
  eager init up to XLA's fusion of the initializers' float arithmetic (identical for the MLP
  and CNN, within 6e-8 for WRN-16-4).
  """
  dtype = input_dtype or getattr(model, 'input_dtype', None) or jnp.float32
  variables = jax.jit(model.init)(
    stream_key(seed, INIT_STREAM), jnp.zeros((1, *input_shape), dtype)
  )
  extra = set(variables) - {'params'}
  if extra:
    raise ValueError(
      f'model has non-parameter collections {sorted(extra)} '
      '(e.g. batch statistics); DP training needs a stateless, '
      'per-example model.'
    )
  return variables['params']
