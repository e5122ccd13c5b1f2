"""Ctrl-C or SIGTERM while a dpjax command starts: one line and exit 128 + signal, every CLI.

Each case is a real `python -m dpjax.<cli>` (run by runpy, as `-m` does) that sends itself the
signal when its imports reach absl, the first import every CLI makes after installing its
handler, so the signal lands at the same point of each run. Stopped there, a case costs an
interpreter start (~0.1 s). The signals during a command's own work are tested where the work
is: tests/e2e/test_export.py (during the write), tests/trainer/test_interrupts.py (the helper).
"""

import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # Whole trainings or child processes (`make test-unit` skips).

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs MODULE as __main__ (as `python -m` does) and sends SIGNAL to itself when `import absl`
# starts: a meta path finder sees the name first.
_SIGNAL_AT_IMPORT = """
import importlib.abc, os, runpy, signal, sys
class SignalAtImport(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name == 'absl':
      os.kill(os.getpid(), signal.{signal})
      for _ in range(1000):  # Bytecodes: Python runs the handler here.
        pass
    return None
sys.meta_path.insert(0, SignalAtImport())
sys.argv = [{module!r}]
runpy.run_module({module!r}, run_name='__main__', alter_sys=True)
"""

PROGS = {
  'dpjax.train': 'dpjax.train',
  'dpjax.export': 'python -m dpjax.export',
  'dpjax.account': 'python -m dpjax.account',
  'dpjax.planner': 'python -m dpjax.planner',
  'dpjax.audit': 'python -m dpjax.audit',
  'dpjax.checkpoints': 'python -m dpjax.checkpoints',
}
DETAILS = {
  'dpjax.train': ' before training started',
  'dpjax.export': ': --out holds the whole export or nothing, never a part',
}


@pytest.mark.parametrize(
  'module,signame',
  [(module, 'SIGINT') for module in PROGS]
  + [('dpjax.account', 'SIGTERM'), ('dpjax.train', 'SIGTERM')],
)
def test_a_signal_during_the_imports_is_one_line_and_exit_128_plus_signal(module, signame):
  """Fails on da06065: every CLI but dpjax.train printed KeyboardInterrupt's traceback and died
  of the signal (exit -2), and a SIGTERM killed any of them without a word (exit -15)."""
  proc = subprocess.run(
    [sys.executable, '-c', _SIGNAL_AT_IMPORT.format(signal=signame, module=module)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=60,
    env=dict(os.environ, JAX_PLATFORMS='cpu'),
  )
  what = 'interrupted (Ctrl-C)' if signame == 'SIGINT' else f'stopped by {signame}'
  assert (proc.returncode, proc.stderr, proc.stdout) == (
    128 + getattr(signal, signame),
    f'{PROGS[module]}: {what}{DETAILS.get(module, "")}.\n',
    '',
  )
