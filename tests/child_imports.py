"""Which modules a fresh interpreter holds after running some code (tests of import costs)."""

import subprocess
import sys
from collections.abc import Iterable

from dpjax.utils.child_env import child_env


def imported(code: str, modules: Iterable[str]) -> list[str]:
  """Those of `modules` that `sys.modules` holds after a fresh `python -c code`."""
  probe = f'{code}\nimport sys\nprint(",".join(m for m in {tuple(modules)!r} if m in sys.modules))'
  out = subprocess.run(
    [sys.executable, '-c', probe], capture_output=True, text=True, check=True, env=child_env()
  )
  return [m for m in out.stdout.strip().split(',') if m]
