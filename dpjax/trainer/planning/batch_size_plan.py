"""The batch size plan: for each b at fixed (ε, δ, epochs), the σ training would calibrate.

`plan_batch_sizes` gives each b the config of the run with `sampler.batch_size = b`
and σ unset, resolved by `plan.make_accountant` exactly as `dpjax.train`
does; a `Plan` holds the rows and says what they show (docs/accounting.md §8,
seed 003). The command line and the meaning of the columns: `dpjax.planner`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable, Sequence

import ml_collections

from dpjax.privacy import checks as _checks
from dpjax.privacy import names
from dpjax.privacy.correlated import strategy

# The plan's and the accountants' imports (jax, dp_accounting) are in the functions that use
# them: `python -m dpjax.planner --help` answers without them.
# pylint: disable=import-outside-toplevel

# Within this factor of its smallest value on the grid, σ/(q·√S) counts as flat.
FLAT_TOLERANCE = 1.1
DEFAULT_SMALLEST_BATCH_SIZE = 32
DEFAULT_PHYSICAL_BATCH_SIZE = 64
# Samplers accounted without amplification by sampling (their σ does not depend on b).


@dataclasses.dataclass(frozen=True)
class PlanRow:
  """One batch size: the calibrated σ and what it means for the gradient."""

  batch_size: int
  steps_per_epoch: int
  num_steps: int
  noise_multiplier: float  # σ, as training would calibrate it.
  effective_noise: float  # σ·C/b, noise std on the averaged gradient.
  run_noise: float  # σ/(q·√S), q = b/N.
  epsilon: float  # The attached ε at σ (<= the target).
  bound: str  # 'upper' | 'high_probability_upper'.
  accountant: str
  max_batch_size: int | None  # The cap B training resolves for this b.
  seconds: float  # Calibration wall time.
  cpu_seconds: float  # Calibration CPU time, subprocesses included (the machine may be shared).
  # E‖error‖² per coordinate of the released SGD iterates (`correlated.strategy.iterate_error`):
  # compares DP-SGD and correlated noise at the target ε; None where not computed.
  iterate_error: float | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
  """The planner's answer for one (N, ε, δ, E, sampler)."""

  num_examples: int
  target_epsilon: float
  delta: float
  num_epochs: int
  sampler: str
  accountant: str
  clip_norm: float
  rows: tuple[PlanRow, ...]
  noise: str = 'gaussian'  # The noise mechanism (`privacy.noise`).

  @property
  def best_batch_size(self) -> int:
    """The b with the smallest σ·C/b on the grid."""
    return min(self.rows, key=lambda r: r.effective_noise).batch_size

  @property
  def flat_from(self) -> int:
    """The smallest b from which σ/(q√S) stays within FLAT_TOLERANCE of its grid minimum."""
    low = min(r.run_noise for r in self.rows)
    flat = [r.run_noise <= FLAT_TOLERANCE * low for r in self.rows]
    start = len(flat)
    while start > 0 and flat[start - 1]:
      start -= 1
    return self.rows[min(start, len(flat) - 1)].batch_size

  def message(self) -> str:
    """What the numbers show (docs/accounting.md §8), from the numbers themselves."""
    rows = self.rows
    if len(rows) < 2:
      return f'one batch size: σ·C/b = {rows[0].effective_noise:.4g}.'
    best = self.best_batch_size
    first, last = rows[0], rows[-1]
    ratios = [a.effective_noise / b.effective_noise for a, b in zip(rows, rows[1:])]
    monotone = all(r > 1 for r in ratios)
    trend = 'decreases at every step of the grid' if monotone else 'does not decrease monotonically'
    sigma_growth = math.log(last.noise_multiplier / first.noise_multiplier) / math.log(
      last.batch_size / first.batch_size
    )
    lines = [
      f'σ·C/b {trend}: {first.effective_noise:.3g} at b = {first.batch_size}, '
      f'{last.effective_noise:.3g} at b = {last.batch_size} '
      f'({first.effective_noise / last.effective_noise:.3g}x less); smallest at b = {best}.'
    ]
    from dpjax.privacy import samplers as samplers_lib

    if not samplers_lib.sampler_class(self.sampler).amplified_by_sampling:
      lines.append(
        f'σ grows like b^{sigma_growth:.2f}: the {self.sampler} sampler is accounted '
        f'without amplification, so σ does not depend on b and σ·C/b ∝ 1/b.'
      )
      return '\n'.join(lines)
    lines.append(
      f'σ grows like b^{sigma_growth:.2f} from b = {first.batch_size} to '
      f'{last.batch_size} (b^0.5 at fixed epochs where amplification is linear, '
      f'σ/b ∝ 1/√b; b^1 would make larger batches useless).'
    )
    flat = self.flat_from
    if flat == last.batch_size:
      lines.append(
        'σ/(q·√S), the noise of the whole run, still falls at the end of the grid: '
        'no batch size on it reaches the linear-amplification regime.'
      )
    else:
      lines.append(
        f'σ/(q·√S), the noise of the whole run, is within {FLAT_TOLERANCE - 1:.0%} of its '
        f'smallest value from b = {flat} on: there the budget fixes the noise of the run '
        f'whatever b, and a larger b buys less noise per step with fewer steps.'
      )
    if flat > first.batch_size:
      lines.append(
        f'At b = {first.batch_size} the run needs '
        f'{first.run_noise / min(r.run_noise for r in rows):.3g}x the smallest σ/(q·√S) on '
        f'the grid: subsampling amplifies poorly at small q (seed 003, docs/accounting.md §8).'
      )
    return '\n'.join(lines)

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(best_batch_size=self.best_batch_size, flat_from=self.flat_from, message=self.message())
    return d

  @classmethod
  def from_dict(cls, d: dict) -> Plan:
    """The plan of a `to_dict()` (a --json file); derived fields are recomputed, not read."""
    kwargs = {
      f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d and f.name != 'rows'
    }
    return cls(rows=tuple(PlanRow(**row) for row in d['rows']), **kwargs)


# ---------------------------------------------------------------------------------------------
# Validation and configs
# ---------------------------------------------------------------------------------------------


def default_batch_sizes(
  num_examples: int, smallest: int = DEFAULT_SMALLEST_BATCH_SIZE
) -> list[int]:
  """Powers of two from `smallest` (from 1 if N <= smallest) below N, then N itself."""
  n = _checks.check_int('--num_examples', num_examples, 1)
  b = smallest if n > smallest else 1
  sizes = []
  while b < n:
    sizes.append(b)
    b *= 2
  return sizes + [n]


def check_batch_sizes(batch_sizes: Sequence[int], num_examples: int) -> list[int]:
  """Sorted distinct batch sizes, each an integer in [1, N]."""
  if not batch_sizes:
    raise ValueError('--batch_sizes must list at least one batch size.')
  for b in batch_sizes:
    _checks.check_int('--batch_sizes entry', b, 1, num_examples)
  return sorted(set(int(b) for b in batch_sizes))


def base_config(
  *,
  sampler: str = 'poisson',
  accountant: str = 'auto',
  clip_norm: float = 1.0,
  physical_batch_size: int = DEFAULT_PHYSICAL_BATCH_SIZE,
  group_size: int = 1,
  seed: int = 0,
) -> ml_collections.ConfigDict:
  """The privacy-relevant fields of a training config (configs/digits_mlp.py)."""
  c = ml_collections.ConfigDict()
  c.seed = seed
  c.sampler = ml_collections.ConfigDict(
    dict(
      name=sampler,
      batch_size=1,
      physical_batch_size=physical_batch_size,
      max_batch_size=0,
      num_groups=1,
    )
  )
  c.privacy = ml_collections.ConfigDict(
    dict(
      enabled=True,
      clip_norm=float(clip_norm),
      noise_multiplier=None,
      target_epsilon=1.0,
      delta=1e-5,
      accountant=accountant,
      group_size=group_size,
      noise='gaussian',
      num_bands=1,
      num_buffers=2,
    )
  )
  c.num_epochs, c.num_steps = 1, 0
  c.data = ml_collections.ConfigDict(dict(public_num_examples=0))  # The N given is exact.
  return c


def run_config(
  base: ml_collections.ConfigDict,
  batch_size: int,
  target_epsilon: float,
  delta: float,
  num_epochs: int,
) -> ml_collections.ConfigDict:
  """`base` as a run of `num_epochs` epochs at batch size b, σ to calibrate for ε.

  The cap B is re-derived for each b (`max_batch_size = 0`, automatic), as a
  fixed B would not fit every b.
  """
  c = ml_collections.ConfigDict(base.to_dict())
  c.sampler.batch_size = batch_size
  c.sampler.max_batch_size = 0
  c.privacy.enabled = True
  c.privacy.noise_multiplier = None
  c.privacy.target_epsilon = float(target_epsilon)
  c.privacy.delta = float(delta)
  c.num_epochs, c.num_steps = num_epochs, 0
  return c


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


def _cpu_seconds() -> float:
  """CPU time of this process and its finished subprocesses (random-allocation PLDs)."""
  t = os.times()
  return t.user + t.system + t.children_user + t.children_system


def _calibrated_row(config: ml_collections.ConfigDict, b: int, n: int, clip_norm: float) -> PlanRow:
  """One row: the σ `dpjax.train` would calibrate for this run config, and its noise measures."""
  from dpjax.trainer.planning import plan as plan_lib

  start, cpu_start = time.perf_counter(), _cpu_seconds()
  acct = plan_lib.make_accountant(config, n)
  report = acct.final_report(estimates=False)  # Memoised: make_accountant checked it.
  sigma, steps = acct.noise_multiplier, report.steps
  q = b / n
  error = strategy.iterate_error(acct.options.strategy, steps, sigma * clip_norm / b)
  return PlanRow(
    batch_size=b,
    steps_per_epoch=acct.steps_per_epoch,
    num_steps=steps,
    noise_multiplier=sigma,
    effective_noise=sigma * clip_norm / b,
    run_noise=sigma / (q * math.sqrt(steps)),
    epsilon=report.epsilon,
    bound=report.bound,
    accountant=report.accountant,
    max_batch_size=acct.max_batch_size,
    seconds=time.perf_counter() - start,
    cpu_seconds=_cpu_seconds() - cpu_start,
    iterate_error=error,
  )


def plan_batch_sizes(
  num_examples: int,
  target_epsilon: float,
  delta: float,
  num_epochs: int,
  batch_sizes: Sequence[int] | None = None,
  *,
  config: ml_collections.ConfigDict | None = None,
  progress: Callable[[PlanRow], None] | None = None,
) -> Plan:
  """The calibrated σ, σ·C/b and σ/(q√S) for each batch size b.

  Args:
    num_examples: N.
    target_epsilon: ε, the budget at the end of the run.
    delta: δ.
    num_epochs: E; the run has E·ceil(N/b) steps.
    batch_sizes: the grid (default `default_batch_sizes(N)`).
    config: a training config giving sampler, accountant, C, P, group size
      and seed (default `base_config()`: Poisson, auto, C = 1, P = 64).
    progress: called with each row as it is computed.

  Returns:
    A Plan; row σ is `make_accountant(run_config(...), N).noise_multiplier`,
    the σ `dpjax.train` would train with.
  """
  from dpjax.privacy.accounting import accountant as accountant_lib
  from dpjax.trainer.planning import plan as plan_lib

  n = _checks.check_int('--num_examples', num_examples, 1)
  eps = _checks.check_number('--epsilon', target_epsilon, low=0)
  delta = _checks.check_number('--delta', delta, low=0, high=1, open_high=True)
  epochs = _checks.check_int('--epochs', num_epochs, 1)
  sizes = check_batch_sizes(default_batch_sizes(n) if batch_sizes is None else batch_sizes, n)
  base = base_config() if config is None else config
  name = base.sampler.name
  if name not in names.SAMPLER_NAMES:
    raise ValueError(f'--sampler {name!r} is unknown; valid: {", ".join(names.SAMPLER_NAMES)}.')
  if base.privacy.accountant not in names.ACCOUNTANTS:
    raise ValueError(
      f'--accountant {base.privacy.accountant!r} is unknown; valid: {", ".join(names.ACCOUNTANTS)}.'
    )
  clip_norm = _checks.check_number('--clip_norm', base.privacy.clip_norm, low=0)
  _checks.check_int('--physical_batch_size', base.sampler.physical_batch_size, 1)
  _checks.check_int('--group_size', base.privacy.group_size, 1)
  # Every per-b argument the accountant checks, before any calibration.
  for b in sizes:
    sampler = plan_lib.make_sampler(run_config(base, b, eps, delta, epochs), n)
    accountant_lib.Accountant(
      sampler,
      1.0,
      delta,
      accountant=base.privacy.accountant,
      group_size=base.privacy.group_size,
      max_batch_size=None,
    )
  rows = []
  for b in sizes:
    rows.append(_calibrated_row(run_config(base, b, eps, delta, epochs), b, n, clip_norm))
    if progress is not None:
      progress(rows[-1])
  return Plan(
    num_examples=n,
    target_epsilon=eps,
    delta=delta,
    num_epochs=epochs,
    sampler=name,
    accountant=rows[0].accountant,
    clip_norm=clip_norm,
    rows=tuple(rows),
    noise=base.privacy.get('noise', 'gaussian'),
  )


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


_HEADER = ('b', 'steps/epoch', 'steps S', 'σ', 'σ·C/b', 'σ/(q√S)', 'iterate err²', 'ε', 'B', 'time')


def _cells(plan: Plan, row: PlanRow) -> tuple[str, ...]:
  cap = '-' if row.max_batch_size is None else str(row.max_batch_size)
  return (
    str(row.batch_size),
    str(row.steps_per_epoch),
    str(row.num_steps),
    f'{row.noise_multiplier:.4f}',
    f'{row.effective_noise:.3e}',
    f'{row.run_noise:.3f}',
    '-' if row.iterate_error is None else f'{row.iterate_error:.3e}',
    f'{row.epsilon:.4f}',
    cap,
    f'{row.seconds:.1f}s',
  )


def format_table(plan: Plan) -> str:
  """Title, table (the smallest σ·C/b marked) and the message."""
  bounds = sorted({r.bound for r in plan.rows})
  title = (
    f'N = {plan.num_examples}, ε = {plan.target_epsilon:g}, δ = {plan.delta:g}, '
    f'{plan.num_epochs} epochs, sampler {plan.sampler}, noise {plan.noise}, accountant {plan.accountant} '
    f'(ε: {" / ".join(bounds)} bound), C = {plan.clip_norm:g}'
  )
  table = [_HEADER] + [_cells(plan, r) for r in plan.rows]
  widths = [max(len(line[i]) for line in table) for i in range(len(_HEADER))]
  lines = ['  '.join(f'{c:>{w}}' for c, w in zip(line, widths)) for line in table]
  for i, row in enumerate(plan.rows, start=1):
    if row.batch_size == plan.best_batch_size:
      lines[i] += '  <- smallest σ·C/b'
  wall, cpu = sum(r.seconds for r in plan.rows), sum(r.cpu_seconds for r in plan.rows)
  return '\n'.join(
    [
      title,
      *lines,
      '',
      plan.message(),
      f'calibration time: {wall:.1f} s wall, {cpu:.1f} s CPU for '
      f'{len(plan.rows)} batch size{"s" if len(plan.rows) > 1 else ""}',
    ]
  )
