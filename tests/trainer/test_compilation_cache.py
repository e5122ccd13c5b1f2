"""dpjax.trainer.loop.compilation_cache: where the cache goes, off switch, and a warm rerun hits it."""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

from dpjax.trainer.loop import compilation_cache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_resolve_cache_dir(monkeypatch, tmp_path):
  monkeypatch.delenv(compilation_cache.ENV_VAR, raising=False)
  assert compilation_cache.resolve_cache_dir('') == os.path.expanduser('~/.cache/dpjax/xla')
  monkeypatch.setenv(compilation_cache.ENV_VAR, str(tmp_path / 'env'))
  assert compilation_cache.resolve_cache_dir('') == str(tmp_path / 'env')
  assert compilation_cache.resolve_cache_dir(str(tmp_path / 'x')) == str(tmp_path / 'x')
  assert compilation_cache.resolve_cache_dir('none') is None
  assert compilation_cache.resolve_cache_dir('None') is None
  with pytest.raises(ValueError, match='compilation_cache_dir must be a string'):
    compilation_cache.resolve_cache_dir(None)


@pytest.mark.slow
def test_second_process_reads_the_programs_the_first_wrote(tmp_path):
  """Two fresh processes compile the same program: the second is a cache hit."""
  script = textwrap.dedent(f"""
      import jax, jax.numpy as jnp
      from dpjax.trainer.loop import compilation_cache
      hits = []
      jax.monitoring.register_event_listener(
          lambda name, **kw: hits.append(name) if name.endswith('cache_hits') else None)
      path = compilation_cache.enable_compilation_cache({str(tmp_path / 'cache')!r}, 0)
      f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3.0)
      value = float(f(jnp.ones((64, 64))))
      print(len(hits), value)
  """)
  env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_')}
  outs = [
    subprocess.run(
      [sys.executable, '-c', script],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
      check=True,
    ).stdout.split()
    for _ in range(2)
  ]
  assert outs[0][0] == '0' and int(outs[1][0]) >= 1, outs  # Cold, then warm.
  assert outs[0][1] == outs[1][1]  # The same program, the same result.
  assert os.listdir(tmp_path / 'cache')


def test_none_turns_the_cache_off():
  before = jax.config.jax_enable_compilation_cache
  try:
    assert compilation_cache.enable_compilation_cache('none') is None
    assert not jax.config.jax_enable_compilation_cache
  finally:
    jax.config.update('jax_enable_compilation_cache', before)
