"""Random-allocation PLD of one balls-and-bins epoch: built in a child process, cached on disk.

Balls-and-bins puts each example in one of T steps per epoch, uniformly: "random allocation"
(Feldman & Shenfeld 2025, "Privacy amplification by random allocation"). The package
`pld-accounting` (import `PLD_accounting`) builds a discretised PLD of one epoch that
*dominates* the tight pair (pessimistic rounding; the truncated tail mass goes to an infinite
loss, so it is paid in δ) or is *dominated* by it (an optimistic one):
`PLD_accounting.gaussian_allocation_pld(..., bound_type=BoundType.DOMINATES / IS_DOMINATED)`.

Why dpjax's ε may sit below the upper end of `PLD_accounting.gaussian_allocation_epsilon_range`:
both are ε(δ) of this one construction (GEOM convolution): the remove PMF of the loss
L(x) = log((1/T) Σ_t e^{(2x_t − 1)/(2σ²)}) of the tight pair P = (1/T) Σ_t N(e_t, σ²I) vs
Q = N(0, σ²I), and the add PMF of its mirror, both kept, ε the worse of the two (dp_accounting's
`PrivacyLossDistribution`). The range function (`adaptive_random_allocation.
optimize_allocation_epsilon_range`) builds it at grid ε_Poisson/20 and tail mass δ/10 and returns
the first pair with upper/lower ≤ 1.1, usually that first one; dpjax builds it at grid
min(ε_Poisson/12, 0.02) and tail mass ≤ δ/1000. Where ε_Poisson > 0.4 (the range's grid above
dpjax's 0.02) dpjax's ε is thus the library's own upper bound on a finer setting, and may sit below
the range's upper end (never below its lower end); at smaller ε dpjax's grid is the coarser one
and its ε may sit above (tests/privacy/accounting/test_random_allocation_vs_library.py).

Epochs use independent assignments, so E epochs are dominated by the E-fold composition of the
one-epoch PLD; dp_accounting composes a pessimistic PLD pessimistically (truncated tails to the
infinite loss) and an optimistic one optimistically. One build per (σ, T, grid) therefore
serves every epoch count E and every δ: ε = `pld.self_compose(E).get_epsilon_for_delta(δ)`.

Grid: the build's cost grows as the loss grid shrinks (`scripts/bench_accounting_scaling.py`).
`default_discretization` picks the grid from the Poisson ε of one epoch (≈ the answer):
ε_Poisson/12, so the rounding costs a few percent of ε at any σ and T. Composing E epochs is
cheap beside the build.

The build runs in a child process (`python -m dpjax.privacy.accounting.random_allocation`; numba
code cannot be interrupted in-process) killed after `timeout` seconds. PLDs are cached as
.npz files and timeouts in a JSON index, keyed by (σ, T, grid, tail mass, bound, library
version), in $DPJAX_CACHE_DIR, else $XDG_CACHE_HOME/dpjax, else ~/.cache/dpjax.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpjax.privacy.accounting import gaussian_pld
from dpjax.privacy.accounting import pld_self_compose
from dpjax.utils.child_env import child_env

# Seconds allowed to one new build under the default policy (then cached, or remembered as
# timed out with this budget). `Accountant(random_allocation_timeout=...)`, or
# `python -m dpjax.account --random-allocation-timeout`, raises it.
RANDOM_ALLOCATION_TIMEOUT = 300.0
# The grid is ε_Poisson(one epoch, δ) / GRID_FRACTION, clipped to [MIN_GRID, MAX_GRID] and
# rounded down to two significant digits (so nearby σ share nothing, but a rerun hits the cache).
GRID_FRACTION = 12.0
MIN_GRID, MAX_GRID = 1e-3, 0.02
BOUNDS = ('upper', 'lower')

_CACHE_ENV = 'DPJAX_CACHE_DIR'
_INDEX_FILE = 'random_allocation_v2.json'
_memo: dict[str, object] = {}
_seconds: dict[str, float] = {}


def library_version() -> str:
  try:
    return metadata.version('pld-accounting')
  except metadata.PackageNotFoundError:
    return 'unknown'


def default_discretization(noise_multiplier: float, num_steps: int, delta: float) -> float:
  """`_default_discretization`, kept per process by its exact arguments and their types (a
  report asks for it from its grid and again from its epochs' grid; a Poisson composition)."""
  try:
    return _kept_default_discretization(noise_multiplier, num_steps, delta)
  except TypeError:  # Unhashable (an array): computed, not kept.
    return _default_discretization(noise_multiplier, num_steps, delta)


def _default_discretization(noise_multiplier: float, num_steps: int, delta: float) -> float:
  """Loss grid for one epoch: ε of the Poisson-subsampled Gaussian (q = 1/T, T steps)/12.

  Balls-and-bins' ε is within a few percent of Poisson's at moderate σ (Chua et al. 2025,
  Fig. 2), so this grid makes the rounding a small fraction of the answer at any scale. The
  Poisson ε is a cheap pessimistic one (grid 1e-3), which overstates small ε, so there the
  grid is coarser than ε/12. Deliberately: at T = 10⁴ the tight Poisson ε would ask for a grid
  2-4× finer (0.0051 instead of 0.0085 at σ = 0.8, 0.0011 instead of 0.0048 at σ = 2:
  scripts/results/accounting_grid.json), each halving costing 3-6× a build that takes ~70 s
  already, past the time budget and into the deterministic fallback. A finer grid is what
  `provable_bound.provable_epsilon(refine_seconds=...)` buys, by halving, within a budget.
  """
  poisson = gaussian_pld.gaussian_pld(noise_multiplier, 1e-3, sampling_prob=1.0 / num_steps)
  poisson = pld_self_compose.self_compose(poisson, num_steps)
  grid = float(poisson.get_epsilon_for_delta(delta)) / GRID_FRACTION
  grid = min(MAX_GRID, max(MIN_GRID, grid))
  digits = 10.0 ** (math.floor(math.log10(grid)) - 1)
  return math.floor(grid / digits) * digits


_kept_default_discretization = functools.lru_cache(maxsize=256, typed=True)(_default_discretization)


def epochs_discretization(
  noise_multiplier: float, num_steps: int, delta: float, num_epochs: int
) -> float:
  """Grid for a one-epoch PLD that will be composed E times: the one-epoch grid / 2^⌊log₂√E⌋.

  Pessimistic rounding adds up over the composition (linearly in E·grid), while ε grows like
  √E: dividing the grid by ≥ √E/2 keeps the rounding a similar fraction of ε (a finer grid
  costs more to build). Powers of two share one build between nearby E (E = 1-3, 4-15,
  16-63, ...).
  """
  grid = default_discretization(noise_multiplier, num_steps, delta)
  return grid / 2 ** math.floor(0.5 * math.log2(num_epochs))


def default_tail_truncation(delta: float) -> float:
  """Tail mass the build may truncate: a power of ten ≤ δ/1000 (≤ 1e-8). Paid in δ (upper)."""
  return min(1e-8, 10.0 ** math.floor(math.log10(delta / 1000)))


# ---------------------------------------------------------------------------------------------
# The build (in this process) and its file format
# ---------------------------------------------------------------------------------------------


def build_epoch_pld(
  noise_multiplier: float,
  num_steps: int,
  discretization: float,
  tail_truncation: float,
  bound: str = 'upper',
) -> pld_lib.PrivacyLossDistribution:
  """One epoch's random-allocation PLD by `PLD_accounting` (no time limit; see `epoch_pld`)."""
  import PLD_accounting  # pylint: disable=g-import-not-at-top

  bound_type = (
    PLD_accounting.BoundType.DOMINATES
    if bound == 'upper'
    else PLD_accounting.BoundType.IS_DOMINATED
  )
  return PLD_accounting.gaussian_allocation_pld(
    params=PLD_accounting.PrivacyParams(
      sigma=noise_multiplier, num_steps=num_steps, num_selected=1, num_epochs=1
    ),
    config=PLD_accounting.AllocationSchemeConfig(
      loss_discretization=discretization, tail_truncation=tail_truncation
    ),
    bound_type=bound_type,
  )


def save_pld(pld: pld_lib.PrivacyLossDistribution, path: os.PathLike) -> None:
  """Both directions' dense PMFs to an .npz (atomically: a temporary file, then a rename)."""
  # pylint: disable=protected-access
  arrays = {}
  for name, pmf in (('remove', pld._pmf_remove), ('add', pld._pmf_add)):
    dense = pmf.to_dense_pmf()
    arrays[name + '_probs'] = np.asarray(dense._probs, dtype=np.float64)
    arrays[name + '_meta'] = np.array(
      [
        dense._discretization,
        dense._lower_loss,
        dense._infinity_mass,
        float(dense._pessimistic_estimate),
      ]
    )
  # pylint: enable=protected-access
  path = pathlib.Path(path)
  with tempfile.NamedTemporaryFile(dir=path.parent, suffix='.npz', delete=False) as f:
    np.savez(f, **arrays)
  os.replace(f.name, path)


def load_pld(path: os.PathLike) -> pld_lib.PrivacyLossDistribution:
  with np.load(path) as data:
    pmfs = []
    for name in ('remove', 'add'):
      disc, lower, inf_mass, pessimistic = data[name + '_meta']
      pmfs.append(
        pld_pmf.DensePLDPmf(
          float(disc), int(lower), data[name + '_probs'], float(inf_mass), bool(pessimistic)
        )
      )
  return pld_lib.PrivacyLossDistribution(pmfs[0], pmfs[1])


def main(argv=None) -> int:
  """Child-process entry: build one PLD and write it to an .npz."""
  p = argparse.ArgumentParser(prog='python -m dpjax.privacy.accounting.random_allocation')
  p.add_argument('sigma', type=float)
  p.add_argument('num_steps', type=int)
  p.add_argument('discretization', type=float)
  p.add_argument('tail_truncation', type=float)
  p.add_argument('bound', choices=BOUNDS)
  p.add_argument('out')
  a = p.parse_args(argv)
  save_pld(
    build_epoch_pld(a.sigma, a.num_steps, a.discretization, a.tail_truncation, a.bound), a.out
  )
  return 0


# ---------------------------------------------------------------------------------------------
# Cache and time budget
# ---------------------------------------------------------------------------------------------


def cache_dir() -> pathlib.Path:
  root = os.environ.get(_CACHE_ENV) or os.path.join(
    os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'dpjax'
  )
  return pathlib.Path(root)


def cache_key(
  noise_multiplier: float, num_steps: int, discretization: float, tail_truncation: float, bound: str
) -> str:
  """Everything the PLD depends on, the library version included."""
  return (
    f'pld-accounting={library_version()}|sigma={noise_multiplier!r}|T={num_steps}|'
    f'grid={discretization!r}|tail={tail_truncation!r}|bound={bound}'
  )


def _read_index() -> dict:
  try:
    return json.loads((cache_dir() / _INDEX_FILE).read_text())
  except (OSError, ValueError):
    return {}


def _remember(key: str, entry: dict) -> None:
  """{'timeout': budget} (the build did not finish) or {'seconds': s} (it took s), on disk."""
  if 'timeout' in entry:
    _memo[key] = entry
  else:
    _seconds[key] = entry['seconds']
  path = cache_dir() / _INDEX_FILE
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    index = _read_index()
    index[key] = entry
    with tempfile.NamedTemporaryFile('w', dir=path.parent, delete=False, suffix='.tmp') as f:
      json.dump(index, f, indent=1, sort_keys=True)
    os.replace(f.name, path)
  except OSError:
    pass  # A cache that cannot be written only costs time.


def build_seconds(
  noise_multiplier: float,
  num_steps: int,
  discretization: float,
  tail_truncation: float,
  bound: str = 'upper',
) -> float | None:
  """How long this PLD took to build (recorded beside the cache), None if unknown."""
  key = cache_key(
    float(noise_multiplier), int(num_steps), float(discretization), float(tail_truncation), bound
  )
  if key not in _seconds:
    entry = _read_index().get(key)
    if not (isinstance(entry, dict) and 'seconds' in entry):
      return None
    _seconds[key] = float(entry['seconds'])
  return _seconds[key]


def _npz_path(key: str) -> pathlib.Path:
  return cache_dir() / ('ra_pld_' + hashlib.sha256(key.encode()).hexdigest()[:24] + '.npz')


def _writable(path: pathlib.Path) -> pathlib.Path:
  """`path` if its cache directory can be written, else the same name in a fresh temporary
  directory (HOME or $DPJAX_CACHE_DIR not writable: the PLD is built uncached)."""
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    probe = tempfile.NamedTemporaryFile(dir=path.parent, delete=True)
    probe.close()
  except OSError:  # HOME or $DPJAX_CACHE_DIR not writable: build it uncached.
    print(
      f'dpjax: the cache {path.parent} is not writable; the PLD is built without caching.',
      file=sys.stderr,
      flush=True,
    )
    path = pathlib.Path(tempfile.mkdtemp(prefix='dpjax-ra-')) / path.name
  return path


def epoch_pld(
  noise_multiplier: float,
  num_steps: int,
  *,
  discretization: float,
  tail_truncation: float = 1e-8,
  bound: str = 'upper',
  timeout: float | None = RANDOM_ALLOCATION_TIMEOUT,
  progress: bool = True,
) -> pld_lib.PrivacyLossDistribution | None:
  """One epoch's random-allocation PLD (`bound`: 'upper' dominating, 'lower' dominated).

  From the in-process memo or the disk cache if there; else built in a child process killed
  after `timeout` seconds (None: no limit), with a progress line on stderr. Returns None on a
  timeout, now or remembered from an earlier call with at least this budget. A failure of
  the child is a RuntimeError carrying the end of its stderr.
  """
  if bound not in BOUNDS:
    raise ValueError(f'bound must be one of {BOUNDS}, got {bound!r}.')
  key = cache_key(
    float(noise_multiplier), int(num_steps), float(discretization), float(tail_truncation), bound
  )
  budget = math.inf if timeout is None else float(timeout)
  cached = _memo.get(key)
  if isinstance(cached, pld_lib.PrivacyLossDistribution):
    return cached
  path = _npz_path(key)
  if path.exists():
    try:
      _memo[key] = load_pld(path)
      return _memo[key]
    except (OSError, ValueError, KeyError):
      pass  # A damaged file is rebuilt.
  failed = cached if isinstance(cached, dict) else _read_index().get(key)
  if isinstance(failed, dict) and failed.get('timeout', 0) >= budget:
    return None  # Already timed out with at least this budget.
  path = _writable(path)
  what = (
    f'random-allocation PLD ({bound} bound) of one epoch, σ = {noise_multiplier:g}, '
    f'T = {num_steps}, grid {discretization:g}'
  )
  if progress:
    limit = 'no time limit' if timeout is None else f'time budget {budget:g} s'
    print(
      f'dpjax: building the {what} ({limit}; cached afterwards)...', file=sys.stderr, flush=True
    )
  start = time.monotonic()
  argv = [
    sys.executable,
    '-m',
    'dpjax.privacy.accounting.random_allocation',
    repr(float(noise_multiplier)),
    str(int(num_steps)),
    repr(float(discretization)),
    repr(float(tail_truncation)),
    bound,
    str(path),
  ]
  try:  # The child imports this very copy of dpjax, installed or not.
    subprocess.run(
      argv,
      capture_output=True,
      text=True,
      check=True,
      env=child_env(),
      timeout=None if timeout is None else budget,
    )
  except subprocess.TimeoutExpired:
    _remember(key, {'timeout': budget})
    if progress:
      print(f'dpjax: the {what} did not finish in {budget:g} s.', file=sys.stderr, flush=True)
    return None
  except subprocess.CalledProcessError as e:
    raise RuntimeError(f'random-allocation PLD failed: {(e.stderr or "")[-2000:]}') from e
  _remember(key, {'seconds': time.monotonic() - start})
  if progress:
    print(f'dpjax: built in {_seconds[key]:.1f} s.', file=sys.stderr, flush=True)
  _memo[key] = load_pld(path)
  return _memo[key]


if __name__ == '__main__':
  sys.exit(main())
