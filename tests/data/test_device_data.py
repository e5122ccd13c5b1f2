"""dpjax.data.device: the device copy preprocesses like the host; buffers; prefetching."""

import jax
import numpy as np
import optax
import pytest

from dpjax.configs import digits_mlp
from dpjax.trainer.planning import plan as plan_lib
from dpjax.privacy import batching
from dpjax.data import arrays
from dpjax.data import preprocess
from dpjax.data import sources as data
from dpjax.data import synthetic as synthetic_lib
from dpjax.data import device as device_data
from dpjax.privacy import dp_step
from dpjax.models import factory as models
from dpjax.privacy import samplers
from tests.privacy.ghost_clipping import harness


def assert_preprocessed_alike(got, want, pre: preprocess.Preprocessor, raw):
  """Bit for bit on the CPU. On a GPU XLA's float32 division is not correctly rounded (on an
  H100, 2 ulp: |got − want| ≤ 4.8e-7): there each of the two divisions may be off by 2 ulp,
  so |got − want| ≤ 4u (|raw / scale| + |mean|) / std + 4u |want|, u = float32's epsilon."""
  got, want = np.asarray(got), np.asarray(want)
  if jax.default_backend() == 'cpu':
    np.testing.assert_array_equal(got, want)
    return
  u = np.finfo(np.float32).eps
  scaled = np.abs(np.asarray(raw, np.float64) / pre.scale) + np.abs(np.asarray(pre.mean))
  bound = 4 * u * scaled / np.asarray(pre.std) + 4 * u * np.abs(want)
  assert np.all(np.abs(got.astype(np.float64) - want) <= bound), np.max(np.abs(got - want))


def _digits(label_format='int', **data_fields):
  config = digits_mlp.get_config()
  config.data.label_format = label_format
  config.data.update(data_fields)
  return config, data.make_sources(config.data)[0]


@pytest.mark.parametrize(
  'label_format,fields',
  [('int', {}), ('one_hot', {}), ('int', {'mean': (0.3,), 'std': (0.7,), 'scale': 7.0})],
)
def test_device_gather_equals_the_host_gather(label_format, fields):
  _, source = _digits(label_format, **fields)
  dataset = device_data.put_on_device(source)
  idx = np.random.default_rng(0).integers(0, len(source), 64)
  want, got = source.gather(idx), dataset.gather(idx)
  assert got['y'].dtype == want['y'].dtype and got['x'].dtype == want['x'].dtype
  np.testing.assert_array_equal(got['y'], want['y'])
  assert_preprocessed_alike(got['x'], want['x'], source.preprocess, source.images[idx])


def test_uint8_stays_uint8_and_synthetic_matches():
  rng = np.random.default_rng(1)
  images = rng.integers(0, 256, (50, 4, 4, 3), dtype=np.uint8)
  pre = preprocess.Preprocessor(255.0, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), 'int', 10)
  source = arrays.ArraySource(images, rng.integers(0, 10, 50), pre)
  dataset = device_data.put_on_device(source)
  assert dataset.images.dtype == np.uint8 and dataset.nbytes == 50 * 48 + 50 * 4
  idx = np.arange(50)[::-3]
  assert_preprocessed_alike(dataset.gather(idx)['x'], source.gather(idx)['x'], pre, images[idx])
  synthetic = synthetic_lib.SyntheticSource(40, (4, 4, 3), 5, seed=3, one_hot=True)
  on_device = device_data.put_on_device(synthetic)
  for name in ('x', 'y'):
    np.testing.assert_array_equal(
      on_device.gather(idx[idx < 40])[name], synthetic.gather(idx[idx < 40])[name]
    )


def test_fits_on_device_uses_the_byte_limit():
  _, source = _digits()
  size = device_data.raw_nbytes(source)
  assert size == len(source) * (64 * 4 + 4)
  assert device_data.fits_on_device(source, size)
  assert not device_data.fits_on_device(source, size - 1)
  assert device_data.fits_on_device(source)  # 1 GiB on the CPU.
  with pytest.raises(ValueError, match='byte limit must be an int >= 0'):
    device_data.fits_on_device(source, -1)


def test_buffers_hold_the_logical_batch_and_zero_padding():
  config, source = _digits()
  sampler = plan_lib.make_sampler(config, len(source))
  batcher = batching.Batcher(sampler, 64, 512)
  logical = batcher.logical_batch(3)
  k = logical.num_physical_batches
  index, k_index = device_data.index_buffer(logical, 8, num_rows=len(source))
  host, k_host = device_data.host_buffer(source, logical, 8)
  assert k_index == k_host == k and index['index'].dtype == np.int32
  assert index['index'].shape == (8, 64) and host['x'].shape == (8, 64, 8, 8, 1)
  np.testing.assert_array_equal(index['index'][:k], logical.indices)
  np.testing.assert_array_equal(index['weight'][:k], logical.weights)
  assert not index['weight'][k:].any() and not host['x'][k:].any()
  for i in range(k):
    want = source.gather(logical.indices[i])
    np.testing.assert_array_equal(host['x'][i], want['x'])
    np.testing.assert_array_equal(host['y'][i], want['y'])
  rows = np.arange(0, 64, 2)  # One process's rows of a multi-host run.
  half, _ = device_data.index_buffer(logical, 8, rows, num_rows=len(source))
  np.testing.assert_array_equal(half['index'][:k], logical.indices[:, rows])
  with pytest.raises(ValueError, match='K_max'):
    device_data.index_buffer(logical, k - 1, num_rows=len(source))


@pytest.mark.slow
def test_device_data_step_equals_host_buffer_step():
  config, source = _digits('one_hot')
  sampler = plan_lib.make_sampler(config, len(source))
  batcher = batching.Batcher(sampler, 64, 512)
  model = models.make_model(config.model, source.num_classes, source.input_shape)
  step = dp_step.DPStep.for_model(
    model,
    optax.adam(1e-2),
    clip_norm=1.0,
    noise_multiplier=1.0,
    expected_batch_size=sampler.expected_batch_size,
    label_format='one_hot',
    seed=2,
    allow_repeated_steps=True,
  )  # Two paths of one step compared.
  dataset = device_data.put_on_device(source)
  # From NumPy, and Adam's state by one program: eagerly, each op and leaf shape compiles.
  params = harness.init(model, np.zeros((1, *source.input_shape), np.float32), seed=2)
  opt_state = jax.jit(step.optimizer.init)(params)
  states = [jax.tree.map(np.array, (params, opt_state)) for _ in range(2)]
  with device_data.Prefetcher(
    lambda t: device_data.host_buffer(source, batcher.logical_batch(t), 8), range(3)
  ) as host:
    for t, (buf, k) in host:
      index, k_index = device_data.index_buffer(batcher.logical_batch(t), 8, num_rows=len(source))
      a = step.train_step(*states[0], buf, k, np.uint32(t))
      b = step.train_step(*states[1], index, k_index, np.uint32(t), dataset)
      states = [a[:2], b[:2]]
  jax.tree.map(
    lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), *[s[0] for s in states]
  )
  assert step.compile_count('train_step') == 2  # One per buffer kind.


def test_prefetcher_keeps_order_and_reraises():
  made = []

  def make(t):
    made.append(t)
    if t == 4:
      raise RuntimeError('gather failed at 4')
    return t * t

  with device_data.Prefetcher(make, range(3)) as p:
    assert list(p) == [(0, 0), (1, 1), (2, 4)]
  with pytest.raises(RuntimeError, match='gather failed at 4'):
    with device_data.Prefetcher(make, range(3, 10)) as p:
      seen = [t for t, _ in p]
  assert 9 not in made  # Stopped at the failure (depth 2 ahead at most).
  with pytest.raises(ValueError, match='prefetch depth'):
    device_data.Prefetcher(make, range(2), depth=0)
