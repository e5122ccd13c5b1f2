"""Data sources: digits, a real TFDS ArrayRecord dataset, mock MNIST, npz, synthetic."""

import sys
import time

import numpy as np
import pytest

from dpjax.configs import digits_mlp
from dpjax.data import arrays as arrays_lib
from dpjax.data import digits
from dpjax.data import sources as data


def data_config(**overrides):
  """The default data block with the identity normalisation (mean 0, std 1) unless overridden."""
  config = digits_mlp.get_config().data
  config.update(dict(mean=(0.0,), std=(1.0,)), **overrides)
  return config


def test_digits_fixed_stratified_split_and_preprocessing():
  train, test = data.make_sources(data_config())
  assert (len(train), len(test)) == (1437, 360)
  assert train.input_shape == (8, 8, 1) and train.num_classes == 10
  x_train, y_train, _, y_test = digits.load_digits_arrays()
  # Stratified: every class has 36 ± 1 test examples.
  assert np.all(np.abs(np.bincount(y_test) - 36) <= 1)
  idx = np.array([5, 0, 1436, 5])
  batch = train.gather(idx)
  np.testing.assert_allclose(batch['x'], x_train[idx] / 16.0)
  np.testing.assert_array_equal(batch['y'], y_train[idx])
  assert batch['x'].dtype == np.float32 and batch['y'].dtype == np.int32
  # The split is fixed: a second load gives the same arrays.
  np.testing.assert_array_equal(digits.load_digits_arrays()[0], x_train)


def test_preprocessing_mean_std_and_one_hot():
  train, _ = data.make_sources(data_config(mean=(0.5,), std=(0.25,), label_format='one_hot'))
  x_train, y_train, _, _ = digits.load_digits_arrays()
  batch = train.gather(np.arange(4))
  np.testing.assert_allclose(batch['x'], (x_train[:4] / 16.0 - 0.5) / 0.25, rtol=1e-6)
  np.testing.assert_array_equal(batch['y'], np.eye(10)[y_train[:4]])


def test_tfds_arrayrecord_dataset_reads_back_through_data_source(tmp_path):
  from tests import tfds_digits

  tfds_digits.build(str(tmp_path))
  config = data_config(
    source='tfds', name='digits_tfds', data_dir=str(tmp_path), scale=16.0
  )  # Digits' range (uint8 would be scaled by 255 by default).
  train, test = data.make_sources(config)
  assert (len(train), len(test)) == (1437, 360)
  assert train.input_shape == (8, 8, 1) and train.num_classes == 10
  # TFDS shuffles on write: compare the multiset of (label, image) records.
  x_train, y_train, _, _ = digits.load_digits_arrays()
  batch = train.gather(np.arange(len(train)))

  def records(x, y):
    return sorted((int(label), img.astype(np.float32).tobytes()) for img, label in zip(x, y))

  assert records(batch['x'] * 16.0, batch['y']) == records(x_train, y_train)
  assert 'tensorflow' not in sys.modules  # The TFDS path never imports TensorFlow.


def test_tfds_mock_mnist():
  import tensorflow_datasets as tfds

  config = data_config(source='tfds', name='mnist', data_dir='/tmp', scale=255.0)
  with tfds.testing.mock_data(num_examples=20, policy=tfds.testing.MockPolicy.USE_CODE):
    train, _ = data.make_sources(config)
    batch = train.gather(np.array([0, 3, 3, 19]))
  assert len(train) == 20 and train.input_shape == (28, 28, 1)
  assert batch['x'].shape == (4, 28, 28, 1) and batch['x'].min() >= 0 and batch['x'].max() <= 1
  np.testing.assert_array_equal(batch['x'][1], batch['x'][2])


def test_npz_source(tmp_path):
  rng = np.random.default_rng(0)
  arrays = dict(
    x_train=rng.integers(0, 255, (30, 4, 4, 3)),
    y_train=rng.integers(0, 5, 30),
    x_test=rng.integers(0, 255, (10, 4, 4, 3)),
    y_test=np.arange(10) % 5,
  )
  path = tmp_path / 'd.npz'
  np.savez(path, **arrays)
  config = data_config(
    source='npz',
    path=str(path),
    scale=255.0,
    mean=(0.1, 0.2, 0.3),
    std=(1.0, 2.0, 4.0),
    num_classes=5,
  )
  train, test = data.make_sources(config)
  assert (len(train), len(test), train.num_classes) == (30, 10, 5)
  batch = train.gather(np.array([2, 7]))
  expected = (arrays['x_train'][[2, 7]] / 255.0 - np.array([0.1, 0.2, 0.3])) / np.array(
    [1.0, 2.0, 4.0]
  )
  np.testing.assert_allclose(batch['x'], expected, rtol=1e-5)


def test_synthetic_source_is_a_function_of_the_index_at_any_scale():
  config = data_config(source='synthetic', num_examples=10**8, input_shape=(7,), num_classes=3)
  train, test = data.make_sources(config, seed=4)
  assert len(train) == 10**8
  a = train.gather(np.array([5, 99_999_999, 12]))
  b = train.gather(np.array([12, 5]))
  np.testing.assert_array_equal(a['x'][0], b['x'][1])
  np.testing.assert_array_equal(a['x'][2], b['x'][0])
  assert a['x'].shape == (3, 7) and np.all(np.abs(a['x']) <= 1)
  many = train.gather(np.arange(0, 10**8, 10**4))
  assert abs(float(many['x'].mean())) < 0.02 and abs(float(many['x'].std()) - 1 / np.sqrt(3)) < 0.02
  assert set(np.unique(many['y'])) == {0, 1, 2}
  # Test examples are distinct from training examples.
  assert not np.array_equal(test.gather(np.array([0]))['x'], train.gather(np.array([0]))['x'])
  start = time.perf_counter()
  train.gather(np.arange(256) * 390_625)
  assert time.perf_counter() - start < 0.5  # O(P): an O(N) pass over 1e8 rows takes seconds.


def write_memmap_dir(root, x_train, y_train, x_test, y_test, chunk_rows=7):
  for split, x, y in (('train', x_train, y_train), ('test', x_test, y_test)):
    chunks = ((x[i : i + chunk_rows], y[i : i + chunk_rows]) for i in range(0, len(x), chunk_rows))
    arrays_lib.write_memmap_split(str(root / split), len(x), chunks)


def test_memmap_source_gathers_exactly_the_written_rows(tmp_path):
  rng = np.random.default_rng(1)
  x_train, y_train = rng.integers(0, 256, (50, 4, 3), dtype=np.uint8), rng.integers(0, 6, 50)
  x_test, y_test = rng.integers(0, 256, (9, 4, 3), dtype=np.uint8), np.arange(9) % 7
  write_memmap_dir(tmp_path, x_train, y_train, x_test, y_test)  # Chunks of 7: a ragged last one.
  # The files are plain .npy arrays holding exactly the rows written.
  np.testing.assert_array_equal(np.load(tmp_path / 'train' / 'x.npy'), x_train)
  config = data_config(
    source='memmap',
    path=str(tmp_path),
    scale=255.0,
    mean=(0.5,),
    std=(0.25, 0.5, 1.0),
    num_classes=7,
  )  # Class 6 only in the test split.
  train, test = data.make_sources(config)
  assert (len(train), len(test), train.num_classes) == (50, 9, 7)
  assert train.input_shape == (4, 3)
  idx = np.array([0, 0, 17, 49])  # Padding rows repeat index 0.
  batch = train.gather(idx)
  expected = (x_train[idx] / 255.0 - 0.5) / np.array([0.25, 0.5, 1.0])
  np.testing.assert_allclose(batch['x'], expected, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(batch['y'], y_train[idx])
  assert batch['x'].dtype == np.float32 and batch['y'].dtype == np.int32
  assert type(batch['x']) is np.ndarray  # Not a view into the mapped file.
  np.testing.assert_array_equal(test.gather(np.arange(9))['y'], y_test)


def test_memmap_writer_rejects_bad_chunks_and_leaves_no_files(tmp_path):
  x, y = np.zeros((4, 2), np.uint8), np.zeros(4, np.int64)
  cases = [
    (5, [(x, y)], 'chunks hold 4 rows'),
    (3, [(x, y)], 'more than num_examples'),
    (8, [(x, y), (np.zeros((4, 3), np.uint8), y)], 'does not match'),
    (8, [(x, y), (x.astype(np.float32), y)], 'cast safely'),
    (4, [(x, y - 1)], '>= 0'),
    (4, [(x, y.astype(np.float32))], 'integers'),
    (0, [], 'num_examples'),
  ]
  for num_examples, chunks, message in cases:
    with pytest.raises(ValueError, match=message):
      arrays_lib.write_memmap_split(str(tmp_path / 'split'), num_examples, chunks)
  assert not list((tmp_path / 'split').iterdir())  # No partial or half-valid files remain.


def test_memmap_source_errors_name_the_field(tmp_path):
  def config(path):
    return data_config(source='memmap', path=str(path), num_classes=3)

  with pytest.raises(ValueError, match='data.path'):
    data.make_sources(config(''))
  with pytest.raises(ValueError, match='data.path.*existing directory'):
    data.make_sources(config(tmp_path / 'nowhere'))
  rng = np.random.default_rng(0)
  x, y = rng.integers(0, 9, (20, 3)), rng.integers(0, 3, 20)
  arrays_lib.write_memmap_split(str(tmp_path / 'train'), 20, [(x, y)])
  with pytest.raises(ValueError, match='data.path.*test.*not a directory'):
    data.make_sources(config(tmp_path))  # No test split.
  arrays_lib.write_memmap_split(str(tmp_path / 'test'), 20, [(x, y)])
  assert len(data.make_sources(config(tmp_path))[0]) == 20
  (tmp_path / 'test' / 'y.npy').unlink()
  with pytest.raises(ValueError, match='data.path.*y.npy.*missing'):
    data.make_sources(config(tmp_path))
  np.save(tmp_path / 'test' / 'y.npy', y[:19])
  with pytest.raises(ValueError, match='y_test: 20 examples but 19 labels'):
    data.make_sources(config(tmp_path))
  np.save(tmp_path / 'test' / 'y.npy', y - 1)
  with pytest.raises(
    ValueError, match=r'y_test: label -1 in row \d+ is negative; labels must be in \[0, 3\)'
  ):
    data.make_sources(config(tmp_path))
  np.save(tmp_path / 'test' / 'y.npy', y.astype(np.float32))
  with pytest.raises(ValueError, match='y.npy.*memory-mapped labels must be integers'):
    data.make_sources(config(tmp_path))
  np.save(tmp_path / 'test' / 'y.npy', y)
  payload = (tmp_path / 'test' / 'x.npy').read_bytes()
  (tmp_path / 'test' / 'x.npy').write_bytes(payload[:-8])  # Truncated: a row is missing.
  with pytest.raises(ValueError, match='data.path.*not a complete .npy'):
    data.make_sources(config(tmp_path))
  (tmp_path / 'test' / 'x.npy').write_bytes(b'not an npy file')
  with pytest.raises(ValueError, match='data.path.*not a complete .npy'):
    data.make_sources(config(tmp_path))
  np.save(tmp_path / 'test' / 'x.npy', x[:, :2])
  with pytest.raises(ValueError, match='data.path.*rows have shape'):
    data.make_sources(config(tmp_path))


def test_memmap_gather_touches_o_of_b_memory(tmp_path):
  """A gather allocates O(b) (traced numpy buffers), not O(N), and the labels scan is chunked."""
  import tracemalloc

  n = 400_000
  chunks = ((np.full((50_000, 16), i, np.uint8), np.full(50_000, i % 3)) for i in range(8))
  arrays_lib.write_memmap_split(str(tmp_path / 'train'), n, chunks)
  arrays_lib.write_memmap_split(str(tmp_path / 'test'), 2, [(np.zeros((2, 16), np.uint8), [0, 1])])
  tracemalloc.start()
  try:
    train, _ = data.make_sources(
      data_config(source='memmap', path=str(tmp_path), scale=1.0, num_classes=3)
    )
    idx = np.sort(np.random.default_rng(0).choice(n, 256, replace=False))
    tracemalloc.reset_peak()
    batch = train.gather(idx)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 256 * 16 * 4 * 8, peak  # A few float32 copies of the batch; x alone is 6.4 MB.
  np.testing.assert_array_equal(batch['x'][:, 0], idx // 50_000)
  np.testing.assert_array_equal(batch['y'], (idx // 50_000) % 3)
  assert train.num_classes == 3


@pytest.mark.parametrize(
  'overrides,message',
  [
    (dict(source='imagenet'), 'data.source'),
    (dict(source='tfds', name='mnist', data_dir=''), 'data.data_dir'),
    (dict(source='tfds', name='', data_dir='/tmp'), 'data.name'),
    (dict(source='tfds', name='mnist', data_dir='/nonexistent/dir'), 'data.data_dir'),
    (dict(source='npz', path='/nonexistent.npz', num_classes=10), 'data.path'),
    (dict(source='memmap', path='/nonexistent/dir', num_classes=10), 'data.path'),
    (dict(source='npz', path='/nonexistent.npz'), 'data.num_classes = 0'),
    (dict(source='synthetic', num_examples=0), 'data.num_examples'),
    (dict(label_format='onehot'), 'data.label_format'),
    (dict(scale=-1.0), 'data.scale'),
    (dict(std=(1.0, 2.0)), 'data.std'),
  ],
)
def test_bad_input_names_the_field(overrides, message):
  with pytest.raises(ValueError, match=message):
    data.make_sources(data_config(**overrides))


def test_unprepared_tfds_dataset_gives_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match='tfds build'):
    data.make_sources(data_config(source='tfds', name='mnist', data_dir=str(tmp_path)))
