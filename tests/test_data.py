"""Data sources: digits, a real TFDS ArrayRecord dataset, mock MNIST, npz, synthetic."""

import sys
import time

import numpy as np
import pytest

from configs import digits_mlp
from dpjax import data


def data_config(**overrides):
  config = digits_mlp.get_config().data
  config.update(overrides)
  return config


def test_digits_fixed_stratified_split_and_preprocessing():
  train, test = data.make_sources(data_config())
  assert (len(train), len(test)) == (1437, 360)
  assert train.input_shape == (8, 8, 1) and train.num_classes == 10
  x_train, y_train, _, y_test = data.load_digits_arrays()
  # Stratified: every class has 36 ± 1 test examples.
  assert np.all(np.abs(np.bincount(y_test) - 36) <= 1)
  idx = np.array([5, 0, 1436, 5])
  batch = train.gather(idx)
  np.testing.assert_allclose(batch['x'], x_train[idx] / 16.0)
  np.testing.assert_array_equal(batch['y'], y_train[idx])
  assert batch['x'].dtype == np.float32 and batch['y'].dtype == np.int32
  # The split is fixed: a second load gives the same arrays.
  np.testing.assert_array_equal(data.load_digits_arrays()[0], x_train)


def test_preprocessing_mean_std_and_one_hot():
  train, _ = data.make_sources(data_config(mean=(0.5,), std=(0.25,), label_format='one_hot'))
  x_train, y_train, _, _ = data.load_digits_arrays()
  batch = train.gather(np.arange(4))
  np.testing.assert_allclose(batch['x'], (x_train[:4] / 16.0 - 0.5) / 0.25, rtol=1e-6)
  np.testing.assert_array_equal(batch['y'], np.eye(10)[y_train[:4]])


def test_tfds_arrayrecord_dataset_reads_back_through_data_source(tmp_path):
  from tests import tfds_digits
  tfds_digits.build(str(tmp_path))
  config = data_config(source='tfds', name='digits_tfds', data_dir=str(tmp_path))
  train, test = data.make_sources(config)
  assert (len(train), len(test)) == (1437, 360)
  assert train.input_shape == (8, 8, 1) and train.num_classes == 10
  # TFDS shuffles on write: compare the multiset of (label, image) records.
  x_train, y_train, _, _ = data.load_digits_arrays()
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
  arrays = dict(x_train=rng.integers(0, 255, (30, 4, 4, 3)), y_train=rng.integers(0, 5, 30),
                x_test=rng.integers(0, 255, (10, 4, 4, 3)), y_test=np.arange(10) % 5)
  path = tmp_path / 'd.npz'
  np.savez(path, **arrays)
  config = data_config(source='npz', path=str(path), scale=255.0, mean=(0.1, 0.2, 0.3), std=(1.0, 2.0, 4.0))
  train, test = data.make_sources(config)
  assert (len(train), len(test), train.num_classes) == (30, 10, 5)
  batch = train.gather(np.array([2, 7]))
  expected = (arrays['x_train'][[2, 7]] / 255.0 - np.array([0.1, 0.2, 0.3])) / np.array([1.0, 2.0, 4.0])
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
  assert time.perf_counter() - start < 0.05  # O(P), no O(N) work.


@pytest.mark.parametrize('overrides,message', [
    (dict(source='imagenet'), 'data.source'),
    (dict(source='tfds', name='mnist', data_dir=''), 'data.data_dir'),
    (dict(source='tfds', name='', data_dir='/tmp'), 'data.name'),
    (dict(source='tfds', name='mnist', data_dir='/nonexistent/dir'), 'data.data_dir'),
    (dict(source='npz', path='/nonexistent.npz'), 'data.path'),
    (dict(source='synthetic', num_examples=0), 'data.num_examples'),
    (dict(label_format='onehot'), 'data.label_format'),
    (dict(scale=0.0), 'data.scale'),
    (dict(std=(1.0, 2.0)), 'data.std'),
])
def test_bad_input_names_the_field(overrides, message):
  with pytest.raises(ValueError, match=message):
    data.make_sources(data_config(**overrides))


def test_unprepared_tfds_dataset_gives_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match='tfds build'):
    data.make_sources(data_config(source='tfds', name='mnist', data_dir=str(tmp_path)))
