"""The default run: MLP on scikit-learn's digits (embedded data).

The config ships with dpjax (dpjax/configs/digits_mlp.py, its docstring has the details);
this file lets the commands in the README name it by path:
  python -m dpjax.train --config configs/digits_mlp.py --workdir workdirs/digits_mlp
"""

from dpjax.configs.digits_mlp import get_config  # noqa: F401  pylint: disable=unused-import
