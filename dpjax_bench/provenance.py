"""What a measurement was produced by: the code's git state, the machine, the timing, atomically.

Every benchmark in scripts/ and experiment in experiments/ records these beside
its numbers (the developers' guide: ratios in one run, medians of repeats,
the machine named), so they share one implementation:

  from dpjax_bench import provenance
  record = {'git': provenance.git_state(), 'machine': provenance.machine(), ...}
  value, seconds = provenance.timed(fn)
  provenance.write_json(path, record)
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable

from dpjax.trainer.workdir.atomic_write import write_text_atomically

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # dpjax_bench/ is at the root.


def _git(*args: str) -> str | None:
  try:
    return subprocess.run(
      ['git', *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None  # Not a git checkout (e.g. an installed package).


def git_state(paths: tuple[str, ...] = ('dpjax',)) -> dict[str, Any]:
  """{'head': commit, '<paths>_uncommitted_changes': [porcelain lines under those paths]}.

  The default key is 'dpjax_uncommitted_changes'; paths=('dpjax', 'configs') gives
  'dpjax_configs_uncommitted_changes'.
  """
  dirty = _git('status', '--porcelain', '--', *paths)
  return {
    'head': _git('rev-parse', 'HEAD'),
    f'{"_".join(paths)}_uncommitted_changes': dirty.splitlines() if dirty else [],
  }


def load_average() -> list[float]:
  """The 1, 5 and 15 minute load averages (a shared machine: context for any time)."""
  return [round(v, 2) for v in os.getloadavg()]


def machine() -> dict[str, Any]:
  """Cores, load, Python, platform and (when jax is imported) the backend and device."""
  info: dict[str, Any] = {
    'cpu_count': os.cpu_count(),
    'load_average': load_average(),
    'python': platform.python_version(),
    'platform': platform.platform(),
  }
  jax = __import__('sys').modules.get('jax')
  if jax is not None:
    info.update(
      jax=jax.__version__, backend=jax.default_backend(), device=jax.devices()[0].device_kind
    )
  return info


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
  """(fn(), wall seconds)."""
  start = time.perf_counter()
  value = fn()
  return value, time.perf_counter() - start


def median_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
  """(median, all) wall seconds of `repeats` calls of fn."""
  times = [timed(fn)[1] for _ in range(repeats)]
  return statistics.median(times), times


def write_json(path: str, record: Any) -> None:
  """The record as indented JSON, written atomically (a reader never sees half a file)."""
  write_text_atomically(path, json.dumps(record, indent=2, sort_keys=False) + '\n')
