"""Experiment 6: the cost of truncation. ε vs the maximum batch size B, Poisson and balls-and-bins.

Static shapes need a cap B on the logical batch; a batch larger than B keeps a uniformly random
B of its examples, and the accountant pays for it (docs/accounting.md §1 "Truncation"):

* generic TV argument (any sampler): the truncated and untruncated runs differ only if some
  batch was truncated, τ = (#steps)·Pr[n_t > B] with n_t ~ Binomial(N + 1, p), so an
  (ε, δ₀)-DP untruncated run is (ε, δ₀ + (1 + e^ε)·τ)-DP truncated
  (Chua et al. 2024b, "Scalable DP-SGD: Shuffling vs. Poisson Subsampling");
* Poisson only: dp_accounting's exact `TruncatedSubsampledGaussianDpEvent` (arXiv 2508.15089),
  for the datasets of N and N + 1 examples.

  .venv/bin/python experiments/06_truncation/run.py          # default (2.5 min on a 2-core box)
  .venv/bin/python experiments/06_truncation/run.py --full   # exact event at every 10th B

Setting: N = 60000, b = 600 (q = 1/T = 0.01, T = 100 steps per epoch, so random-allocation PLD
is practical for balls-and-bins), σ = 1, E = 5 epochs = 500 steps, δ = 1e-5, physical batch
P = 64. Curves (all upper bounds):

  Poisson          PLD + TV penalty                        (Accountant, exact_truncation=False)
                   exact truncated event                   (Accountant, the default)
  balls-and-bins   ε dpjax attaches                        (Accountant)
                   random-allocation PLD + TV penalty      (balls_and_bins functions, see below)
                   deterministic bound + TV penalty        (balls_and_bins.deterministic_epsilon)

Marked: the untruncated ε of each sampler, the B that `batching.resolve_max_batch_size`
picks (τ ≤ δ·1e-3·e^{-50}, `batching.DEFAULT_TRUNCATION_BUDGET`) and the B of its rule before
commit 51319b7 (τ ≤ δ/1000). The dense TV curves are computed from the same dpjax functions the
accountant calls (`balls_and_bins.log_truncation_mass`, `smallest_epsilon`,
`random_allocation_epoch_pld`), with the Poisson PLD built as the accountant builds it; at the
sparse B the script checks they equal the accountant's numbers.

Writes results.json and epsilon_vs_max_batch_size.png next to this file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time
from typing import Any

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from dpjax.privacy import batching
from dpjax_bench import provenance
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import random_allocation
from dpjax.privacy.accounting import sampler_events

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent

NUM_EXAMPLES = 60_000
BATCH_SIZE = 600
NOISE_MULTIPLIER = 1.0
EPOCHS = 5
DELTA = 1e-5
PHYSICAL_BATCH_SIZE = 64
# TV-penalty curves (cheap); past 880 ε is flat, so coarser, up to beyond the automatic cap (960).
DENSE_GRID = tuple(range(600, 881, 4)) + tuple(range(888, 1025, 8))
SPARSE_GRID = (620, 640, 660, 680, 700, 720, 740, 760, 768, 780)  # the accountant (exact event).
FULL_SPARSE_GRID = tuple(range(610, 791, 10))
# "Meets the untruncated ε": within these relative tolerances.
TOLERANCES = (1e-2, 1e-3)
# The automatic cap's τ budget (fraction of δ) before commit 51319b7, for comparison.
OLD_TRUNCATION_BUDGET = 1e-3


def _log(*args) -> None:
  print(*args, file=sys.stderr, flush=True)


_git_state = provenance.git_state
_timed = provenance.timed


def _finite(x: float) -> float | None:
  return x if math.isfinite(x) else None


def _meets(grid, values, target) -> dict[str, int | None]:
  """Smallest B of the grid from which on ε stays within each tolerance of the target."""
  out = {}
  for tol in TOLERANCES:
    ok = [v is not None and v <= target * (1 + tol) for v in values]
    first = None
    for i in range(len(grid) - 1, -1, -1):
      if not ok[i]:
        break
      first = grid[i]
    out[f'{tol:g}'] = first
  return out


def run(sparse_grid) -> dict[str, Any]:
  steps_per_epoch = math.ceil(NUM_EXAMPLES / BATCH_SIZE)
  steps = EPOCHS * steps_per_epoch
  make = lambda name: samplers.sampler_class(name)(num_examples=NUM_EXAMPLES, batch_size=BATCH_SIZE)
  poisson, bnb = make('poisson'), make('balls_and_bins')
  q = poisson.sampling_probability
  assert bnb.sampling_probability == q  # Same binomial batch sizes, so the same τ(B).
  seconds: dict[str, float] = {}
  results: dict[str, Any] = {}

  # --- Untruncated ε and the automatic cap -------------------------------------------------
  untruncated_poisson, seconds['poisson_untruncated'] = _timed(
    lambda: accountant_lib.Accountant(
      poisson, NOISE_MULTIPLIER, DELTA, max_batch_size=None
    ).epsilon(steps)
  )
  untruncated_bnb_report, seconds['balls_and_bins_untruncated'] = _timed(
    lambda: accountant_lib.Accountant(bnb, NOISE_MULTIPLIER, DELTA, max_batch_size=None).epsilon_at(
      steps, estimates=False
    )
  )
  untruncated_bnb = untruncated_bnb_report.epsilon
  auto = {}
  for sampler in (poisson, bnb):
    cap = batching.resolve_max_batch_size(
      sampler, PHYSICAL_BATCH_SIZE, 0, num_steps=steps, delta=DELTA
    )
    report = accountant_lib.Accountant(
      sampler, NOISE_MULTIPLIER, DELTA, max_batch_size=cap
    ).epsilon_at(steps, estimates=False)
    auto[sampler.name] = {
      'max_batch_size': cap,
      'truncation_mass_tau': math.exp(
        balls_and_bins.log_truncation_mass(NUM_EXAMPLES, q, cap, steps)
      ),
      'epsilon_attached': report.epsilon,
      'method': report.details.get('method'),
      'details': report.to_dict()['details'],
    }
  # The automatic rule before 51319b7: smallest multiple of P with τ <= δ/1000.
  old_cap = PHYSICAL_BATCH_SIZE
  while balls_and_bins.log_truncation_mass(NUM_EXAMPLES, q, old_cap, steps) > math.log(
    DELTA * OLD_TRUNCATION_BUDGET
  ):
    old_cap += PHYSICAL_BATCH_SIZE
  auto_old_rule = {
    'max_batch_size': old_cap,
    'budget_fraction_of_delta': OLD_TRUNCATION_BUDGET,
    'truncation_mass_tau': math.exp(
      balls_and_bins.log_truncation_mass(NUM_EXAMPLES, q, old_cap, steps)
    ),
  }
  _log('untruncated', untruncated_poisson, untruncated_bnb, 'auto', auto, 'old', auto_old_rule)

  # --- Dense TV-penalty curves ---------------------------------------------------------------
  start = time.perf_counter()
  # The accountant's own composed PLD, at the grid it chose for this query (pessimistic).
  poisson_pld = accountant_lib.Accountant(poisson, NOISE_MULTIPLIER, DELTA).composed_pld(
    sampler_events.poisson_step_event(q, NOISE_MULTIPLIER), steps
  )
  # The one-epoch PLD the accountant composes for E epochs (its grid and tail mass).
  epoch_pld = balls_and_bins.random_allocation_epoch_pld(
    NOISE_MULTIPLIER,
    steps_per_epoch,
    timeout=None,
    discretization=random_allocation.epochs_discretization(
      NOISE_MULTIPLIER, steps_per_epoch, DELTA, EPOCHS
    ),
    tail_truncation=random_allocation.default_tail_truncation(DELTA),
  )
  bnb_pld = epoch_pld.self_compose(EPOCHS)
  dense = []
  for cap in DENSE_GRID:
    tau = math.exp(balls_and_bins.log_truncation_mass(NUM_EXAMPLES, q, cap, steps))
    bnb_report = accountant_lib.Accountant(
      bnb, NOISE_MULTIPLIER, DELTA, max_batch_size=cap
    ).epsilon_at(steps, estimates=False)
    dense.append(
      {
        'max_batch_size': cap,
        'truncation_mass_tau': tau,
        'poisson_pld_tv_upper': _finite(
          balls_and_bins.smallest_epsilon(
            poisson_pld.get_delta_for_epsilon, DELTA, penalty_mass=tau
          )
        ),
        'balls_and_bins_random_allocation_tv_upper': _finite(
          balls_and_bins.smallest_epsilon(bnb_pld.get_delta_for_epsilon, DELTA, penalty_mass=tau)
        ),
        'balls_and_bins_deterministic_tv_upper': _finite(
          balls_and_bins.deterministic_epsilon(NOISE_MULTIPLIER, EPOCHS, DELTA, penalty_mass=tau)
        ),
        'balls_and_bins_attached': _finite(bnb_report.epsilon),
        'balls_and_bins_attached_method': bnb_report.details['method'],
      }
    )
  seconds['dense_tv_curves'] = time.perf_counter() - start

  # --- Sparse: what the Poisson accountant attaches (exact truncated event when needed) ------
  sparse = []
  for cap in sparse_grid:
    report, sec = _timed(
      lambda: accountant_lib.Accountant(
        poisson, NOISE_MULTIPLIER, DELTA, max_batch_size=cap
      ).epsilon_at(steps, estimates=False)
    )
    tv_only = accountant_lib.Accountant(
      poisson, NOISE_MULTIPLIER, DELTA, max_batch_size=cap, exact_truncation=False
    ).epsilon(steps)
    d = report.details
    sparse.append(
      {
        'max_batch_size': cap,
        'truncation_mass_tau': d['truncation_mass'],
        'poisson_attached': _finite(report.epsilon),
        'poisson_method': d['method'],
        'poisson_tv_upper_accountant': _finite(tv_only),
        'poisson_exact_truncated_event_upper': d.get('truncated_event_epsilon'),
        'seconds': sec,
      }
    )
    _log(
      f'B={cap}: τ={d["truncation_mass"]:.3g} poisson attached {report.epsilon:.4g} '
      f'({d["method"]}), exact {d.get("truncated_event_epsilon")}, tv {tv_only:.4g}; '
      f'{sec:.0f} s'
    )
  seconds['sparse_poisson_accountant'] = sum(r['seconds'] for r in sparse)

  # The dense TV curve must be the accountant's own number wherever both exist.
  by_cap = {r['max_batch_size']: r for r in dense}
  diffs = [
    abs(r['poisson_tv_upper_accountant'] - by_cap[r['max_batch_size']]['poisson_pld_tv_upper'])
    for r in sparse
    if r['max_batch_size'] in by_cap
    and r['poisson_tv_upper_accountant'] is not None
    and by_cap[r['max_batch_size']]['poisson_pld_tv_upper'] is not None
  ]

  caps = [r['max_batch_size'] for r in dense]
  results.update(
    {
      'untruncated': {
        'poisson_pld_upper': untruncated_poisson,
        'balls_and_bins_provable_upper': untruncated_bnb,
        'balls_and_bins_method': untruncated_bnb_report.details['method'],
      },
      'automatic_cap': auto,
      'automatic_cap_old_rule': auto_old_rule,
      'meets_untruncated': {
        'poisson_pld_tv': _meets(
          caps, [r['poisson_pld_tv_upper'] for r in dense], untruncated_poisson
        ),
        'balls_and_bins_random_allocation_tv': _meets(
          caps, [r['balls_and_bins_random_allocation_tv_upper'] for r in dense], untruncated_bnb
        ),
        'balls_and_bins_attached': _meets(
          caps, [r['balls_and_bins_attached'] for r in dense], untruncated_bnb
        ),
        'poisson_attached_sparse_grid': _meets(
          [r['max_batch_size'] for r in sparse],
          [r['poisson_attached'] for r in sparse],
          untruncated_poisson,
        ),
      },
      'check_dense_tv_equals_accountant_max_abs_diff': max(diffs) if diffs else None,
      'dense': dense,
      'sparse': sparse,
      'seconds': seconds,
    }
  )
  return results


def plot(results: dict[str, Any], path: pathlib.Path) -> None:
  s = results['settings']
  dense, sparse = results['dense'], results['sparse']
  fig, (ax, ax_tau) = plt.subplots(
    2, 1, figsize=(9, 8.5), sharex=True, gridspec_kw={'height_ratios': [3, 1.3]}
  )
  x = [r['max_batch_size'] for r in dense]

  def line(key, **kw):
    pts = [(r['max_batch_size'], r[key]) for r in dense if r[key] is not None]
    if pts:
      ax.plot(*zip(*pts), **kw)

  u = results['untruncated']
  ax.axhline(u['poisson_pld_upper'], color='tab:blue', lw=0.8, ls=(0, (1, 3)))
  ax.axhline(u['balls_and_bins_provable_upper'], color='tab:green', lw=0.8, ls=(0, (1, 3)))
  line('poisson_pld_tv_upper', color='tab:blue', ls='--', label='Poisson: PLD + TV penalty (upper)')
  pts = [
    (r['max_batch_size'], r['poisson_exact_truncated_event_upper'])
    for r in sparse
    if r['poisson_exact_truncated_event_upper'] is not None
  ]
  if pts:
    ax.plot(
      *zip(*pts),
      color='tab:blue',
      ls='-',
      marker='o',
      label='Poisson: exact truncated event, dp_accounting (upper)',
    )
  pts = [
    (r['max_batch_size'], r['poisson_attached'])
    for r in sparse
    if r['poisson_attached'] is not None
  ]
  ax.plot(
    *zip(*pts),
    ls='none',
    marker='o',
    mfc='none',
    ms=11,
    color='navy',
    label='Poisson: ε dpjax attaches = min of the two (upper)',
  )
  line(
    'balls_and_bins_random_allocation_tv_upper',
    color='tab:green',
    ls='-',
    label='Balls-and-bins: random-allocation PLD + TV penalty at ε (upper)',
  )
  line(
    'balls_and_bins_deterministic_tv_upper',
    color='tab:red',
    ls='-',
    label='Balls-and-bins: deterministic bound + TV penalty (upper)',
  )
  fin = [
    (r['max_batch_size'], r['balls_and_bins_attached'])
    for r in dense
    if r['balls_and_bins_attached'] is not None
  ]
  if fin:
    ax.plot(
      *zip(*fin),
      ls='none',
      marker='s',
      ms=4.5,
      mfc='none',
      mew=0.8,
      color='darkgreen',
      label='Balls-and-bins: ε dpjax attaches (upper)',
    )
  ymax = 40.0
  inf_caps = [r['max_batch_size'] for r in dense if r['balls_and_bins_attached'] is None]
  if inf_caps:
    ax.plot(
      inf_caps,
      [ymax * 0.85] * len(inf_caps),
      ls='none',
      marker='^',
      ms=4,
      color='darkgreen',
      alpha=0.6,
      label='Balls-and-bins: dpjax attaches ε = ∞ (drawn at top)',
    )
  auto = results['automatic_cap']['poisson']
  for a in (ax, ax_tau):
    a.axvline(auto['max_batch_size'], color='k', lw=1, ls='-.')
  ax.annotate(
    f'automatic B = {auto["max_batch_size"]}\nτ = {auto["truncation_mass_tau"]:.2g}',
    (auto['max_batch_size'], 0.3),
    xytext=(-6, 0),
    textcoords='offset points',
    ha='right',
    fontsize=8,
  )
  old = results.get('automatic_cap_old_rule')
  if old:
    for a in (ax, ax_tau):
      a.axvline(old['max_batch_size'], color='0.6', lw=1, ls='-.')
    ax.annotate(
      f'automatic B before 51319b7 = {old["max_batch_size"]}\nτ = {old["truncation_mass_tau"]:.2g}',
      (old['max_batch_size'], 0.3),
      xytext=(6, 0),
      textcoords='offset points',
      fontsize=8,
      color='0.4',
    )
  ax.text(
    x[-1],
    u['poisson_pld_upper'] * 1.04,
    f'Poisson untruncated {u["poisson_pld_upper"]:.3f}',
    ha='right',
    va='bottom',
    fontsize=8,
    color='tab:blue',
  )
  ax.text(
    x[-1],
    u['balls_and_bins_provable_upper'] * 0.96,
    f'balls-and-bins untruncated {u["balls_and_bins_provable_upper"]:.3f}',
    ha='right',
    va='top',
    fontsize=8,
    color='tab:green',
  )
  ax.set_yscale('log')
  ax.set_ylim(0.25, ymax)
  ax.set_ylabel(f'ε at δ = {s["delta"]:g}')
  ax.grid(True, which='both', alpha=0.3)
  ax.legend(fontsize=7.5, loc='center right')
  ax.set_title(
    f'Cost of truncating batches to B: N = {s["num_examples"]}, b = {s["batch_size"]} '
    f'(q = {s["sampling_probability"]:g}), σ = {s["noise_multiplier"]:g}, '
    f'E = {s["epochs"]} epochs = {s["steps"]} steps',
    fontsize=10,
  )
  ax_tau.plot(x, [r['truncation_mass_tau'] for r in dense], color='k')
  ax_tau.axhline(s['delta'], color='tab:red', lw=0.8, ls='--', label='δ')
  budget = s.get('automatic_rule_budget_fraction_of_delta', batching.DEFAULT_TRUNCATION_BUDGET)
  ax_tau.axhline(
    s['delta'] * budget,
    color='tab:purple',
    lw=0.8,
    ls='--',
    label=f'δ·1e-3·e$^{{-50}}$ = {s["delta"] * budget:.2g} (automatic rule)',
  )
  if old:
    ax_tau.axhline(
      s['delta'] * old['budget_fraction_of_delta'],
      color='0.6',
      lw=0.8,
      ls='--',
      label='δ/1000 (automatic rule before 51319b7)',
    )
  ax_tau.set_yscale('log')
  ax_tau.set_ylim(1e-45, 1e3)
  ax_tau.set_ylabel('τ = steps · Pr[n_t > B]')
  std = math.sqrt(s['batch_size'] * (1 - s['sampling_probability']))
  ax_tau.set_xlabel(
    f'maximum batch size B (examples; mean batch b = {s["batch_size"]}, std {std:.1f})'
  )
  ax_tau.grid(True, which='both', alpha=0.3)
  ax_tau.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    '--full',
    action='store_true',
    help='exact truncated event at every 10th B (about twice the default)',
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
  args = parser.parse_args()
  args.out.mkdir(parents=True, exist_ok=True)
  png = args.out / 'epsilon_vs_max_batch_size.png'
  if args.plot_only:
    plot(json.loads((args.out / 'results.json').read_text()), png)
    return
  start = time.perf_counter()
  steps = EPOCHS * math.ceil(NUM_EXAMPLES / BATCH_SIZE)
  results = {
    'experiment': '06_truncation',
    'question': 'What does capping the logical batch at B cost in ε, for Poisson and '
    'balls-and-bins, and where does the automatic cap sit?',
    'command': ' '.join([sys.executable] + sys.argv),
    'settings': {
      'num_examples': NUM_EXAMPLES,
      'batch_size': BATCH_SIZE,
      'sampling_probability': BATCH_SIZE / NUM_EXAMPLES,
      'steps_per_epoch': math.ceil(NUM_EXAMPLES / BATCH_SIZE),
      'epochs': EPOCHS,
      'steps': steps,
      'noise_multiplier': NOISE_MULTIPLIER,
      'delta': DELTA,
      'physical_batch_size': PHYSICAL_BATCH_SIZE,
      'dense_grid': list(DENSE_GRID),
      'sparse_grid': list(FULL_SPARSE_GRID if args.full else SPARSE_GRID),
      'automatic_rule': (
        'smallest multiple of P with τ <= δ·1e-3·e^-50 = δ·'
        f'{batching.DEFAULT_TRUNCATION_BUDGET:.6g}'
      ),
      'automatic_rule_budget_fraction_of_delta': batching.DEFAULT_TRUNCATION_BUDGET,
      'full': args.full,
      'cache_dir': os.environ.get('DPJAX_CACHE_DIR', '~/.cache/dpjax'),
    },
    'git': _git_state(),
  }
  results.update(run(FULL_SPARSE_GRID if args.full else SPARSE_GRID))
  results['machine'] = dict(
    provenance.machine(),  # Its load average: at the end.
    time=time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()),
  )
  results['total_seconds'] = time.perf_counter() - start
  (args.out / 'results.json').write_text(json.dumps(results, indent=1) + '\n')
  plot(results, png)
  _log(f'wrote {args.out / "results.json"} and {png.name} in {results["total_seconds"]:.0f} s')


if __name__ == '__main__':
  main()
