"""WRN-16-4 with GroupNorm (De et al. 2022) on CIFAR-10 (TFDS, prepared).

The config ships with dpjax (dpjax/configs/cifar10_wrn.py, its docstring has the details);
this file lets the commands in the README name it by path:
  python -m dpjax.train --config configs/cifar10_wrn.py --workdir workdirs/cifar10_wrn
"""

from dpjax.configs.cifar10_wrn import get_config  # noqa: F401  pylint: disable=unused-import
