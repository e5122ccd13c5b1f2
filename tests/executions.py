"""Counting the compiled programs a piece of code really executes, by name."""

import collections


def count_executions(monkeypatch) -> collections.Counter:
  """Counts every execution of a compiled program (jitted calls and eager ops alike) by name.

  jit's C++ fast path runs cached executables without Python; with no fast-path data every
  call goes through pxla.ExecuteReplicated, which this counts. Only the C++ fast-path caches are
  cleared first (what `jax.clear_caches` clears besides them, the traces, lowerings and
  executables of every earlier test in this worker, would have to be rebuilt by later tests)."""
  from jax._src import pjit  # pylint: disable=import-outside-toplevel
  from jax._src.interpreters import pxla  # pylint: disable=import-outside-toplevel
  from jax._src.lib import _jax  # pylint: disable=import-outside-toplevel

  counts = collections.Counter()
  original = pxla.ExecuteReplicated.__call__

  def counted(self, *args):
    counts[self.name] += 1
    return original(self, *args)

  pjit._cpp_pjit_cache_fun_only.clear()  # pylint: disable=protected-access
  pjit._cpp_pjit_cache_explicit_attributes.clear()  # pylint: disable=protected-access
  _jax.PjitFunctionCache.clear_all()
  monkeypatch.setattr(pjit, '_get_fastpath_data', lambda *args, **kwargs: None)
  monkeypatch.setattr(pxla.ExecuteReplicated, '__call__', counted)
  return counts
