"""The content identity of a training split (dpjax.data.identity): one changed value changes it."""

import json
import os
import shutil
import sys

import numpy as np
import pytest

from dpjax.configs import digits_mlp
from dpjax.data import arrays as arrays_lib
from dpjax.data import byte_digest
from dpjax.data import digits
from dpjax.data import sources as data
from dpjax.data import synthetic as synthetic_lib
from dpjax.data import identity as data_identity

KEY = b'secret-run-key'


def identity(source, **kwargs):
  result = data_identity.content_identity(source, key=kwargs.pop('key', KEY), **kwargs)
  assert json.loads(json.dumps(result)) == result  # Stored in checkpoints as JSON: round-trips.
  return result


def data_config(**overrides):
  config = digits_mlp.get_config().data
  config.update(overrides)
  return config


def same_label_pair(labels):
  first = int(np.flatnonzero(labels == labels[0])[1])
  return 0, first


def test_in_memory_arrays_one_value_swap_and_layout():
  x, y, _, _ = digits.load_digits_arrays()
  preprocess = data.make_sources(data_config())[0].preprocess
  base = identity(arrays_lib.ArraySource(x, y, preprocess))
  assert base['kind'] == 'arrays' and base['method'] == 'full' and base['sample_size'] == 0
  assert base['num_examples'] == 1437 and base['arrays'][0]['shape'] == [1437, 8, 8, 1]
  # The same content: another copy, another key, Fortran order (hashed in C order), a new source.
  assert identity(arrays_lib.ArraySource(x.copy(), y.copy(), preprocess), key=b'other') == base
  assert identity(arrays_lib.ArraySource(np.asfortranarray(x), y, preprocess)) == base
  assert identity(data.make_sources(data_config())[0]) == base
  # One pixel.
  changed = x.copy()
  changed[700, 3, 4, 0] += 1
  assert identity(arrays_lib.ArraySource(changed, y, preprocess))['sha256'] != base['sha256']
  # One label.
  relabeled = y.copy()
  relabeled[5] = (relabeled[5] + 1) % 10
  assert identity(arrays_lib.ArraySource(x, relabeled, preprocess))['sha256'] != base['sha256']
  # The features of two same-label rows swapped (the review's attack: labels alone are blind to it).
  i, j = same_label_pair(y)
  swapped = x.copy()
  swapped[[i, j]] = swapped[[j, i]]
  assert identity(arrays_lib.ArraySource(swapped, y, preprocess))['sha256'] != base['sha256']
  # dtype is content too.
  assert (
    identity(arrays_lib.ArraySource(x.astype(np.float64), y, preprocess))['sha256']
    != base['sha256']
  )


def test_npz_source_one_float_and_a_copy_elsewhere(tmp_path):
  rng = np.random.default_rng(0)
  arrays = dict(
    x_train=rng.normal(size=(50, 4, 4, 3)).astype(np.float32),
    y_train=rng.integers(0, 5, 50),
    x_test=rng.normal(size=(10, 4, 4, 3)),
    y_test=np.arange(10) % 5,
  )
  (tmp_path / 'a').mkdir()
  (tmp_path / 'b').mkdir()
  np.savez(tmp_path / 'a' / 'd.npz', **arrays)
  shutil.copy(tmp_path / 'a' / 'd.npz', tmp_path / 'b' / 'd.npz')

  def npz_identity(path):
    return identity(data.make_sources(data_config(source='npz', path=str(path), num_classes=5))[0])

  base = npz_identity(tmp_path / 'a' / 'd.npz')
  assert base['kind'] == 'arrays' and base['method'] == 'full'
  assert npz_identity(tmp_path / 'b' / 'd.npz') == base
  arrays['x_train'][17, 2, 1, 0] = np.nextafter(arrays['x_train'][17, 2, 1, 0], np.float32(9))
  np.savez(tmp_path / 'b' / 'd.npz', **arrays)
  assert npz_identity(tmp_path / 'b' / 'd.npz')['sha256'] != base['sha256']


def write_split(root, x, y):
  arrays_lib.write_memmap_split(
    str(root / 'train'),
    len(x),
    [(x[: len(x) // 2], y[: len(x) // 2]), (x[len(x) // 2 :], y[len(x) // 2 :])],
  )
  arrays_lib.write_memmap_split(str(root / 'test'), 10, [(x[:10], y[:10])])


def memmap_source(root):
  return data.make_sources(
    data_config(
      source='memmap',
      path=str(root),
      train_split='train',
      test_split='test',
      scale=255.0,
      num_classes=10,
    )
  )[0]


def rewrite_row(path, row, new_row, *, keep_mtime):
  """Writes x[row] = new_row in place (same size), optionally restoring the file's mtime."""
  stat = os.stat(path)
  array = np.load(path, mmap_mode='r+')
  array[row] = new_row
  array.flush()
  del array
  if keep_mtime:
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.fixture
def memmap_root(tmp_path):
  rng = np.random.default_rng(1)
  x = rng.integers(0, 256, (2000, 16), dtype=np.uint8)
  y = rng.integers(0, 10, 2000, dtype=np.uint8)
  write_split(tmp_path / 'a', x, y)
  return tmp_path / 'a', x, y


def test_memmap_full_method_one_pixel_swap_and_copy(memmap_root, tmp_path):
  root, x, y = memmap_root
  source = memmap_source(root)
  assert isinstance(source.images, np.memmap)
  base = identity(source)
  assert base['kind'] == 'memmap' and base['method'] == 'full'
  assert base['files'] == [
    {'name': 'x.npy', 'bytes': os.path.getsize(root / 'train' / 'x.npy')},
    {'name': 'y.npy', 'bytes': os.path.getsize(root / 'train' / 'y.npy')},
  ]
  shutil.copytree(root, tmp_path / 'copy')  # New paths and mtimes, same bytes.
  assert identity(memmap_source(tmp_path / 'copy')) == base
  os.utime(root / 'train' / 'x.npy', ns=(1, 1))  # The full method ignores mtimes.
  assert identity(source) == base
  # One pixel, through the file (the open source sees it, and so does a fresh one).
  rewrite_row(
    root / 'train' / 'x.npy', 1234, x[1234] ^ np.eye(16, dtype=np.uint8)[5], keep_mtime=True
  )
  assert identity(source)['sha256'] != base['sha256']
  assert identity(memmap_source(root)) == identity(source)
  # Two same-label rows swapped, in the copy.
  i, j = same_label_pair(y)
  rewrite_row(tmp_path / 'copy' / 'train' / 'x.npy', [i, j], x[[j, i]], keep_mtime=True)
  assert identity(memmap_source(tmp_path / 'copy'))['sha256'] != base['sha256']


def test_memmap_sampled_method_sample_mtime_size_and_labels(memmap_root):
  root, x, _ = memmap_root
  source = memmap_source(root)
  options = dict(full_read_bytes=0, sample_rows=64)  # Force 'sampled' on a small split.
  base = identity(source, **options)
  assert base['method'] == 'sampled' and base['sample_size'] == 64
  assert [f['name'] for f in base['files']] == ['x.npy', 'y.npy']
  assert all('mtime_ns' in f for f in base['files']) and base['labels_sha256'] is None
  sampled = data_identity.sample_indices(2000, KEY, 64)
  unsampled = np.setdiff1d(np.arange(2000), sampled)
  # Sampled rows of a whole-file memmap are read with pread: the same rows as indexing gives.
  backing = byte_digest.backing(source.images)
  assert backing[1] is not None
  pread_rows = np.concatenate(list(byte_digest.row_chunks(source.images, backing, sampled)))
  np.testing.assert_array_equal(pread_rows, x[sampled])
  x_path = root / 'train' / 'x.npy'
  # A change in a row outside the sample, mtime restored: not seen (the documented limit).
  rewrite_row(x_path, unsampled[0], x[unsampled[0]] + 1, keep_mtime=True)
  assert identity(source, **options) == base
  # A change in a sampled row, mtime restored: seen by the sample.
  rewrite_row(x_path, sampled[3], x[sampled[3]] + 1, keep_mtime=True)
  changed = identity(source, **options)
  assert changed['sha256'] != base['sha256'] and changed['files'] == base['files']
  rewrite_row(x_path, sampled[3], x[sampled[3]], keep_mtime=True)
  assert identity(source, **options) == base
  # The mtime alone.
  stat = os.stat(x_path)
  os.utime(x_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
  assert identity(source, **options)['sha256'] != base['sha256']
  os.utime(x_path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  assert identity(source, **options) == base
  # The size (a byte appended to y.npy; mtime restored).
  y_path = root / 'train' / 'y.npy'
  stat = os.stat(y_path)
  with open(y_path, 'ab') as f:
    f.write(b'\0')
  os.utime(y_path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  assert identity(source, **options)['sha256'] != base['sha256']
  # Labels (small) are hashed in full when they fit the budget: any label change is seen.
  labels_budget = dict(options, full_read_bytes=os.path.getsize(y_path))
  before = identity(memmap_source(root), **labels_budget)
  assert before['method'] == 'sampled' and before['labels_sha256']
  labels = np.load(y_path, mmap_mode='r+')
  labels[unsampled[1]] = (labels[unsampled[1]] + 1) % 10
  labels.flush()
  del labels
  os.utime(y_path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  after = identity(memmap_source(root), **labels_budget)
  assert after['labels_sha256'] != before['labels_sha256'] and after['sha256'] != before['sha256']


def test_keyed_sample_depends_on_the_key(memmap_root):
  n = 10**8
  a, b = data_identity.sample_indices(n, b'a'), data_identity.sample_indices(n, b'b')
  assert np.array_equal(a, data_identity.sample_indices(n, b'a'))
  assert len(a) > 4000 and a.min() >= 0 and a.max() < n and np.all(np.diff(a) > 0)
  assert len(np.intersect1d(a, b)) < 10
  assert np.array_equal(data_identity.sample_indices(50, b'a'), np.arange(50))  # N ≤ s: all rows.
  source = memmap_source(memmap_root[0])
  sampled = dict(full_read_bytes=0, sample_rows=64)
  assert (
    identity(source, key=b'a', **sampled)['sha256']
    != identity(source, key=b'b', **sampled)['sha256']
  )
  assert identity(source, key=b'a') == identity(source, key=b'b')  # 'full' needs no key.


@pytest.fixture(scope='module')
def tfds_dir(tmp_path_factory):
  from tests import tfds_digits

  root = tmp_path_factory.mktemp('tfds')
  tfds_digits.build(str(root / 'original'))
  return root


def tfds_source(data_dir):
  config = data_config(source='tfds', name='digits_tfds', data_dir=str(data_dir))
  return data.make_sources(config)[0]


def test_tfds_full_method_copy_and_one_record(tfds_dir, monkeypatch):
  base = identity(tfds_source(tfds_dir / 'original'))
  assert base['kind'] == 'tfds' and base['method'] == 'full' and base['num_examples'] == 1437
  assert [f['name'] for f in base['files']] == [
    'digits_tfds-train.array_record-00000-of-00001',
    'features.json',
  ]
  assert base['files'][0]['take'] == 1437 and 'mtime_ns' not in base['files'][0]
  copy = tfds_dir / 'copy'
  shutil.copytree(tfds_dir / 'original', copy)
  source = tfds_source(copy)
  assert identity(source) == base
  # One record's pixel changed before writing (the same build otherwise; TFDS builds are
  # deterministic, so the unchanged build reproduces the identity).
  from tests import tfds_digits

  x_train, y_train, x_test, y_test = digits.load_digits_arrays()
  x_train = x_train.copy()
  x_train[100, 4, 4, 0] = 16 - x_train[100, 4, 4, 0]
  monkeypatch.setattr(
    tfds_digits.digits, 'load_digits_arrays', lambda: (x_train, y_train, x_test, y_test)
  )
  tfds_digits.build(str(tfds_dir / 'one_pixel'))
  assert identity(tfds_source(tfds_dir / 'one_pixel'))['sha256'] != base['sha256']
  # One byte of the shard, in place.
  shard = copy / 'digits_tfds' / '1.0.0' / base['files'][0]['name']
  with open(shard, 'r+b') as f:
    f.seek(os.path.getsize(shard) // 3)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 1]))
  assert identity(source)['sha256'] != base['sha256']
  assert 'tensorflow' not in sys.modules  # No TensorFlow on this path either.


def test_tfds_sampled_method_records_and_mtime(tfds_dir):
  source = tfds_source(tfds_dir / 'original')
  options = dict(full_read_bytes=0, sample_rows=256)
  base = identity(source, **options)
  assert base['method'] == 'sampled' and base['sample_size'] == 256
  assert all('mtime_ns' in f for f in base['files'])
  assert identity(source, key=b'other', **options)['sha256'] != base['sha256']
  shard = tfds_dir / 'original' / 'digits_tfds' / '1.0.0' / base['files'][0]['name']
  stat = os.stat(shard)
  os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
  assert identity(source, **options)['sha256'] != base['sha256']
  os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  assert identity(source, **options) == base
  # The sample hashes raw records, not the config's preprocessing.
  rescaled = data.make_sources(
    data_config(source='tfds', name='digits_tfds', scale=255.0, data_dir=str(tfds_dir / 'original'))
  )[0]
  assert identity(rescaled, **options) == base


def test_synthetic_canary_and_generic_sources():
  synthetic = synthetic_lib.SyntheticSource(10**8, (64,), 10, seed=3)
  base = identity(synthetic)
  assert base['kind'] == 'synthetic' and base['method'] == 'parameters'
  assert base['parameters'] == {
    'class': 'dpjax.data.synthetic.SyntheticSource',
    'num_examples': 10**8,
    'input_shape': [64],
    'num_classes': 10,
    'seed': 3,
    'offset': 0,
    'one_hot': False,
  }
  assert identity(synthetic_lib.SyntheticSource(10**8, (64,), 10, seed=3)) == base
  for other in (
    synthetic_lib.SyntheticSource(10**8, (64,), 10, seed=4),
    synthetic_lib.SyntheticSource(10**8, (64,), 10, seed=3, offset=1),
    synthetic_lib.SyntheticSource(10**8 - 1, (64,), 10, seed=3),
    synthetic_lib.SyntheticSource(10**8, (8, 8), 10, seed=3),
    synthetic_lib.SyntheticSource(10**8, (64,), 10, seed=3, one_hot=True),
  ):
    assert identity(other)['sha256'] != base['sha256']

  from dpjax.privacy.auditing import canaries

  x, y, _, _ = digits.load_digits_arrays()
  preprocess = data.make_sources(data_config())[0].preprocess
  with_canaries = identity(canaries.CanarySource(arrays_lib.ArraySource(x, y, preprocess), 8))
  assert with_canaries['kind'] == 'canary' and with_canaries['num_examples'] == 1437 + 8
  assert with_canaries['base'] == identity(arrays_lib.ArraySource(x, y, preprocess))
  assert (
    identity(canaries.CanarySource(arrays_lib.ArraySource(x, y, preprocess), 9))['sha256']
    != with_canaries['sha256']
  )
  changed = x.copy()
  changed[3, 0, 0, 0] += 1
  assert (
    identity(canaries.CanarySource(arrays_lib.ArraySource(changed, y, preprocess), 8))['sha256']
    != with_canaries['sha256']
  )

  class Rows:  # Only __len__ and gather: a keyed sample and N (weaker).
    def __init__(self, values):
      self.values = values

    def __len__(self):
      return len(self.values)

    def gather(self, indices):
      return {'x': self.values[indices], 'y': np.zeros(len(indices), np.int32)}

  values = np.arange(10_000, dtype=np.float32)
  generic = identity(Rows(values), sample_rows=128)
  assert generic['kind'] == 'gather' and generic['method'] == 'sampled'
  row = int(data_identity.sample_indices(10_000, KEY, 128)[7])
  values[row] += 1
  assert identity(Rows(values), sample_rows=128)['sha256'] != generic['sha256']
  with pytest.raises(TypeError):
    identity(object())
  with pytest.raises(TypeError):
    data_identity.content_identity(synthetic, key='not bytes')
