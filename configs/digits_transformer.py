"""Transformer encoder on digits read as sequences of 8 rows (embedded data).

The config ships with dpjax (dpjax/configs/digits_transformer.py, its docstring has the details);
this file lets the commands in the README name it by path:
  python -m dpjax.train --config configs/digits_transformer.py --workdir workdirs/digits_transformer
"""

from dpjax.configs.digits_transformer import get_config  # noqa: F401  pylint: disable=unused-import
