"""TFDS datasets read with `tfds.data_source`: ArrayRecord files, random access, no TensorFlow.

The dataset must be prepared beforehand in ArrayRecord format (`tfds build NAME --data_dir
DIR --file_format=array_record`); nothing is downloaded at run time.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import ml_collections
import numpy as np

from dpjax.data import preprocess as preprocess_lib


@dataclasses.dataclass(frozen=True)
class TfdsSource:
  """A split read through `tfds.data_source` (random access, no TensorFlow)."""

  source: Sequence
  image_key: str
  label_key: str
  preprocess: preprocess_lib.Preprocessor
  input_shape: tuple[int, ...]

  @property
  def num_classes(self) -> int:
    return self.preprocess.num_classes

  def __len__(self) -> int:
    return len(self.source)

  def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    keys = [int(i) for i in indices]
    try:
      records = self.source.__getitems__(keys)  # One batched ArrayRecord read.
    except TypeError:  # tfds.testing.mock_data's source lacks the batched read.
      records = [self.source[k] for k in keys]
    images = (
      np.stack([r[self.image_key] for r in records])
      if records
      else np.zeros((0, *self.input_shape), np.float32)
    )
    labels = np.asarray([r[self.label_key] for r in records], dtype=np.int64)
    return self.preprocess(images, labels)


def open_split(config: ml_collections.ConfigDict, split: str) -> TfdsSource:
  """Split `split` of the TFDS dataset the `data` block names (`data.name`, `data.data_dir`)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  try:
    source = tfds.data_source(config.name, split=split, data_dir=config.data_dir, download=False)
  except Exception as e:  # TFDS raises several types for unprepared data.
    raise ValueError(
      f'Could not open TFDS dataset data.name = {config.name!r}, split {split!r}, in '
      f'data.data_dir = {config.data_dir!r}: {e}\nPrepare it on a machine with network access '
      f'in ArrayRecord format, e.g. `tfds build {config.name} --data_dir DIR '
      f'--file_format=array_record`, and point data.data_dir at DIR.'
    ) from e
  features = source.dataset_info.features
  for key in (config.image_key, config.label_key):
    if key not in features:
      raise ValueError(
        f'TFDS dataset {config.name!r} has no feature {key!r} '
        f'(data.image_key / data.label_key); it has {list(features)}.'
      )
  shape = tuple(features[config.image_key].shape)
  labels = features[config.label_key]
  declared = int(config.get('num_classes', 0) or 0)
  num_classes = getattr(labels, 'num_classes', None)
  if num_classes is None:
    raise ValueError(
      f'TFDS dataset {config.name!r}: feature {config.label_key!r} is not a class '
      'label (data.label_key); dpjax trains classifiers on integer labels.'
    )
  if declared and declared < num_classes:
    raise ValueError(
      f'data.num_classes = {declared}: the TFDS dataset {config.name!r} declares '
      f'{num_classes} classes; data.num_classes must be 0 (take them) or >= '
      f'{num_classes}.'
    )
  # np_dtype: the feature's numpy dtype (its `dtype` would import TensorFlow).
  dtype = np.dtype(getattr(features[config.image_key], 'np_dtype', None) or np.float32)
  preprocess = preprocess_lib.make_preprocessor(config, declared or num_classes, shape[-1], dtype)
  return TfdsSource(source, config.image_key, config.label_key, preprocess, shape)
