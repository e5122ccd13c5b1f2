"""Preprocessing a split's raw rows with public constants: x = (raw / scale − mean) / std.

The constants are public, so the model and its card may carry them: `data.mean` and
`data.std` are declared in the config, never fitted on the private data (a fitted mean
would be a noise-free statistic of the records, released through the model and the card);
`data.scale = 0` takes the scale from the data's public format, never from its values:
the source's documented range (digits: 16), the integer dtype's maximum (uint8: 255), 1
for floats. `model_io` is what the privacy card records: the resolved values that ran.
Labels stay int or become one-hot; regression targets and token sequences pass through as
float32 and int32.
"""

from __future__ import annotations

import dataclasses

import ml_collections
import numpy as np

from dpjax.data import validation as data_validation


@dataclasses.dataclass(frozen=True)
class Preprocessor:
  """x = (raw / scale − mean) / std (per channel); labels int or one-hot."""

  scale: float
  mean: tuple[float, ...]
  std: tuple[float, ...]
  label_format: str
  num_classes: int  # Classes (labels), the output size (values) or the vocabulary (tokens).
  scale_source: str = 'data.scale'  # Where the scale came from (printed at start).
  targets: str = 'labels'  # 'labels' (classes), 'values' (regression) or 'tokens' (sequences).

  def describe(self) -> str:
    """One line: the preprocessing and where its scale came from."""
    if self.targets == 'tokens':
      return f'x, y = int tokens (vocabulary {self.num_classes}; y = -1: padding)'
    fmt = lambda v: ', '.join(f'{x:g}' for x in v)
    kind = (
      f'{self.num_classes} classes, labels {self.label_format}'
      if self.targets == 'labels'
      else f'float targets of size {self.num_classes}'
    )
    return (
      f'x = (raw / {self.scale:g} − ({fmt(self.mean)})) / ({fmt(self.std)}) '
      f'[scale: {self.scale_source}], {kind}'
    )

  def public_fields(self) -> dict:
    """The preprocessing as it ran (the resolved scale and where it came from), JSON-ready."""
    if self.targets == 'tokens':
      return {'inputs': 'int32 tokens, used as they are', 'targets': self.targets}
    return {
      'scale': self.scale,
      'scale_source': self.scale_source,
      'mean': list(self.mean),
      'std': list(self.std),
      'label_format': self.label_format,
      'targets': self.targets,
    }

  def features(self, raw_x: np.ndarray) -> np.ndarray:
    """x = (raw / scale − mean) / std in float32 (not for token sequences)."""
    x = np.asarray(raw_x, dtype=np.float32) / np.float32(self.scale)
    return (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)

  def __call__(self, raw_x: np.ndarray, raw_y: np.ndarray) -> dict[str, np.ndarray]:
    if self.targets == 'tokens':
      return {'x': np.asarray(raw_x).astype(np.int32), 'y': np.asarray(raw_y).astype(np.int32)}
    x = self.features(raw_x)
    if self.targets == 'values':
      return {'x': x, 'y': np.asarray(raw_y, np.float32).reshape(len(x), -1)}
    y = np.asarray(raw_y).astype(np.int32)
    if self.label_format == 'one_hot':
      y = np.eye(self.num_classes, dtype=np.float32)[y]
    return {'x': x, 'y': y}


def make_preprocessor(
  config: ml_collections.ConfigDict,
  num_classes: int,
  channels: int,
  raw_dtype=np.float32,
  native_scale: float | None = None,
  targets: str = 'labels',
) -> Preprocessor:
  """The `data` block's preprocessing; `data.scale = 0` derives the scale from the data.

  Derived: the source's own range (`native_scale`, e.g. digits: 16), else 255 for uint8 and
  the integer type's maximum for other integers, 1 for floats (`data_validation.auto_scale`).
  `data.label_format` is checked by `sources.make_sources`.
  """
  if config.scale:
    if not config.scale > 0:
      raise ValueError(f'data.scale must be > 0 (0 = derived from the data), got {config.scale}.')
    scale, source = float(config.scale), 'data.scale'
  elif native_scale is not None:
    scale, source = float(native_scale), f"data.scale = 0: the {config.source} data's range"
  else:
    scale = data_validation.auto_scale(raw_dtype)
    source = f'data.scale = 0: derived from the {np.dtype(raw_dtype).name} data'
  mean, std = tuple(config.mean), tuple(config.std)
  for field, value in (('data.mean', mean), ('data.std', std)):
    if len(value) not in (1, channels):
      raise ValueError(f'{field} has {len(value)} entries; it needs 1 or {channels} (channels).')
  if not all(s > 0 for s in std):
    raise ValueError(f'data.std entries must be > 0, got {std}.')
  return Preprocessor(scale, mean, std, config.label_format, int(num_classes), source, targets)


def model_io(source) -> dict:
  """What a user of the parameters needs, read from the training source that ran: the output
  size, the input shape and the resolved preprocessing (sources without one, e.g. synthetic
  features, are used as they are). Audit canaries wrap a source as `base`."""
  base = getattr(source, 'base', source)
  preprocess = getattr(base, 'preprocess', None)
  fields = (
    preprocess.public_fields()
    if preprocess is not None
    else {
      'scale': 1.0,
      'scale_source': 'none: the features are used as they are',
      'mean': [0.0],
      'std': [1.0],
      'label_format': 'one_hot' if getattr(base, 'one_hot', False) else 'int',
      'targets': 'labels',
    }
  )
  return {
    'num_classes': int(source.num_classes),
    'input_shape': [int(d) for d in source.input_shape],
    'preprocessing': fields,
  }
