"""The data block of a training config: where the examples come from and their public preprocessing."""

from dpjax.data import sources as data
from dpjax.data import validation as data_validation
from dpjax.trainer.configuration.field_spec import Field

FIELDS: tuple[Field, ...] = (
  Field(
    'data.source',
    'str',
    'digits',
    'digits (embedded) | tfds | npz | memmap | synthetic',
    choices=data.SOURCES,
  ),
  Field('data.name', 'text', '', "TFDS dataset name (source 'tfds'), e.g. 'mnist'"),
  Field('data.data_dir', 'text', '', "a prepared TFDS data_dir (source 'tfds'); never downloaded"),
  Field(
    'data.path',
    'text',
    '',
    "an .npz with x_train, y_train, x_test, y_test (source 'npz'), "
    "or a directory of <split>/x.npy, <split>/y.npy (source 'memmap')",
  ),
  Field('data.train_split', 'text', 'train', 'the training split (tfds, memmap)'),
  Field('data.test_split', 'text', 'test', 'the test split (tfds, memmap)'),
  Field('data.image_key', 'text', 'image', 'the feature name of the inputs (tfds)'),
  Field('data.label_key', 'text', 'label', 'the feature name of the labels (tfds)'),
  Field('data.num_examples', 'int', 0, 'N of the synthetic source', 0),
  Field(
    'data.public_num_examples',
    'int',
    0,
    'a public upper bound on N, the training '
    'examples (e.g. N rounded up): q = b/N, the epochs, B, the δ check, σ, ε and the card '
    'use it and the exact N is never released (sampler poisson only; more rows are '
    'refused); 0 = the exact N, treated as public',
    0,
    accounting=True,
  ),
  Field('data.input_shape', 'ints', (8, 8, 1), 'per-example shape of the synthetic source', 1),
  Field(
    'data.num_classes',
    'int',
    0,
    'K, the classes (labels in [0, K)) or the token '
    "vocabulary: public, from the task's definition, never from the labels; 0 = the "
    "source's public description (digits: 10, tfds: its metadata); npz and memmap labels "
    'or tokens need it; the synthetic source needs K >= 2',
    0,
  ),
  Field(
    'data.scale',
    'float',
    0.0,
    "raw values are divided by it; 0 = from the data's public "
    "format, never its values: the source's documented range (digits: 16), 255 for uint8, "
    "the integer type's max, 1 for floats (the card records the value used)",
    0,
  ),
  Field(
    'data.mean',
    'floats',
    (0.5,),
    'public per-channel mean subtracted after scaling '
    '(never fitted on the private data); 0.5 and std 0.5 map [0, 1] to [-1, 1]',
  ),
  Field(
    'data.std',
    'floats',
    (0.5,),
    'public per-channel std: x = (raw / scale - mean) / std',
    0,
    low_open=True,
  ),
  Field('data.label_format', 'str', 'int', 'int | one_hot', choices=data.LABEL_FORMATS),
  Field(
    'data.max_abs_feature',
    'float',
    data_validation.MAX_ABS_FEATURE,
    'a public bound: an '
    'example with a feature beyond ±this after the preprocessing is refused when the data '
    'is opened (npz, memmap, digits), before training',
    0,
    low_open=True,
  ),
)
