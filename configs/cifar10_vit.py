"""ViT-S/4 on CIFAR-10 (TFDS, prepared).

The config ships with dpjax (dpjax/configs/cifar10_vit.py, its docstring has the details);
this file lets the commands in the README name it by path:
  python -m dpjax.train --config configs/cifar10_vit.py --workdir workdirs/cifar10_vit
"""

from dpjax.configs.cifar10_vit import get_config  # noqa: F401  pylint: disable=unused-import
