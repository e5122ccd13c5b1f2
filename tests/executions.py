"""Counting the compiled programs a piece of code really executes, by name."""

import collections

import jax


def count_executions(monkeypatch) -> collections.Counter:
  """Counts every execution of a compiled program (jitted calls and eager ops alike) by name.

  jit's C++ fast path runs cached executables without Python; with no fast-path data every
  call goes through pxla.ExecuteReplicated, which this counts (caches cleared first)."""
  from jax._src import pjit  # pylint: disable=import-outside-toplevel
  from jax._src.interpreters import pxla  # pylint: disable=import-outside-toplevel

  counts = collections.Counter()
  original = pxla.ExecuteReplicated.__call__

  def counted(self, *args):
    counts[self.name] += 1
    return original(self, *args)

  jax.clear_caches()
  monkeypatch.setattr(pjit, '_get_fastpath_data', lambda *args, **kwargs: None)
  monkeypatch.setattr(pxla.ExecuteReplicated, '__call__', counted)
  return counts
