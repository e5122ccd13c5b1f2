"""Batch size planner: the calibrated σ and the noise on the averaged gradient over b.

  python -m dpjax.planner --num_examples 6000 --epsilon 3 --delta 1e-5 --epochs 2 \\
      --batch_sizes 128,512
  python -m dpjax.planner --num_examples 6000 --epsilon 3 --delta 1e-5 --epochs 2 \\
      --batch_sizes 1024 --json plan.json --plot plan.png
  python -m dpjax.planner --config configs/digits_mlp.py --batch_sizes 128,256  # N, ε, δ from it
  python -m dpjax.planner --batch_sizes 256 --config configs/digits_mlp.py \\
      --config.privacy.target_epsilon=2

Each example runs in seconds (tests/test_cli_examples.py runs them all); the
default grid at N = 60000 takes minutes (see Cost below and README.md).

At a fixed privacy budget (ε, δ) and a fixed number of epochs E, each batch
size b gets the σ that training would use: the config of the run with
`sampler.batch_size = b`, `num_epochs = E`, `privacy.target_epsilon = ε` and
σ unset, given to `accounting.make_accountant` exactly as `dpjax.train`
does (same sampler, accountant and automatic cap B). Steps per epoch are
ceil(N/b). Columns:

  σ·C/b       std of the noise on the averaged gradient (per coordinate);
  σ/(q·√S)    the noise of the whole run, q = b/N, S = E·ceil(N/b) steps (the
              "total amount of noise" of Sander, Stock, Sablayrolles, "TAN
              without a burn", ICML 2023): where subsampling amplifies
              linearly (Rényi DP ≈ c·S·q²·α/σ², Abadi et al. 2016), ε depends
              on σ, q and S only through it, so it is flat in b.

Cost: one calibration per b, run one after the other. Poisson at N = 60000,
10 epochs: 0.5–53 s of CPU per b, 5 min for 12 b × 3 ε (experiments/05).
Balls-and-bins with ceil(N/b) <= 100 computes random-allocation PLDs in a
subprocess: minutes per b. Shuffle and deterministic: under a second.

docs/accounting.md §8 (seed 003, "Limits of privacy amplification by
subsampling"): amplification is nearly free only when the per-step privacy
loss is tiny, ε ≲ q. Small batches (small q, small σ) are outside that
regime and pay more noise per unit of signal; the table shows where.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
import types
from typing import Callable, Sequence

from absl import flags
import ml_collections
from ml_collections import config_flags

from dpjax import cli
from dpjax import samplers as samplers_lib
from dpjax.accounting import accountant as accountant_lib

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
    trend = ('decreases at every step of the grid' if monotone else
             'does not decrease monotonically')
    sigma_growth = math.log(last.noise_multiplier / first.noise_multiplier) / math.log(
        last.batch_size / first.batch_size)
    lines = [
        f'σ·C/b {trend}: {first.effective_noise:.3g} at b = {first.batch_size}, '
        f'{last.effective_noise:.3g} at b = {last.batch_size} '
        f'({first.effective_noise / last.effective_noise:.3g}x less); smallest at b = {best}.']
    if not samplers_lib.sampler_class(self.sampler).amplified_by_sampling:
      lines.append(f'σ grows like b^{sigma_growth:.2f}: the {self.sampler} sampler is accounted '
                   f'without amplification, so σ does not depend on b and σ·C/b ∝ 1/b.')
      return '\n'.join(lines)
    lines.append(f'σ grows like b^{sigma_growth:.2f} from b = {first.batch_size} to '
                 f'{last.batch_size} (b^0.5 at fixed epochs where amplification is linear, '
                 f'σ/b ∝ 1/√b; b^1 would make larger batches useless).')
    flat = self.flat_from
    if flat == last.batch_size:
      lines.append('σ/(q·√S), the noise of the whole run, still falls at the end of the grid: '
                   'no batch size on it reaches the linear-amplification regime.')
    else:
      lines.append(
          f'σ/(q·√S), the noise of the whole run, is within {FLAT_TOLERANCE - 1:.0%} of its '
          f'smallest value from b = {flat} on: there the budget fixes the noise of the run '
          f'whatever b, and a larger b buys less noise per step with fewer steps.')
    if flat > first.batch_size:
      lines.append(
          f'At b = {first.batch_size} the run needs '
          f'{first.run_noise / min(r.run_noise for r in rows):.3g}x the smallest σ/(q·√S) on '
          f'the grid: subsampling amplifies poorly at small q (seed 003, docs/accounting.md §8).')
    return '\n'.join(lines)

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(best_batch_size=self.best_batch_size, flat_from=self.flat_from,
             message=self.message())
    return d


# ---------------------------------------------------------------------------------------------
# Validation and configs
# ---------------------------------------------------------------------------------------------


def _check_int(flag: str, value, minimum: int, maximum: int | None = None) -> int:
  bad = isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
      maximum is not None and value > maximum)
  if bad:
    upper = f' and <= {maximum}' if maximum is not None else ''
    raise ValueError(f'{flag} must be an integer >= {minimum}{upper}, got {value!r}.')
  return value


def _check_float(flag: str, value, *, low: float, high: float = math.inf,
                 open_high: bool = False) -> float:
  ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        and value > low and (value < high if open_high else value <= high))
  if not ok:
    upper = f' and < {high}' if open_high else ''
    raise ValueError(f'{flag} must be a finite number > {low}{upper}, got {value!r}.')
  return float(value)


def default_batch_sizes(num_examples: int,
                        smallest: int = DEFAULT_SMALLEST_BATCH_SIZE) -> list[int]:
  """Powers of two from `smallest` (from 1 if N <= smallest) below N, then N itself."""
  n = _check_int('--num_examples', num_examples, 1)
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
    _check_int(f'--batch_sizes entry', b, 1, num_examples)
  return sorted(set(int(b) for b in batch_sizes))


def base_config(*, sampler: str = 'poisson', accountant: str = 'auto', clip_norm: float = 1.0,
                physical_batch_size: int = DEFAULT_PHYSICAL_BATCH_SIZE, group_size: int = 1,
                seed: int = 0) -> ml_collections.ConfigDict:
  """The privacy-relevant fields of a training config (configs/digits_mlp.py)."""
  c = ml_collections.ConfigDict()
  c.seed = seed
  c.sampler = ml_collections.ConfigDict(dict(
      name=sampler, batch_size=1, physical_batch_size=physical_batch_size, max_batch_size=0))
  c.privacy = ml_collections.ConfigDict(dict(
      enabled=True, clip_norm=float(clip_norm), noise_multiplier=None, target_epsilon=1.0,
      delta=1e-5, accountant=accountant, group_size=group_size))
  c.num_epochs, c.num_steps = 1, 0
  return c


def run_config(base: ml_collections.ConfigDict, batch_size: int, target_epsilon: float,
               delta: float, num_epochs: int) -> ml_collections.ConfigDict:
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


def plan_batch_sizes(num_examples: int, target_epsilon: float, delta: float, num_epochs: int,
                     batch_sizes: Sequence[int] | None = None, *,
                     config: ml_collections.ConfigDict | None = None,
                     progress: Callable[[PlanRow], None] | None = None) -> Plan:
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
  n = _check_int('--num_examples', num_examples, 1)
  eps = _check_float('--epsilon', target_epsilon, low=0)
  delta = _check_float('--delta', delta, low=0, high=1, open_high=True)
  epochs = _check_int('--epochs', num_epochs, 1)
  sizes = check_batch_sizes(default_batch_sizes(n) if batch_sizes is None else batch_sizes, n)
  base = base_config() if config is None else config
  name = base.sampler.name
  if name not in samplers_lib.SAMPLER_NAMES:
    raise ValueError(f'--sampler {name!r} is unknown; valid: '
                     f'{", ".join(samplers_lib.SAMPLER_NAMES)}.')
  if base.privacy.accountant not in accountant_lib.ACCOUNTANTS:
    raise ValueError(f'--accountant {base.privacy.accountant!r} is unknown; valid: '
                     f'{", ".join(accountant_lib.ACCOUNTANTS)}.')
  clip_norm = _check_float('--clip_norm', base.privacy.clip_norm, low=0)
  _check_int('--physical_batch_size', base.sampler.physical_batch_size, 1)
  _check_int('--group_size', base.privacy.group_size, 1)
  # Every per-b argument the accountant checks, before any calibration.
  for b in sizes:
    sampler = samplers_lib.make_sampler(run_config(base, b, eps, delta, epochs), n)
    accountant_lib.Accountant(sampler, 1.0, delta, accountant=base.privacy.accountant,
                              group_size=base.privacy.group_size)
  rows = []
  for b in sizes:
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    acct = accountant_lib.make_accountant(run_config(base, b, eps, delta, epochs), n)
    report = acct.final_report(estimates=False)  # Memoised: make_accountant checked it.
    sigma, steps = acct.noise_multiplier, report.steps
    q = b / n
    rows.append(PlanRow(
        batch_size=b, steps_per_epoch=acct.steps_per_epoch, num_steps=steps,
        noise_multiplier=sigma, effective_noise=sigma * clip_norm / b,
        run_noise=sigma / (q * math.sqrt(steps)), epsilon=report.epsilon, bound=report.bound,
        accountant=report.accountant, max_batch_size=acct.max_batch_size,
        seconds=time.perf_counter() - start, cpu_seconds=_cpu_seconds() - cpu_start))
    if progress is not None:
      progress(rows[-1])
  return Plan(num_examples=n, target_epsilon=eps, delta=delta, num_epochs=epochs, sampler=name,
              accountant=rows[0].accountant, clip_norm=clip_norm, rows=tuple(rows))


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


_HEADER = ('b', 'steps/epoch', 'steps S', 'σ', 'σ·C/b', 'σ/(q√S)', 'ε (attached)', 'B',
           'time')


def _cells(plan: Plan, row: PlanRow) -> tuple[str, ...]:
  cap = '-' if row.max_batch_size is None else str(row.max_batch_size)
  return (str(row.batch_size), str(row.steps_per_epoch), str(row.num_steps),
          f'{row.noise_multiplier:.4f}', f'{row.effective_noise:.3e}', f'{row.run_noise:.3f}',
          f'{row.epsilon:.4f}', cap, f'{row.seconds:.1f}s')


def format_table(plan: Plan) -> str:
  """Title, table (the smallest σ·C/b marked) and the message."""
  bounds = sorted({r.bound for r in plan.rows})
  title = (f'N = {plan.num_examples}, ε = {plan.target_epsilon:g}, δ = {plan.delta:g}, '
           f'{plan.num_epochs} epochs, sampler {plan.sampler}, accountant {plan.accountant} '
           f'(ε: {" / ".join(bounds)} bound), C = {plan.clip_norm:g}')
  table = [_HEADER] + [_cells(plan, r) for r in plan.rows]
  widths = [max(len(line[i]) for line in table) for i in range(len(_HEADER))]
  lines = ['  '.join(f'{c:>{w}}' for c, w in zip(line, widths)) for line in table]
  for i, row in enumerate(plan.rows, start=1):
    if row.batch_size == plan.best_batch_size:
      lines[i] += '  <- smallest σ·C/b'
  wall, cpu = sum(r.seconds for r in plan.rows), sum(r.cpu_seconds for r in plan.rows)
  return '\n'.join([title, *lines, '', plan.message(),
                    f'calibration time: {wall:.1f} s wall, {cpu:.1f} s CPU for '
                    f'{len(plan.rows)} batch size{"s" if len(plan.rows) > 1 else ""}'])


def plot_plans(plans: Sequence[Plan], path: str, *, reference: Sequence[Plan] = (),
               reference_note: str = '') -> None:
  """σ, σ·C/b and σ/(q√S) against b (log axes), one line per plan (dashed: `reference`,
  labelled with `reference_note`)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  from matplotlib import figure  # pylint: disable=g-import-not-at-top

  fig = figure.Figure(figsize=(15, 4.6))  # No pyplot: no backend or global state involved.
  axes = fig.subplots(1, 3)
  panels = (('noise_multiplier', 'noise multiplier σ (calibrated)'),
            ('effective_noise', 'noise std on the averaged gradient σ·C/b'),
            ('run_noise', 'noise of the whole run σ/(q·√S)'))
  colors = matplotlib.rcParams['axes.prop_cycle'].by_key()['color']
  for i, plan in enumerate(plans):
    color = colors[i % len(colors)]
    b = [r.batch_size for r in plan.rows]
    for ax, (field, _) in zip(axes, panels):
      ax.plot(b, [getattr(r, field) for r in plan.rows], 'o-', color=color, ms=4,
              label=f'{plan.sampler}, ε = {plan.target_epsilon:g}')
    best = [r for r in plan.rows if r.batch_size == plan.best_batch_size][0]
    axes[1].plot([best.batch_size], [best.effective_noise], '*', color=color, ms=12)
  for i, plan in enumerate(reference):
    color = colors[i % len(colors)]
    b = [r.batch_size for r in plan.rows]
    for ax, (field, _) in zip(axes, panels):
      ax.plot(b, [getattr(r, field) for r in plan.rows], '--', color=color, lw=1,
              label=f'{plan.sampler}{reference_note}, ε = {plan.target_epsilon:g}')
  first = plans[0]
  for ax, (_, label) in zip(axes, panels):
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xlabel('batch size b (examples)')
    ax.set_ylabel(label)
    ax.grid(True, which='both', alpha=0.3)
  handles, labels = axes[0].get_legend_handles_labels()
  ncol = max(1, min(3, len(plans)))
  fig.legend(handles, labels, loc='lower center', ncol=ncol, fontsize=9, frameon=False)
  rows = -(-len(labels) // ncol)
  fig.suptitle(f'Calibrated noise vs batch size at fixed (ε, δ = {first.delta:g}, '
               f'{first.num_epochs} epochs), N = {first.num_examples}, C = {first.clip_norm:g}'
               f'; ★ smallest σ·C/b')
  fig.tight_layout(rect=(0, 0.045 * rows + 0.02, 1, 1))
  fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


# (definer, name, help[, choices]); each name also answers with dashes (--num-examples).
_FLAGS = (
    ('integer', 'num_examples', 'N, training examples'),
    ('float', 'epsilon', 'ε, the budget at the end of the run'),
    ('float', 'delta', 'δ'),
    ('integer', 'epochs', 'E, epochs of ceil(N/b) steps'),
    ('string', 'batch_sizes', 'comma-separated b grid (default: powers of two from 32, then N)'),
    ('enum', 'sampler', 'default poisson', samplers_lib.SAMPLER_NAMES),
    ('enum', 'accountant', 'default auto', accountant_lib.ACCOUNTANTS),
    ('float', 'clip_norm', 'C (default 1)'),
    ('integer', 'physical_batch_size',
     f'P, sets the automatic cap B (default {DEFAULT_PHYSICAL_BATCH_SIZE})'),
    ('string', 'json', 'write the plan as JSON to this file'),
    ('string', 'plot', 'write the plot (PNG) to this file'),
)
PROG = 'python -m dpjax.planner'


_CONFIG_HELP = ('training config (path[:arg]): N (from its data unless --num_examples), sampler, '
                'ε, δ, epochs, C, P, accountant; --config.<field>=value overrides a field, and '
                'the flags below override it too')


def _flag_values(argv: list[str]) -> flags.FlagValues:
  """This command's absl flags (fresh per call), each also spelled with dashes."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, _CONFIG_HELP, flag_values=fv,
                                  lock_config=False, sys_argv=argv)
  for definer, name, help_text, *choices in _FLAGS:
    getattr(flags, f'DEFINE_{definer}')(name, None, *choices, help_text, flag_values=fv)
    if '_' in name:
      flags.DEFINE_alias(name.replace('_', '-'), name, flag_values=fv)
  return fv


def parse_args(argv: list[str]) -> types.SimpleNamespace:
  """argv (without the program name) -> the flag values (`dpjax.cli.parse_command` conventions)."""
  fv = _flag_values([PROG, *argv])
  cli.parse_command(PROG, __doc__, fv, argv)
  return types.SimpleNamespace(config=fv.config if fv['config'].present else None,
                               **{name: fv[name].value for _, name, *_ in _FLAGS})


def _parse_sizes(text: str) -> list[int]:
  try:
    return [int(s) for s in text.split(',') if s.strip()]
  except ValueError:
    raise ValueError(f'--batch_sizes must be comma-separated integers, got {text!r}.') from None


def _resolve(args) -> tuple[ml_collections.ConfigDict, int, float, float, int]:
  """The base config and (N, ε, δ, E) from --config and the flags (flags win)."""
  if args.config is not None:
    config = args.config  # Loaded by config_flags, --config.<field> overrides applied.
    eps = args.epsilon if args.epsilon is not None else config.privacy.get('target_epsilon')
    delta = args.delta if args.delta is not None else config.privacy.get('delta')
    epochs = args.epochs if args.epochs is not None else config.get('num_epochs')
    if args.epsilon is None and not eps:
      raise ValueError('--epsilon must be given: the config has no privacy.target_epsilon > 0.')
    if args.epochs is None and not epochs:
      raise ValueError('--epochs must be given: the config sets num_steps, not num_epochs, and '
                       'the planner compares batch sizes at a fixed number of epochs.')
  else:
    config = base_config()
    eps, delta, epochs = args.epsilon, args.delta, args.epochs
    missing = [f for f, v in (('--num_examples', args.num_examples), ('--epsilon', eps),
                              ('--delta', delta), ('--epochs', epochs)) if v is None]
    if missing:
      raise ValueError(f'missing {", ".join(missing)} (or give --config).')
  if args.sampler is not None:
    config.sampler.name = args.sampler
  if args.physical_batch_size is not None:
    config.sampler.physical_batch_size = args.physical_batch_size
  if args.accountant is not None:
    config.privacy.accountant = args.accountant
  if args.clip_norm is not None:
    config.privacy.clip_norm = args.clip_norm
  n = args.num_examples
  if n is None:
    from dpjax import data  # pylint: disable=g-import-not-at-top
    n = len(data.make_sources(config.data, seed=config.seed)[0])
  return config, n, eps, delta, epochs


def main(argv: Sequence[str] | None = None) -> int:
  # dp_accounting's RDP logs a warning per fractional order it skips; the numbers are unaffected.
  logging.getLogger('absl').setLevel(logging.ERROR)
  args = parse_args(list(sys.argv[1:] if argv is None else argv))
  try:
    config, n, eps, delta, epochs = _resolve(args)
    sizes = None if args.batch_sizes is None else _parse_sizes(args.batch_sizes)
    for flag, path in (('--json', args.json), ('--plot', args.plot)):
      if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f'{flag} {path!r}: its directory does not exist.')
    header_printed = []

    def progress(row):
      if not header_printed:
        print('calibrating σ for each b (seconds to minutes each) ...', file=sys.stderr)
        header_printed.append(True)
      print(f'  b = {row.batch_size}: σ = {row.noise_multiplier:.4f} ({row.seconds:.1f} s wall, '
            f'{row.cpu_seconds:.1f} s CPU)',
            file=sys.stderr, flush=True)

    plan = plan_batch_sizes(n, eps, delta, epochs, sizes, config=config, progress=progress)
  except ValueError as e:
    cli.fail(PROG, e)
  print(format_table(plan))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(plan.to_dict(), f, indent=2)
  if args.plot:
    plot_plans([plan], args.plot)
  return 0


if __name__ == '__main__':
  sys.exit(main())
