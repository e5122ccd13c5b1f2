"""Sizes that shape the model come from public information, never from the private labels.

Issue 34 item 1: with `data.num_classes = 0` the head had max(y_train) + 1 outputs, so the
exported parameters' shape alone told whether a record labelled 10 was in the training set.
"""

import jax
import numpy as np
import pytest

from dpjax.data import digits
from dpjax.data import sources as data
from dpjax.models import factory as models
from dpjax.privacy import prng
from tests.run_configs import small_config


def _npz(path, *, extra_label=None):
  """digits as an .npz; with `extra_label`, plus one record (a copy of row 0) so labelled."""
  x_train, y_train, x_test, y_test = digits.load_digits_arrays()
  if extra_label is not None:
    x_train = np.concatenate([x_train, x_train[:1]])
    y_train = np.concatenate([y_train, [extra_label]])
  np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
  return str(path)


def _released_shapes(path, num_classes, loss='softmax_cross_entropy'):
  """The parameter shapes a run on `path` would initialise (and export), or the refusal."""
  config = small_config(
    **{'data.source': 'npz', 'data.path': path, 'data.num_classes': num_classes, 'loss': loss}
  )
  try:
    train, _ = data.make_sources(config.data, loss=loss)
  except ValueError as e:
    return 'refused: ' + str(e)
  model = models.make_model(config.model, train.num_classes, train.input_shape)
  params = jax.eval_shape(lambda: prng.init_params(model, 0, train.input_shape))
  return jax.tree.map(lambda leaf: leaf.shape, params)


def test_a_record_labelled_10_does_not_change_the_model_shape(tmp_path):
  """The attack: D = digits + one record labelled 10, D' = D minus it.

  On da06065 (checked) `data.num_classes = 0` gave D a head of [64, 11] and D' one of
  [64, 10]: the shape decided membership. Now an undeclared K is refused for both before
  any data is read (one line naming data.num_classes); K = 10 refuses D (label 10 is a
  data error naming its row, never a reason to grow the head); K = 11 gives D and D' the
  same shapes.
  """
  with_record = _npz(tmp_path / 'd.npz', extra_label=10)
  without = _npz(tmp_path / 'd_minus.npz')
  refused = _released_shapes(with_record, 0)
  assert refused == _released_shapes(without, 0)  # da06065: {.. (64, 11)} != {.. (64, 10)}.
  assert refused.startswith('refused: data.num_classes = 0: set it to the number of classes')
  assert '\n' not in refused
  assert _released_shapes(with_record, 10) == (
    f'refused: data.path = {with_record!r}: y_train: label 10 in row 1437 is not in [0, 10) '
    '(data.num_classes = 10, the classes of the task; the model never grows to fit a label).'
  )
  shapes = _released_shapes(without, 10)
  assert shapes['Dense_1']['kernel'] == (64, 10)
  assert _released_shapes(with_record, 11) == _released_shapes(without, 11)
  assert _released_shapes(without, 11)['Dense_1']['kernel'] == (64, 11)


def test_digits_classes_come_from_its_description_and_tokens_from_the_field(tmp_path):
  """digits: K = 10 from its public description; token vocabularies are declared and a token
  at or above it is a data error (on da06065 (checked) the vocabulary was max + 1: 8 here)."""
  train, _ = data.make_sources(small_config().data)
  assert train.num_classes == 10
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 7, (12, 5))
  tokens[3, 2] = 7  # One sequence uses the token 7.
  np.savez(
    tmp_path / 'seq.npz',
    x_train=tokens,
    y_train=tokens,
    x_test=tokens[:2] % 7,
    y_test=tokens[:2] % 7,
  )

  def vocab(num_classes):
    config = small_config(
      **{
        'data.source': 'npz',
        'data.path': str(tmp_path / 'seq.npz'),
        'data.num_classes': num_classes,
      }
    )
    try:
      return data.make_sources(config.data, loss='sequence_cross_entropy')[0].num_classes
    except ValueError as e:
      return str(e)

  assert vocab(0).startswith('data.num_classes = 0: set it to the vocabulary size V')
  assert vocab(32) == 32
  assert vocab(7).endswith(
    'x_train: token 7 in row 3 is not below data.num_classes = 7 (the '
    'vocabulary size; the model never grows to fit a token).'
  )


@pytest.mark.parametrize('source', ['npz', 'memmap'])
def test_undeclared_classes_are_refused_before_the_data_is_read(tmp_path, source):
  """The refusal needs no data: data.path may not even exist yet (fails on da06065, checked:
  the path was checked first)."""
  config = small_config(**{'data.source': source, 'data.path': str(tmp_path / 'absent')})
  with pytest.raises(
    ValueError,
    match=r'^data.num_classes = 0: set it to the number of '
    rf'classes K \(labels in \[0, K\)\) of your task '
    rf"\(data.source = '{source}'\)",
  ):
    data.make_sources(config.data)


def test_the_derived_scale_comes_from_the_format_not_the_values(tmp_path):
  """data.scale = 0 reads the dtype (uint8: 255, floats: 1) or the source's documented range
  (digits: 16), never the pixels' maximum: D with one bright record and D without it get the
  same scale, which `model_io` (what the card records) reports resolved. Fails on da06065
  (checked) on the missing `model_io`: the card recorded 0.0."""
  from dpjax.data import preprocess

  x_train, y_train, x_test, y_test = digits.load_digits_arrays()
  resolved = {}
  for dtype in (np.float32, np.uint8):
    for bright in (False, True):
      x = x_train.copy()
      x[0] = 200.0 if bright else x[0]  # One record far above every other pixel.
      np.savez(
        tmp_path / 'd.npz',
        x_train=x.astype(dtype),
        y_train=y_train,
        x_test=x_test.astype(dtype),
        y_test=y_test,
      )
      config = small_config(
        **{'data.source': 'npz', 'data.path': str(tmp_path / 'd.npz'), 'data.num_classes': 10}
      )
      io = preprocess.model_io(data.make_sources(config.data)[0])
      resolved[dtype, bright] = io['preprocessing']['scale'], io['preprocessing']['scale_source']
  assert (
    resolved[np.float32, False]
    == resolved[np.float32, True]
    == (1.0, 'data.scale = 0: derived from the float32 data')
  )
  assert (
    resolved[np.uint8, False]
    == resolved[np.uint8, True]
    == (255.0, 'data.scale = 0: derived from the uint8 data')
  )
  digits_io = preprocess.model_io(data.make_sources(small_config().data)[0])
  assert digits_io == {
    'num_classes': 10,
    'input_shape': [8, 8, 1],
    'preprocessing': {
      'scale': 16.0,
      'scale_source': "data.scale = 0: the digits data's range",
      'mean': [0.5],
      'std': [0.5],
      'label_format': 'int',
      'targets': 'labels',
    },
  }
