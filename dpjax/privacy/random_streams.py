"""The random streams of a run: one id per consumer of the seed, named in one place.

Every consumer draws from its own stream, keyed by (seed, its id), and the ids are
distinct (`Stream` refuses a duplicate at import), so no two consumers ever see the same
random bits for one seed: a batch's membership, the rows a truncation keeps, the audit's
canary coins and the noise are independent draws. A consumer that dropped its id would
draw another's stream: the sampler's step t = 0xA0D1 would be the canaries' coins, the
noise of step 2 would be the initial parameters' key.

Host streams (numpy, `host_generator`): PCG64 seeded by SeedSequence([seed, id, *key]),
key = (t,) for a step, (tag, e) for an epoch. Device streams (JAX, `dpjax.privacy.prng`):
fold_in(root_key(seed), id), then fold_in(·, t) per step. This module imports no JAX, so
the samplers and the accountants that read them stay light.
"""

import enum

import numpy as np


@enum.unique
class Stream(enum.IntEnum):
  """The stream id of each consumer of the run's seed."""

  NOISE = 1  # JAX: the Gaussian noise of step t (`prng.noise_key`).
  INIT = 2  # JAX: initial parameters (`prng.init_params`).
  VIEWS = 3  # JAX: augmentation views (`augmult`).
  LORA = 4  # JAX: LoRA adapters' initial A (`dpjax.privacy.lora`).
  SAMPLER = 0x5A4D  # numpy: which examples form step t's batch (`samplers`).
  TRUNCATION = 0x7A7C  # numpy: which B rows a batch over the cap keeps (`batching`).
  AUDIT = 0xA0D1  # numpy: canary coins, coordinates and signs (`auditing.canaries`).


HOST_STREAMS = (Stream.SAMPLER, Stream.TRUNCATION, Stream.AUDIT)


def host_generator(seed: int, stream: Stream, *key: int) -> np.random.Generator:
  """PCG64 over SeedSequence([seed, stream, *key]): a pure function of its arguments."""
  if stream not in HOST_STREAMS:
    raise ValueError(
      f'{stream!r} is a JAX stream (dpjax.privacy.prng); host streams: '
      f'{[s.name for s in HOST_STREAMS]}.'
    )
  entropy = [int(seed), int(stream), *(int(k) for k in key)]
  return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))
