"""The environment of a child `python` that must import this checkout's dpjax from any cwd."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**overrides: str) -> dict[str, str]:
  """os.environ with the repository first on PYTHONPATH (what was there kept behind it).

  Replacing PYTHONPATH instead lost packages that a machine provides through it (the GPU
  check's wheels): the child then failed to import ml_collections.
  """
  path = os.pathsep.join([REPO] + ([os.environ['PYTHONPATH']] if os.environ.get('PYTHONPATH')
                                   else []))
  return dict(os.environ, PYTHONPATH=path, **overrides)
