"""A tiny TFDS builder over scikit-learn's digits, for testing the TFDS path.

It writes a real ArrayRecord dataset into a temporary data_dir, which dpjax
then reads back through `tfds.data_source`, exactly as for a user-prepared
dataset.
"""

import numpy as np
import tensorflow_datasets as tfds

from dpjax.data import digits


class DigitsTfds(tfds.core.GeneratorBasedBuilder):
  """scikit-learn digits as uint8 8x8x1 images (pixels 0..16), labels 0..9."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Test fixture.'}

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          'image': tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
          'label': tfds.features.ClassLabel(num_classes=10),
        }
      ),
      supervised_keys=('image', 'label'),
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    x_train, y_train, x_test, y_test = digits.load_digits_arrays()
    return {
      'train': self._generate_examples(x_train, y_train),
      'test': self._generate_examples(x_test, y_test),
    }

  def _generate_examples(self, images, labels):
    for i, (image, label) in enumerate(zip(images, labels)):
      yield i, {'image': image.astype(np.uint8), 'label': int(label)}


def build(data_dir: str) -> None:
  DigitsTfds(data_dir=data_dir, file_format='array_record').download_and_prepare()
