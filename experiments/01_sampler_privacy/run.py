"""Experiment 1: how private is each batch sampler? ε vs σ at fixed δ (seed 000, Figure 2 style).

Chua et al. 2025, "Balls-and-Bins Sampling for DP-SGD" (seed 000), Figure 2 plots ε against the
noise multiplier σ for Poisson subsampling, shuffling and balls-and-bins. This script draws the
same comparison with the numbers *dpjax itself reports*: every ε comes from
`dpjax.privacy.accounting.Accountant` (the object training attaches ε with) or, where the accountant
does not report a number at this size, from the dpjax function it would call.

  .venv/bin/python experiments/01_sampler_privacy/run.py          # default (5.5 min, 2 shared cores)
  .venv/bin/python experiments/01_sampler_privacy/run.py --full   # denser σ, MC for E > 1

Setting: N = 60000 examples, batch size b = 600, so T = 100 steps per epoch and Poisson rate
q = b/N = 1/T; δ = 1e-5; E = 1 and 5 epochs; no batch cap (truncation is experiment 6).
Curves, each labelled with the kind of bound (docs/accounting.md §1-3):

  Poisson          PLD of the Poisson-subsampled Gaussian, E·T steps       upper
  balls-and-bins   random-allocation PLD (Feldman & Shenfeld; pld-accounting), the provable
                   ε dpjax attaches                                        upper
                   random-allocation PLD, dominated side (E = 1 only)      lower
                   Monte-Carlo UCB, confidence 1 − β (seed 000, Alg. 4-6)  high-probability upper
                   Monte-Carlo point estimate                              not a guarantee
                   max test (seed 000, Eq. 6)                              lower
  shuffle          deterministic-order ε (joint convexity)                 upper
                   max test on the Chua et al. 2024a pair                  lower
  deterministic    Gaussian mechanism, once per epoch                      exact (upper)

Writes results.json (every number, settings, timings, git commit) and epsilon_vs_sigma.png
next to this file. Random-allocation PLD results are cached on disk by dpjax
($DPJAX_CACHE_DIR, else ~/.cache/dpjax), so a rerun is faster than the first run.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import sys
import time
from typing import Any

import dp_accounting
import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from dpjax_bench import provenance
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import sampler_events

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent

NUM_EXAMPLES = 60_000
BATCH_SIZE = 600  # T = N/b = 100 steps per epoch: random-allocation PLD is practical here.
DELTA = 1e-5
BETA = 1e-3  # Monte-Carlo failure probability (confidence 0.999).
# At δ = 1e-5 and β = 1e-3 the naive Monte-Carlo direction needs m > log(2/β)/δ ≈ 7.6e5
# samples (importance sampling does not help once σ ≳ 0.7 at T = 100), so 1e6.
MONTE_CARLO_SAMPLES = 1_000_000
MONTE_CARLO_SEED = 0
# Random-allocation PLD takes 10-60 s per σ at T = 100 on a busy core; the accountant's
# default 120 s budget could fall back to the deterministic bound on a loaded machine.
RANDOM_ALLOCATION_TIMEOUT = 900.0

DEFAULT = dict(sigmas=(0.5, 0.7, 1.0, 1.4, 2.0), epochs=(1, 5), monte_carlo_epochs=(1,))
# Realistic sizes (issue 15): N = 1e6, T = 1e3 and 1e4, with the accountant's default
# random-allocation budget (300 s per build), as `python -m dpjax.account` runs it. Monte
# Carlo is not run here: at
# δ = 1e-5 its default sample count (7.6e6 per direction) takes ~8 min per point at T = 1e3.
REALISTIC_NUM_EXAMPLES = 1_000_000
# δ = 1e-5 is kept at N = 1e6 (δ >= 1/N, which dpjax refuses by default: it allows publishing a
# random record) so that these curves compare with the T = 100 ones; an accounting study only.
POISSON_FINE_GRID = 2e-5
REALISTIC = dict(
  sigmas=(0.5, 0.7, 1.0, 1.4, 2.0),
  epochs=(1, 5),
  monte_carlo_epochs=(),
  steps_per_epoch=(1000, 10000),
)
FULL = dict(
  sigmas=(0.4, 0.5, 0.6, 0.7, 0.8, 1.0, 1.2, 1.4, 1.7, 2.0, 2.5),
  epochs=(1, 5),
  monte_carlo_epochs=(1, 5),
)


def _log(*args) -> None:
  print(*args, file=sys.stderr, flush=True)


_git_state = provenance.git_state
_timed = provenance.timed


def _accountant_at(
  name: str,
  sigma: float,
  workers: int = 1,
  num_examples: int = NUM_EXAMPLES,
  batch_size: int = BATCH_SIZE,
) -> accountant_lib.Accountant:
  sampler = samplers.sampler_class(name)(num_examples=num_examples, batch_size=batch_size)
  return accountant_lib.Accountant(
    sampler,
    sigma,
    DELTA,
    monte_carlo_samples=MONTE_CARLO_SAMPLES,
    beta=BETA,
    monte_carlo_seed=MONTE_CARLO_SEED,
    monte_carlo_workers=workers,
    monte_carlo_estimate=True,
    allow_large_delta=DELTA >= 1 / num_examples,
    random_allocation_timeout=(
      accountant_lib.balls_and_bins.RANDOM_ALLOCATION_TIMEOUT
      if num_examples == REALISTIC_NUM_EXAMPLES
      else RANDOM_ALLOCATION_TIMEOUT
    ),
    max_batch_size=None,
  )


def one_point(
  sigma: float,
  epochs: int,
  monte_carlo: bool,
  workers: int = 1,
  num_examples: int = NUM_EXAMPLES,
  batch_size: int = BATCH_SIZE,
) -> dict[str, Any]:
  """Every sampler's numbers at (σ, E), as dpjax reports them."""
  steps_per_epoch = math.ceil(num_examples / batch_size)
  steps = epochs * steps_per_epoch
  row: dict[str, Any] = {
    'noise_multiplier': sigma,
    'epochs': epochs,
    'steps': steps,
    'steps_per_epoch': steps_per_epoch,
    'num_examples': num_examples,
    'batch_size': batch_size,
  }
  _accountant = functools.partial(_accountant_at, num_examples=num_examples, batch_size=batch_size)
  seconds: dict[str, float] = {}

  report, seconds['poisson'] = _timed(
    lambda: _accountant('poisson', sigma).epsilon_at(steps, estimates=True)
  )
  row['poisson_pld_upper'] = report.epsilon
  row['poisson_rdp_upper'] = report.details.get('rdp_epsilon')
  row['poisson_report'] = report.to_dict()

  report, seconds['deterministic'] = _timed(
    lambda: _accountant('deterministic', sigma).epsilon_at(steps, estimates=True)
  )
  row['deterministic_exact'] = report.epsilon

  report, seconds['shuffle'] = _timed(
    lambda: _accountant('shuffle', sigma).epsilon_at(steps, estimates=True)
  )
  row['shuffle_upper'] = report.epsilon
  row['shuffle_max_test_lower'] = report.epsilon_lower
  row['shuffle_as_if_poisson_not_a_guarantee'] = report.details.get('as_if_poisson_not_a_guarantee')
  row['shuffle_report'] = report.to_dict()

  # With estimates=True the accountant adds the Monte-Carlo bound (1e6 samples, ~1-4 min per
  # point); without it we compute the max-test lower bound with the function it would call.
  acct = _accountant('balls_and_bins', sigma, workers)
  acct.monte_carlo_estimate = monte_carlo
  report, seconds['balls_and_bins'] = _timed(lambda: acct.epsilon_at(steps, estimates=True))
  details = report.details
  row['balls_and_bins_provable_upper'] = report.epsilon
  row['balls_and_bins_provable_method'] = details['provable_method']
  row['balls_and_bins_random_allocation_lower'] = details.get('random_allocation_lower')
  row['balls_and_bins_random_allocation_grid'] = details.get('random_allocation_grid')
  if monte_carlo:
    row['balls_and_bins_max_test_lower'] = details['max_test_lower_bound']
    row['balls_and_bins_mc_ucb_high_probability'] = details.get(
      'monte_carlo_epsilon_high_probability'
    )
    row['balls_and_bins_mc_point_not_a_guarantee'] = details.get(
      'monte_carlo_epsilon_point_estimate_not_a_guarantee'
    )
    row['balls_and_bins_mc_error'] = details.get('monte_carlo_error')
  else:
    row['balls_and_bins_max_test_lower'] = details['max_test_lower_bound']
    row['balls_and_bins_mc_ucb_high_probability'] = None
    row['balls_and_bins_mc_point_not_a_guarantee'] = None
    row['balls_and_bins_mc_error'] = details.get('monte_carlo')
  row['balls_and_bins_report'] = report.to_dict()
  row['cross_check_dp_accounting'], seconds['cross_check'] = _timed(
    lambda: cross_check(sigma, epochs, steps, num_examples, batch_size)
  )
  row['seconds'] = seconds
  return row


def refresh_poisson(row: dict[str, Any]) -> None:
  """The row's Poisson numbers (Poisson PLD and RDP, shuffle's "as if Poisson") recomputed by
  the current accountant, as `one_point` computes them."""
  sizes = dict(
    num_examples=row.get('num_examples', NUM_EXAMPLES), batch_size=row.get('batch_size', BATCH_SIZE)
  )
  sigma, steps = row['noise_multiplier'], row['steps']
  report = _accountant_at('poisson', sigma, **sizes).epsilon_at(steps, estimates=True)
  row['poisson_pld_upper'] = report.epsilon
  row['poisson_rdp_upper'] = report.details.get('rdp_epsilon')
  row['poisson_report'] = report.to_dict()
  report = _accountant_at('shuffle', sigma, **sizes).epsilon_at(steps, estimates=True)
  row['shuffle_as_if_poisson_not_a_guarantee'] = report.details.get('as_if_poisson_not_a_guarantee')
  row['shuffle_report'] = report.to_dict()


def cross_check(
  sigma: float, epochs: int, steps: int, num_examples: int, batch_size: int
) -> dict[str, float]:
  """Poisson and deterministic ε computed with dp_accounting directly (not through dpjax)."""
  # At the grid dpjax's accountant chose for this query (it follows ε: docs/accounting.md §1).
  q = batch_size / num_examples
  event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
  sampler = samplers.PoissonSampler(num_examples=num_examples, batch_size=batch_size)
  grid = accountant_lib.Accountant(
    sampler, sigma, DELTA, allow_large_delta=True, max_batch_size=None
  ).pld_grid(sampler_events.poisson_step_event(q, sigma), steps)['pld_grid']
  poisson = dp_accounting.pld.PLDAccountant(value_discretization_interval=grid)
  poisson.compose(event, steps)
  gaussian = dp_accounting.pld.PLDAccountant()
  gaussian.compose(dp_accounting.GaussianDpEvent(sigma), epochs)
  # A fixed fine reference (da06065's fixed grid 1e-4 overstated small ε over many steps of
  # small q: T = 1e4, σ = 2: 0.0176 vs 0.0137 at 2e-5).
  fine = dp_accounting.pld.PLDAccountant(value_discretization_interval=POISSON_FINE_GRID)
  fine.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
  return {
    'poisson_pld': float(poisson.get_epsilon(DELTA)),
    'poisson_pld_grid': grid,
    'poisson_pld_fine_grid': float(fine.get_epsilon(DELTA)),
    'deterministic_pld': float(gaussian.get_epsilon(DELTA)),
  }


# (key, label, sampler colour, line style, marker)
CURVES = (
  ('poisson_pld_upper', 'Poisson: PLD (upper)', 'tab:blue', '-', 'o'),
  (
    'poisson_pld_fine_grid',
    f'Poisson: PLD at grid {POISSON_FINE_GRID:g} (upper, reference)',
    'tab:cyan',
    '--',
    'o',
  ),
  (
    'balls_and_bins_provable_upper',
    'Balls-and-bins: random-allocation PLD (upper)',
    'tab:green',
    '-',
    's',
  ),
  (
    'balls_and_bins_mc_ucb_high_probability',
    f'Balls-and-bins: Monte-Carlo UCB (high-prob. upper, 1-β = {1 - BETA:g})',
    'tab:green',
    '--',
    '^',
  ),
  (
    'balls_and_bins_mc_point_not_a_guarantee',
    'Balls-and-bins: Monte-Carlo mean (not a guarantee)',
    'tab:green',
    ':',
    'x',
  ),
  (
    'balls_and_bins_random_allocation_lower',
    'Balls-and-bins: random-allocation PLD (lower)',
    'lime',
    '-.',
    'v',
  ),
  (
    'balls_and_bins_max_test_lower',
    'Balls-and-bins: max test, seed 000 Eq. 6 (lower)',
    'darkgreen',
    '-.',
    'v',
  ),
  ('deterministic_exact', 'Deterministic: exact = shuffle rigorous (upper)', 'tab:red', '-', 'D'),
  (
    'shuffle_max_test_lower',
    'Shuffle: max test, Chua et al. 2024a (lower)',
    'tab:orange',
    '-.',
    'v',
  ),
)


def plot(results: dict[str, Any], path: pathlib.Path) -> None:
  """Top row: ε vs σ per (T, E) panel. Bottom row: the same curves divided by Poisson's ε."""
  settings = results['settings']
  panels = sorted(
    {(r.get('steps_per_epoch', settings['steps_per_epoch']), r['epochs']) for r in results['rows']}
  )
  fig, axes = plt.subplots(
    2,
    len(panels),
    figsize=(6.5 * len(panels), 9.5),
    squeeze=False,
    sharex='col',
    gridspec_kw={'height_ratios': [3, 2]},
  )
  for col, (t, epochs) in enumerate(panels):
    ax, ax_ratio = axes[0][col], axes[1][col]
    rows = [
      r
      for r in results['rows']
      if r['epochs'] == epochs and r.get('steps_per_epoch', settings['steps_per_epoch']) == t
    ]
    for key, label, color, style, marker in CURVES:
      value = lambda r: r.get(key, r.get('cross_check_dp_accounting', {}).get(key))
      points = [
        (r['noise_multiplier'], value(r), r['poisson_pld_upper'])
        for r in rows
        if value(r) is not None and math.isfinite(value(r)) and value(r) > 0
      ]
      if not points:
        continue
      xs, ys, ref = zip(*points)
      kw = dict(linestyle=style, marker=marker, color=color, markersize=5)
      ax.plot(xs, ys, label=label, **kw)
      ax_ratio.plot(xs, [y / p for y, p in zip(ys, ref)], **kw)
    n, b = rows[0].get('num_examples', NUM_EXAMPLES), rows[0].get('batch_size', BATCH_SIZE)
    ax.set_yscale('log')
    ax.set_ylabel(f'ε at δ = {DELTA:g}')
    ax.set_title(
      f'E = {epochs} epoch{"s" if epochs > 1 else ""} (T = {t} steps/epoch, '
      f'{epochs * t} steps), N = {n}, b = {b}',
      fontsize=10,
    )
    ax_ratio.set_yscale('log')
    ax_ratio.set_ylabel('ε / ε(Poisson PLD)')
    ax_ratio.set_xlabel('noise multiplier σ (noise std / clip norm C)')
    for a in (ax, ax_ratio):
      a.grid(True, which='both', alpha=0.3)
  handles, labels = {}, []
  for a in axes[0]:
    for h, l in zip(*a.get_legend_handles_labels()):
      if l not in handles:
        handles[l] = h
        labels.append(l)
  fig.legend(
    [handles[l] for l in labels], labels, loc='lower center', ncol=3, fontsize=8, frameon=False
  )
  fig.suptitle(
    'Privacy of batch samplers in DP-SGD: ε vs σ (dpjax accounting; seed 000 Figure 2 style)',
    fontsize=12,
  )
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    '--full',
    action='store_true',
    help='denser σ grid and Monte Carlo for every epoch count (slower)',
  )
  parser.add_argument(
    '--out',
    type=pathlib.Path,
    default=HERE,
    help='directory for results.json and the PNG (default: this folder)',
  )
  parser.add_argument(
    '--plot-only', action='store_true', help='redraw the PNG from an existing results.json'
  )
  parser.add_argument(
    '--workers',
    type=int,
    default=1,
    help='processes for the Monte-Carlo samples (same numbers for any count)',
  )
  parser.add_argument(
    '--realistic',
    action='store_true',
    help='N = 1e6 with T = 1e3 and 1e4 steps per epoch (b = N/T), E = 1 and 5; '
    'writes results_realistic.json and epsilon_vs_sigma_realistic.png',
  )
  parser.add_argument(
    '--refresh-cross-check',
    action='store_true',
    help='recompute the dp_accounting cross-check of an existing results file',
  )
  parser.add_argument(
    '--refresh-poisson',
    action='store_true',
    help='recompute, in an existing results file, every number that comes from '
    'a Poisson PLD (Poisson, shuffle\'s "as if Poisson", the cross-check) '
    "with the current accountant; the other samplers' are kept",
  )
  parser.add_argument('--sigmas', type=float, nargs='+', help='override the σ grid')
  parser.add_argument('--epochs', type=int, nargs='+', help='override the epoch counts')
  args = parser.parse_args()
  grid = dict(REALISTIC if args.realistic else FULL if args.full else DEFAULT)
  suffix = '_realistic' if args.realistic else ''
  if args.sigmas:
    grid['sigmas'] = tuple(args.sigmas)
  if args.epochs:
    grid['epochs'] = tuple(args.epochs)
  args.out.mkdir(parents=True, exist_ok=True)
  if args.refresh_cross_check or args.refresh_poisson:
    path = args.out / f'results{suffix}.json'
    saved = json.loads(path.read_text())
    for row in saved['rows']:
      if args.refresh_poisson:
        refresh_poisson(row)
      row['cross_check_dp_accounting'] = cross_check(
        row['noise_multiplier'],
        row['epochs'],
        row['steps'],
        row.get('num_examples', NUM_EXAMPLES),
        row.get('batch_size', BATCH_SIZE),
      )
    if args.refresh_poisson:
      saved['poisson_refreshed'] = dict(
        git=_git_state(), time=time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())
      )
    path.write_text(json.dumps(saved, indent=1) + '\n')
    plot(saved, args.out / f'epsilon_vs_sigma{suffix}.png')
    return
  if args.plot_only:
    plot(
      json.loads((args.out / f'results{suffix}.json').read_text()),
      args.out / f'epsilon_vs_sigma{suffix}.png',
    )
    return
  start = time.perf_counter()
  git = _git_state()
  rows = []

  def results_so_far() -> dict[str, Any]:
    return {
      'experiment': '01_sampler_privacy',
      'question': 'How private is each batch sampler at equal σ? ε vs σ at fixed δ.',
      'command': ' '.join(
        [
          os.path.relpath(sys.executable, ROOT)
          if sys.executable.startswith(str(ROOT))
          else sys.executable
        ]
        + sys.argv
      ),
      'settings': {
        'num_examples': sizes[0][0] if len(sizes) == 1 else [n for n, _ in sizes],
        'batch_size': sizes[0][1] if len(sizes) == 1 else [b for _, b in sizes],
        'steps_per_epoch': math.ceil(sizes[0][0] / sizes[0][1])
        if len(sizes) == 1
        else [math.ceil(n / b) for n, b in sizes],
        'poisson_sampling_probability': 'b/N = 1/T',
        'delta': DELTA,
        'sigmas': list(grid['sigmas']),
        'epochs': list(grid['epochs']),
        'monte_carlo_epochs': list(grid['monte_carlo_epochs']),
        'monte_carlo_samples_per_direction': MONTE_CARLO_SAMPLES,
        'monte_carlo_beta': BETA,
        'monte_carlo_seed': MONTE_CARLO_SEED,
        'random_allocation_timeout_seconds': (
          accountant_lib.balls_and_bins.RANDOM_ALLOCATION_TIMEOUT
          if args.realistic
          else RANDOM_ALLOCATION_TIMEOUT
        ),
        'monte_carlo_workers': args.workers,
        'max_batch_size': None,
        'full': args.full,
        'cache_dir': os.environ.get('DPJAX_CACHE_DIR', '~/.cache/dpjax'),
      },
      'git': git,
      'machine': dict(
        provenance.machine(),  # Its load average: at the end.
        time=time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()),
      ),
      'total_seconds': time.perf_counter() - start,
      'rows': rows,
    }

  sizes = (
    [(REALISTIC_NUM_EXAMPLES, REALISTIC_NUM_EXAMPLES // t) for t in grid['steps_per_epoch']]
    if args.realistic
    else [(NUM_EXAMPLES, BATCH_SIZE)]
  )
  for num_examples, batch_size in sizes:
    for epochs in grid['epochs']:
      # Largest σ first: its builds are the cheapest, so a run cut short has most curves.
      for sigma in sorted(grid['sigmas'], reverse=args.realistic):
        row = one_point(
          sigma,
          epochs,
          monte_carlo=epochs in grid['monte_carlo_epochs'],
          workers=args.workers,
          num_examples=num_examples,
          batch_size=batch_size,
        )
        rows.append(row)
        _log(
          f'T={row["steps_per_epoch"]} E={epochs} σ={sigma}: poisson '
          f'{row["poisson_pld_upper"]:.4g}, '
          f'bnb provable {row["balls_and_bins_provable_upper"]:.4g} '
          f'({row["balls_and_bins_provable_method"]}), mc ucb '
          f'{row["balls_and_bins_mc_ucb_high_probability"]}, bnb lower '
          f'{row["balls_and_bins_max_test_lower"]:.4g}, shuffle lower '
          f'{row["shuffle_max_test_lower"]:.4g}, det {row["deterministic_exact"]:.4g}; '
          f'{sum(row["seconds"].values()):.0f} s'
        )
        # Written after every point, so a run cut short keeps what it computed.
        (args.out / f'results{suffix}.json').write_text(
          json.dumps(results_so_far(), indent=1) + '\n'
        )
  results = results_so_far()
  (args.out / f'results{suffix}.json').write_text(json.dumps(results, indent=1) + '\n')
  plot(results, args.out / f'epsilon_vs_sigma{suffix}.png')
  _log(
    f'wrote {args.out / f"results{suffix}.json"} and epsilon_vs_sigma{suffix}.png in '
    f'{results["total_seconds"]:.0f} s'
  )


if __name__ == '__main__':
  main()
