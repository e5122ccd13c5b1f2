"""The environment of a child `python` that must import this very copy of dpjax, installed or not.

The folder that holds this dpjax package goes first on PYTHONPATH and what was there stays
behind it: replacing PYTHONPATH lost the packages a machine provides through it (a GPU
machine's carried wheels: the child then failed to import the config library).
"""

import os
import pathlib

ROOT = str(pathlib.Path(__file__).resolve().parents[2])  # The folder holding `dpjax/`.


def child_env(**overrides: str) -> dict[str, str]:
  """os.environ with ROOT first on PYTHONPATH, then `overrides`."""
  path = os.pathsep.join(
    [ROOT] + ([os.environ['PYTHONPATH']] if os.environ.get('PYTHONPATH') else [])
  )
  return dict(os.environ, PYTHONPATH=path, **overrides)
