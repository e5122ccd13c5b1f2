"""Provable ε for balls-and-bins (and the shared Gaussian / truncation helpers).

Balls-and-bins (Chua et al. 2025, "Balls-and-Bins Sampling for DP-SGD", seed
000) puts every example in one of T batches per epoch, uniformly and
independently: "random allocation" of each example to 1 of T steps.

Three numbers are computed (docs/accounting.md §2):

* Provable upper bound, the ε attached to a run: the smaller of
  - random-allocation PLD (Feldman & Shenfeld 2025, "Privacy amplification by
    random allocation"; package `pld-accounting`,
    `PLD_accounting.gaussian_allocation_epsilon_range`, which returns a
    dominating (upper) and a dominated (lower) PLD bound), used when it is
    fast enough (policy below), and
  - the deterministic-order bound: each epoch is a mixture over fixed
    assignments, each the Gaussian mechanism with sensitivity k, so by joint
    convexity ε ≤ ε of `GaussianDpEvent(σ/k)` composed E times (seed 000, §3).
  The result is never above the deterministic bound.
* The Monte-Carlo estimate (`monte_carlo.py`): a *high-probability* upper
  bound (confidence 1 − β), reported beside the provable one.
* The max-test lower bound (`max_test.py`), reported beside both.

Policy for random-allocation PLD. Its cost (`scripts/bench_accounting.py`,
δ = 1e-5, one core of a shared, busy 2-core machine, pld-accounting 2.0 with
its default 10% relative accuracy; `scripts/results/bench_accounting.json`):

  gaussian_allocation_epsilon_range, E = 1: T = 10: ~2 s;  T = 100: 8-15 s at
  σ = 1 but 27-47 s at σ = 2 (smaller ε, finer grid);  T = 300: 110 s;
  T = 1000: 580-870 s;  T = 1e4: not finished in 15 min.  Its cost also grows
  with E (T = 100, E = 4: 94 s; T = 6, E = 40: > 5 min).

It grows steeply with T, σ and E, so a threshold on T alone cannot bound it.
Default: attempt it when T <= 100 (RANDOM_ALLOCATION_MAX_STEPS), in a
subprocess killed after 120 s (RANDOM_ALLOCATION_TIMEOUT). For E = 1 the
adaptive `gaussian_allocation_epsilon_range` (upper and lower bound); for
E > 1 one dominating one-epoch PLD per (σ, T) (grid 0.02; T = 6: 2.6 s,
T = 10: 4.5 s, T = 100: 5-13 s on an idle core, up to ~30 s on a busy one)
composed E times by dp_accounting (0.02 s per epoch count; T = 100, σ = 1:
ε = 0.63 / 1.77 / 3.87 after 1 / 10 / 40 epochs vs 4.38 / 17.9 / 46.2
deterministic). Results and timeouts are
memoised in-process and on disk. Otherwise, or on timeout, the deterministic
bound is attached and the Monte-Carlo estimate beside it shows how much
tighter the truth likely is. `random_allocation=True` forces it (no limit).

Truncation to a cap B (any sampler; Chua et al. 2024b, "Scalable DP-SGD:
Shuffling vs. Poisson Subsampling"): coupling the truncated and untruncated
runs on the same randomness, they differ only if some batch was truncated, so
their total variation is at most τ = (#steps)·Pr[n_t > B], and an (ε, δ₀)-DP
untruncated mechanism gives an (ε, δ₀ + (1 + e^ε)·τ)-DP truncated one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any, Callable

import numpy as np
from dp_accounting.pld import privacy_loss_mechanism
from scipy import stats

from dpjax.accounting import sampler_events

# Default policy for random-allocation PLD (see the module docstring).
RANDOM_ALLOCATION_MAX_STEPS = 100
RANDOM_ALLOCATION_TIMEOUT = 120.0  # seconds per (σ, T, E, δ), once (then cached)
# E > 1: one dominating one-epoch PLD per (σ, T) at this grid, composed E times.
EPOCH_PLD_DISCRETIZATION = 0.02
EPOCH_PLD_TAIL_TRUNCATION = 1e-8
# A truncation penalty priced at the deterministic ε that takes more than this fraction of δ
# is instead solved jointly with the random-allocation PLD (`provable_epsilon`).
NEGLIGIBLE_PENALTY = 1e-2

_CACHE_ENV = 'DPJAX_CACHE_DIR'
_CACHE_FILE = 'random_allocation_v1.json'


# ---------------------------------------------------------------------------------------------
# ε from a monotone δ(ε), with and without a truncation penalty
# ---------------------------------------------------------------------------------------------


def smallest_epsilon(delta_at: Callable[[float], float], delta: float, *,
                     penalty_mass: float = 0.0, rel_tol: float = 1e-9) -> float:
  """An ε with δ(ε) + (1 + e^ε)·τ ≤ δ, as small as bisection finds (inf if none).

  `delta_at` must be non-increasing. The bisection keeps an upper end `hi` at
  which the inequality holds and returns it, so the answer is always valid
  (rounded up, never down). With τ = 0 it is the smallest such ε to `rel_tol`.
  """
  def ok(eps):
    penalty = (1.0 + math.exp(eps)) * penalty_mass if penalty_mass > 0 else 0.0
    return delta_at(eps) + penalty <= delta

  if penalty_mass >= delta / 2:
    return math.inf
  if ok(0.0):
    return 0.0
  lo, hi = 0.0, 1.0
  # Beyond max_eps the penalty alone exceeds δ.
  max_eps = math.log(delta / penalty_mass - 1.0) if penalty_mass > 0 else 1e8
  while not ok(hi):
    lo, hi = hi, 2 * hi
    if hi > max_eps:
      if not ok(max_eps):
        return math.inf
      hi = max_eps
      break
  while hi - lo > rel_tol * max(1.0, hi):
    mid = 0.5 * (lo + hi)
    if ok(mid):
      hi = mid
    else:
      lo = mid
  return hi


def gaussian_delta(noise_multiplier: float, epsilon: float) -> float:
  """δ(ε) of the Gaussian mechanism, sensitivity 1 (dp_accounting's closed form)."""
  return float(privacy_loss_mechanism.GaussianPrivacyLoss(
      noise_multiplier, sensitivity=1.0).get_delta_for_epsilon(epsilon))


def deterministic_epsilon(noise_multiplier: float, num_epochs: int, delta: float, *,
                          group_size: int = 1, penalty_mass: float = 0.0) -> float:
  """Exact ε of E epochs in a fixed order: `GaussianDpEvent(σ/k)` composed E times.

  E Gaussian releases of sensitivity k compose to one of sensitivity k√E, so
  this is the Gaussian mechanism with noise σ/(k√E), solved in closed form
  (Balle & Wang 2018 via dp_accounting) and rounded up. Also the always-valid
  upper bound for shuffle and balls-and-bins.
  """
  sigma = sampler_events.check_noise_multiplier(noise_multiplier)
  epochs = sampler_events.check_positive_int('num_epochs', num_epochs)
  k = sampler_events.check_positive_int('group_size k', group_size)
  _check_delta(delta)
  effective = sigma / (k * math.sqrt(epochs))
  return smallest_epsilon(lambda eps: gaussian_delta(effective, eps), delta,
                          penalty_mass=penalty_mass)


# ---------------------------------------------------------------------------------------------
# Truncation
# ---------------------------------------------------------------------------------------------


def log_truncation_mass(num_examples: int, sampling_probability: float, max_batch_size: int,
                        num_steps: int, *, group_size: int = 1) -> float:
  """log τ, τ = T·Pr[n_t > B] with n_t ~ Binomial(N + k, p): the TV penalty's mass.

  Batch sizes of Poisson (p = q) and balls-and-bins (p = 1/T) are binomial.
  The larger neighbouring dataset (N + k examples) has the larger tail, so it
  bounds both directions. Log-space (scipy.stats.binom.logsf): no underflow
  or overflow at N = 1e7.
  """
  log_sf = float(stats.binom.logsf(max_batch_size, num_examples + group_size,
                                   sampling_probability))
  return math.log(num_steps) + log_sf


# ---------------------------------------------------------------------------------------------
# Random-allocation PLD (pld-accounting): in a subprocess with a time budget, memoised
# ---------------------------------------------------------------------------------------------

_SUBPROCESS_CODE = """
import json, sys, PLD_accounting
sigma, steps = float(sys.argv[1]), int(sys.argv[2])
epochs, delta = int(sys.argv[3]), float(sys.argv[4])
upper, lower = PLD_accounting.gaussian_allocation_epsilon_range(
    delta=delta, sigma=sigma, num_steps=steps, num_selected=1, num_epochs=epochs)
print(json.dumps([float(upper), float(lower)]))
"""
_memo: dict[str, Any] = {}


def random_allocation_is_practical(num_steps: int, num_epochs: int = 1) -> bool:
  """The default policy's first test: is random-allocation PLD worth attempting here?"""
  del num_epochs  # The time budget bounds the cost in E (and σ).
  return num_steps <= RANDOM_ALLOCATION_MAX_STEPS


def _cache_path() -> pathlib.Path:
  root = os.environ.get(_CACHE_ENV) or os.path.join(
      os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'dpjax')
  return pathlib.Path(root) / _CACHE_FILE


def _cache_key(sigma: float, num_steps: int, num_epochs: int, delta: float) -> str:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    version = metadata.version('pld-accounting')
  except metadata.PackageNotFoundError:
    version = 'unknown'
  return f'{version}|{sigma!r}|{num_steps}|{num_epochs}|{delta!r}'


def _read_disk_cache() -> dict:
  try:
    return json.loads(_cache_path().read_text())
  except (OSError, ValueError):
    return {}


def _write_disk_cache(key: str, value) -> None:
  path = _cache_path()
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    cache = _read_disk_cache()
    cache[key] = value
    with tempfile.NamedTemporaryFile('w', dir=path.parent, delete=False, suffix='.tmp') as f:
      json.dump(cache, f)
    os.replace(f.name, path)
  except OSError:
    pass  # A cache that cannot be written only costs time.


def _run_with_budget(key: str, code: str, args: list[str], timeout: float | None) -> str | None:
  """stdout of `python -c code *args`, or None if it timed out, now or before.

  Killed after `timeout` seconds (None: no limit). A timeout is memoised under `key` with its
  budget, in-process and on disk, and a later call with no larger budget returns None at once.
  A failure of the subprocess is a RuntimeError carrying the end of its stderr.
  """
  budget = math.inf if timeout is None else float(timeout)
  cached = _memo.get(key) or _read_disk_cache().get(key)
  if isinstance(cached, dict) and cached.get('timeout', 0) >= budget:
    return None  # Already failed with at least this budget.
  try:
    out = subprocess.run([sys.executable, '-c', code, *args], capture_output=True, text=True,
                         check=True, timeout=None if timeout is None else budget)
  except subprocess.TimeoutExpired:
    _memo[key] = {'timeout': budget}
    _write_disk_cache(key, {'timeout': budget})
    return None
  except subprocess.CalledProcessError as e:
    raise RuntimeError(f'random-allocation PLD failed: {e.stderr[-2000:]}') from e
  return out.stdout


_EPOCH_PLD_CODE = """
import os, pickle, sys, PLD_accounting
sigma, steps, disc, tail, path = (float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                  float(sys.argv[4]), sys.argv[5])
pld = PLD_accounting.gaussian_allocation_pld(
    params=PLD_accounting.PrivacyParams(sigma=sigma, num_steps=steps, num_selected=1, num_epochs=1),
    config=PLD_accounting.AllocationSchemeConfig(loss_discretization=disc, tail_truncation=tail),
    bound_type=PLD_accounting.BoundType.DOMINATES)
with open(path + '.tmp', 'wb') as f:
  pickle.dump(pld, f)
os.replace(path + '.tmp', path)
"""


def random_allocation_epoch_pld(noise_multiplier: float, num_steps: int, *,
                                timeout: float | None = RANDOM_ALLOCATION_TIMEOUT):
  """A dominating (pessimistic) PLD of *one* epoch of balls-and-bins, or None on timeout.

  `PLD_accounting.gaussian_allocation_pld(..., BoundType.DOMINATES)` at loss grid
  EPOCH_PLD_DISCRETIZATION and tail mass EPOCH_PLD_TAIL_TRUNCATION (moved to an
  infinite loss, so it is paid in δ). Epochs use independent assignments, so the E-epoch
  mechanism is dominated by the E-fold composition of this PLD (dp_accounting composes
  pessimistic PLDs pessimistically): one build per (σ, T) serves every epoch count and δ.
  Built in a subprocess (killed after `timeout` s), pickled into the cache directory.
  """
  import pickle  # pylint: disable=g-import-not-at-top
  sigma = sampler_events.check_noise_multiplier(noise_multiplier)
  steps = sampler_events.check_positive_int('num_steps T', num_steps)
  key = _cache_key(sigma, steps, 0, EPOCH_PLD_DISCRETIZATION) + f'|{EPOCH_PLD_TAIL_TRUNCATION!r}'
  if key in _memo and not isinstance(_memo[key], dict):
    return _memo[key]
  name = 'ra_epoch_pld_' + hashlib.sha256(key.encode()).hexdigest()[:24] + '.pkl'
  path = _cache_path().parent / name
  if path.exists():
    with open(path, 'rb') as f:
      _memo[key] = pickle.load(f)
    return _memo[key]
  path.parent.mkdir(parents=True, exist_ok=True)
  if _run_with_budget(key, _EPOCH_PLD_CODE, [repr(sigma), str(steps),
                                             repr(EPOCH_PLD_DISCRETIZATION),
                                             repr(EPOCH_PLD_TAIL_TRUNCATION), str(path)],
                      timeout) is None:
    return None
  with open(path, 'rb') as f:
    _memo[key] = pickle.load(f)
  return _memo[key]


def random_allocation_epsilon_range(noise_multiplier: float, num_steps: int, delta: float, *,
                                    num_epochs: int = 1,
                                    timeout: float | None = RANDOM_ALLOCATION_TIMEOUT
                                    ) -> tuple[float, float] | None:
  """(upper, lower) ε of balls-and-bins by random-allocation PLD, or None on timeout.

  Feldman & Shenfeld 2025; `PLD_accounting.gaussian_allocation_epsilon_range`.
  `upper` comes from a dominating (pessimistic) discretised PLD and is a
  provable upper bound; `lower` from a dominated one, a provable lower bound on
  the ε of the tight pair. It runs in a subprocess killed after `timeout`
  seconds (None: no limit), since its cost grows steeply with T and σ (module
  docstring). Results, and timeouts with their budget, are memoised by
  (σ, T, E, δ, package version) in-process and on disk ($DPJAX_CACHE_DIR, else
  ~/.cache/dpjax).
  """
  sigma = sampler_events.check_noise_multiplier(noise_multiplier)
  steps = sampler_events.check_positive_int('num_steps T', num_steps)
  epochs = sampler_events.check_positive_int('num_epochs', num_epochs)
  _check_delta(delta)
  key = _cache_key(sigma, steps, epochs, float(delta))
  cached = _memo.get(key) or _read_disk_cache().get(key)
  if isinstance(cached, list):
    _memo[key] = cached
    return float(cached[0]), float(cached[1])
  stdout = _run_with_budget(key, _SUBPROCESS_CODE,
                            [repr(sigma), str(steps), str(epochs), repr(float(delta))], timeout)
  if stdout is None:
    return None
  upper, lower = json.loads(stdout.strip().splitlines()[-1])
  _memo[key] = [upper, lower]
  _write_disk_cache(key, [upper, lower])
  return float(upper), float(lower)


# ---------------------------------------------------------------------------------------------
# The provable bound
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProvableBound:
  """The provable ε attached to a balls-and-bins run, and what it came from.

  Attributes:
    epsilon: min(random-allocation upper, deterministic); a provable upper bound.
    method: 'random_allocation_pld' or 'deterministic'.
    deterministic_epsilon: the always-valid fallback (with the truncation penalty).
    random_allocation_upper: random-allocation PLD upper bound, or None if not run.
    random_allocation_lower: random-allocation PLD lower bound (the tight pair's ε
      is at least this), or None.
    delta0: δ spent on the untruncated mechanism (δ minus the truncation penalty).
  """

  epsilon: float
  method: str
  deterministic_epsilon: float
  random_allocation_upper: float | None
  random_allocation_lower: float | None
  delta0: float


def provable_epsilon(noise_multiplier: float, num_steps: int, delta: float, *,
                     num_epochs: int = 1, group_size: int = 1, log_penalty_mass: float = -math.inf,
                     random_allocation: bool | None = None,
                     timeout: float | None = RANDOM_ALLOCATION_TIMEOUT) -> ProvableBound:
  """Provable ε(δ) of E epochs of balls-and-bins with T steps each.

  Args:
    noise_multiplier: σ.
    num_steps: T, bins (steps) per epoch.
    delta: the target δ (the total, truncation penalty included).
    num_epochs: E, epochs started so far.
    group_size: k. Random allocation covers k = 1 only; k > 1 uses the
      deterministic bound with sensitivity k.
    log_penalty_mass: log τ of the truncation penalty (−inf: no truncation).
    random_allocation: force (True: no time limit) or skip (False)
      random-allocation PLD; None: attempt it when T <= 100, within `timeout`.
    timeout: seconds allowed to random-allocation PLD under the default policy.
  """
  tau = math.exp(log_penalty_mass)
  det = deterministic_epsilon(noise_multiplier, num_epochs, delta, group_size=group_size,
                              penalty_mass=tau)
  use_ra = random_allocation_is_practical(num_steps, num_epochs) if random_allocation is None \
      else bool(random_allocation)
  # The untruncated mechanism gets δ₀ = δ − (1 + e^{ε_det})·τ, a δ₀ that does not depend on
  # the answer: any ε ≤ ε_det it yields keeps the total within δ.
  delta0 = delta - (1.0 + math.exp(det)) * tau if math.isfinite(det) else 0.0
  if group_size != 1 or not use_ra:
    return ProvableBound(det, 'deterministic', det, None, None, delta0)
  budget = None if random_allocation else timeout
  if delta0 < delta * (1.0 - NEGLIGIBLE_PENALTY):
    # Pricing the penalty at ε_det wastes δ (or all of it: ε_det ≈ 11.5 at σ = 1 after 5
    # epochs makes (1 + e^{ε_det})·τ > δ even for τ = δ/1000). Solve ε on the dominating
    # PLD itself: the smallest ε with δ_PLD(ε) + (1 + e^ε)·τ ≤ δ (experiments/06_truncation).
    pld = random_allocation_epoch_pld(noise_multiplier, num_steps, timeout=budget)
    if pld is None:
      return ProvableBound(det, 'deterministic (random-allocation PLD timed out)', det, None,
                           None, delta0)
    composed = pld.self_compose(num_epochs) if num_epochs > 1 else pld
    upper = smallest_epsilon(composed.get_delta_for_epsilon, delta, penalty_mass=tau)
    if upper < det:
      return ProvableBound(upper, 'random_allocation_pld (one-epoch PLD composed E times, '
                           'truncation penalty at ε)', det, upper, None,
                           delta - (1.0 + math.exp(upper)) * tau)
    return ProvableBound(det, 'deterministic', det, upper, None, delta0)
  if num_epochs == 1:
    result = random_allocation_epsilon_range(noise_multiplier, num_steps, delta0, timeout=budget)
    method = 'random_allocation_pld'
  else:
    pld = random_allocation_epoch_pld(noise_multiplier, num_steps, timeout=budget)
    result = None if pld is None else (
        float(pld.self_compose(num_epochs).get_epsilon_for_delta(delta0)), None)
    method = 'random_allocation_pld (one-epoch PLD composed E times)'
  if result is None:
    return ProvableBound(det, 'deterministic (random-allocation PLD timed out)', det, None, None,
                         delta0)
  upper, lower = result
  if upper < det:
    return ProvableBound(upper, method, det, upper, lower, delta0)
  return ProvableBound(det, 'deterministic', det, upper, lower, delta0)


def _check_delta(delta) -> None:
  if isinstance(delta, bool) or not isinstance(delta, (int, float, np.floating)) or not (
      0 < delta < 1):
    raise ValueError(f'delta must be in (0, 1), got {delta!r}.')
