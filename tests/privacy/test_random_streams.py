"""The random streams of one seed are pairwise distinct: sampling, truncation, audit, noise.

A planted-bug audit (issue 35) found two bugs the suite let through: the sampler's stream
without its id (a Poisson step t = 0xA0D1 then draws exactly the canaries' coins) and the
truncation drawn from the sampler's own stream (the rows kept correlated with the rows
sampled). These tests read the streams the real code derives, not the registry: every numpy
SeedSequence a consumer builds (recorded as it is built) and the bits the JAX consumers draw,
against the documented derivation computed here with numpy and jax.random directly.

Host (numpy) and device (JAX) streams are different generators, so a collision can only
happen within a family; across the families the ids are distinct too (`Stream` is unique).
The steps drawn include every stream id: a consumer that drops its id draws, at the step
equal to another's id, exactly that other stream (SeedSequence([s, t]) = ([s, 0xA0D1])).
On da06065 the streams were distinct (the bugs were planted), so there these tests fail
only on what is new: the registry (`random_streams`) and the privatizer's step=t. Each id
dropped in turn (sampler, truncation, truncation drawn from the sampler's stream, audit,
noise, init, views, LoRA) fails at least one test here.
"""

import jax
import numpy as np
import optax
import pytest

from dpjax.privacy import augmult
from dpjax.privacy import batching
from dpjax.privacy import noise
from dpjax.privacy import prng
from dpjax.privacy import random_streams
from dpjax.privacy import samplers
from dpjax.privacy.auditing import canaries
from dpjax.privacy.random_streams import Stream
from dpjax.privacy import lora

# Both 32-bit words of the seed non-zero, and one seed below 2**32.
SEEDS = (2**40 + 2**33 + 77, 12345)
# Small steps and every stream id as a step (see the module docstring).
STEPS = tuple(sorted({0, 1, 2, 3, 4, 5} | {int(s) for s in Stream}))
PER_STEP = ('poisson', 'fixed_size', 'fixed_size_with_replacement')
PER_EPOCH = ('balls_and_bins', 'shuffle')


@pytest.fixture
def built_seed_sequences(monkeypatch):
  """`record(call)`: the SeedSequences that `call()` builds, in order (numpy's class, spied on)."""
  made = []

  class Recorded(np.random.SeedSequence):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      made.append(self)

  monkeypatch.setattr(np.random, 'SeedSequence', Recorded)

  def record(call):
    del made[:]
    call()
    return list(made)

  return record


def _bits(seed_sequence) -> tuple[int, ...]:
  """The first 256 bits the stream's generator is seeded with."""
  return tuple(int(w) for w in seed_sequence.generate_state(8))


def _one(record, call, consumer):
  built = record(call)
  assert len(built) == 1, f'{consumer}: built {len(built)} SeedSequences, expected its one stream'
  return built[0]


def _host_streams(record, seed) -> dict[str, list]:
  """{consumer: the SeedSequences it built} for sampling, truncation and the audit."""
  streams = {'sampling': [], 'truncation': [], 'audit': []}
  for name in PER_STEP:
    sampler = samplers.make(name, 20, 10, seed)
    streams['sampling'] += [_one(record, lambda: sampler.indices(t), name) for t in STEPS]
  for name in PER_EPOCH:  # Epoch e starts at step e·T.
    sampler = samplers.make(name, 20, 10, seed)
    streams['sampling'] += [
      _one(record, lambda: sampler.indices(e * sampler.steps_per_epoch), name) for e in STEPS
    ]
  # q = 0.9 over 100 rows and a cap of 10: every step is truncated.
  batcher = batching.Batcher(samplers.make('poisson', 100, 90, seed), 1, 10)
  for t in STEPS:
    built = record(lambda: batcher.logical_batch(t))
    assert batcher.logical_batch(t).truncated
    assert len(built) == 2, f'step {t}: {len(built)} SeedSequences, expected sampler + truncation'
    streams['truncation'].append(built[1])
  streams['audit'].append(_one(record, lambda: canaries.make_canaries(seed, 4, 16), 'audit'))
  return streams


@pytest.mark.parametrize('seed', SEEDS)
def test_host_streams_are_derived_from_the_seed_and_their_own_id(built_seed_sequences, seed):
  """Every SeedSequence of a consumer is [seed, its id, ...]: one that lost its id fails here
  (the audit's [seed] would collide with no other bits, so this is where it is caught)."""
  ids = {'sampling': Stream.SAMPLER, 'truncation': Stream.TRUNCATION, 'audit': Stream.AUDIT}
  for consumer, built in _host_streams(built_seed_sequences, seed).items():
    for seed_sequence in built:
      assert list(seed_sequence.entropy)[:2] == [seed, ids[consumer]], (
        consumer,
        seed_sequence.entropy,
      )


@pytest.mark.parametrize('seed', SEEDS)
def test_sampling_truncation_and_audit_streams_are_pairwise_distinct(built_seed_sequences, seed):
  """No 256-bit generator seed is drawn by two consumers, at any step in STEPS."""
  streams = {k: {_bits(s) for s in v} for k, v in _host_streams(built_seed_sequences, seed).items()}
  names = sorted(streams)
  for i, a in enumerate(names):
    for b in names[i + 1 :]:
      assert not streams[a] & streams[b], f'{a} and {b} draw the same stream for seed {seed}'


def _reference_stream(seed: int, stream: Stream) -> jax.Array:
  """fold_in(threefry key of the 64 seed bits, id), written with jax.random alone."""
  root = jax.random.wrap_key_data(
    np.asarray([seed >> 32, seed & 0xFFFFFFFF], np.uint32), impl='threefry2x32'
  )
  return jax.random.fold_in(root, int(stream))


def _data(key) -> tuple[int, ...]:
  return tuple(int(w) for w in np.asarray(jax.random.key_data(key)).ravel())


def _noise_of_steps(seed: int, steps: int) -> list[np.ndarray]:
  """The Gaussian privatizer's released noise of steps 0..steps-1 (σ = C = b = 1, zero sums)."""
  tx = noise.gaussian_privatizer(1.0, 1.0, 1.0, seed)
  zeros = {'w': np.zeros(6, np.float32)}
  state, released = tx.init(zeros), []
  for t in range(steps):
    out, state = tx.update(zeros, state, step=t)
    released.append(np.asarray(out['w']))
  return released


class _KeyRecorder:
  """A 'model' whose parameters are the bits of the key `prng.init_params` passes its init
  (init runs compiled: the key is returned, not kept)."""

  def init(self, key, x):
    del x
    return {'params': {'key_data': jax.random.key_data(key)}}


def _init_key_data(seed: int) -> tuple[int, ...]:
  params = prng.init_params(_KeyRecorder(), seed, (1,))
  return tuple(int(w) for w in np.asarray(params['key_data']).ravel())


def _lora_a(seed: int) -> np.ndarray:
  """The LoRA adapter A that `make_finetune` draws for one 3x2 kernel (unscaled)."""
  params = {'dense': {'kernel': np.zeros((3, 2), np.float32), 'bias': np.zeros(2, np.float32)}}
  _, trainable = lora.make_finetune(
    None, params, lora_rank=1, lora_alpha=1.0, lora_targets=('kernel',), seed=seed
  )
  (a,) = [v for k, v in lora.flatten(trainable).items() if k.endswith(lora.LORA_A)]
  return np.asarray(a) * np.sqrt(3.0)


@pytest.mark.parametrize('seed', SEEDS)
def test_device_streams_are_derived_from_the_seed_and_their_own_id(seed):
  """The bits the noise, init, views and LoRA consumers draw are those of fold_in(root, id)."""
  steps = max(int(s) for s in (Stream.NOISE, Stream.INIT, Stream.VIEWS, Stream.LORA)) + 2
  zeros = {'w': np.zeros(6, np.float32)}
  for t, z in enumerate(_noise_of_steps(seed, steps)):
    key = jax.random.fold_in(_reference_stream(seed, Stream.NOISE), t)
    np.testing.assert_array_equal(z, optax.tree.random_like(key, zeros, jax.random.normal)['w'])
  assert _init_key_data(seed) == _data(_reference_stream(seed, Stream.INIT))
  assert tuple(np.asarray(augmult.stream_data(seed)).ravel()) == _data(
    _reference_stream(seed, Stream.VIEWS)
  )
  a = jax.random.normal(jax.random.fold_in(_reference_stream(seed, Stream.LORA), 0), (3, 1))
  np.testing.assert_allclose(_lora_a(seed), a, rtol=1e-6)


@pytest.mark.parametrize('seed', SEEDS)
def test_noise_keys_are_distinct_from_the_other_device_streams(seed):
  """The noise of no step is keyed like init, views or LoRA: noise that lost its id would draw
  step 2 with the initial parameters' key (and step 3 with the views' stream)."""
  others = {
    'init': _init_key_data(seed),
    'views': tuple(int(w) for w in np.asarray(augmult.stream_data(seed)).ravel()),
    'lora': _data(prng.stream_key(seed, Stream.LORA)),
  }
  assert len(set(others.values())) == len(others), others
  stream = prng.noise_stream_data(seed)
  noise_keys = {_data(prng.step_noise_key(stream, t)): t for t in STEPS}
  for name, key in others.items():
    assert key not in noise_keys, f'noise of step {noise_keys.get(key)} is keyed like {name}'
  # The keys above are the ones the privatizer draws with (bits, not just key names).
  for t, z in enumerate(_noise_of_steps(seed, 3)):
    expected = optax.tree.random_like(
      prng.step_noise_key(stream, t), {'w': np.zeros(6, np.float32)}, jax.random.normal
    )['w']
    np.testing.assert_array_equal(z, np.asarray(expected, np.float32))


def test_every_stream_id_is_named_once_in_the_registry():
  """The ids are distinct (enum.unique) and no consumer keeps an id of its own."""
  assert len({int(s) for s in Stream}) == len(Stream)
  assert set(random_streams.HOST_STREAMS) == {Stream.SAMPLER, Stream.TRUNCATION, Stream.AUDIT}
  for module in (samplers, batching, canaries, augmult, lora, prng):
    own = [
      n for n in vars(module) if n.endswith('_STREAM') and n not in ('NOISE_STREAM', 'INIT_STREAM')
    ]
    assert not own, f'{module.__name__} defines its own stream ids {own}'
  assert prng.NOISE_STREAM is Stream.NOISE and prng.INIT_STREAM is Stream.INIT
  with pytest.raises(ValueError, match='JAX stream'):
    random_streams.host_generator(0, Stream.NOISE)
