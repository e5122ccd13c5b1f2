"""Tanh CNN of Papernot et al. 2021 on MNIST (TFDS, prepared).

The config ships with dpjax (dpjax/configs/mnist_cnn.py, its docstring has the details);
this file lets the commands in the README name it by path:
  python -m dpjax.train --config configs/mnist_cnn.py --workdir workdirs/mnist_cnn
"""

from dpjax.configs.mnist_cnn import get_config  # noqa: F401  pylint: disable=unused-import
