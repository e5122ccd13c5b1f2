"""A package's public names, imported on first use (PEP 562).

`import dpjax` (which every `python -m dpjax.<command>` runs first) stays instant, and a
process that needs one submodule (a Monte Carlo worker needs the sampler of privacy losses,
not the accountants) does not import the whole package through its `__init__`.
"""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(
  package: str, exports: dict[str, tuple[str, str]], namespace: dict
) -> tuple[Callable, Callable]:
  """(__getattr__, __dir__) for `package`: name -> (module, attribute), cached in `namespace`."""

  def getattr_(name: str):
    if name not in exports:
      raise AttributeError(f'module {package} has no attribute {name!r}')
    module, attribute = exports[name]
    value = getattr(importlib.import_module(module), attribute)
    namespace[name] = value
    return value

  def dir_():
    return sorted(set(namespace) | set(exports))

  return getattr_, dir_
