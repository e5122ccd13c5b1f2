"""Plot batch size plans: σ, σ·C/b and σ/(q·√S) against b, one line per plan.

  python -m dpjax.planner --num_examples 60000 --epsilon 3 --delta 1e-5 --epochs 10 \\
      --json plan.json
  python experiments/05_batch_size_planner/plot_plans.py plan.json --out plan.png
  python experiments/05_batch_size_planner/plot_plans.py a.json b.json --out both.png \\
      --reference shuffle.json --reference_note ' (no amplification)'

Reads the planner's --json files (`dpjax.trainer.planning.batch_size_plan.Plan.from_dict`); experiment 5
(run.py beside this file) draws its figure with `plot_plans`. Plotting lives
here, not in the library: dpjax itself never imports matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import matplotlib
from matplotlib import figure

from dpjax import planner
from dpjax.trainer.planning import batch_size_plan


def plot_plans(
  plans: Sequence[batch_size_plan.Plan],
  path: str,
  *,
  reference: Sequence[batch_size_plan.Plan] = (),
  reference_note: str = '',
) -> None:
  """σ, σ·C/b and σ/(q√S) against b (log axes), one line per plan (dashed: `reference`,
  labelled with `reference_note`)."""
  fig = figure.Figure(figsize=(15, 4.6))  # No pyplot: no backend or global state involved.
  axes = fig.subplots(1, 3)
  panels = (
    ('noise_multiplier', 'noise multiplier σ (calibrated)'),
    ('effective_noise', 'noise std on the averaged gradient σ·C/b'),
    ('run_noise', 'noise of the whole run σ/(q·√S)'),
  )
  colors = matplotlib.rcParams['axes.prop_cycle'].by_key()['color']
  lines = [(plan, i, True) for i, plan in enumerate(plans)]
  lines += [(plan, i, False) for i, plan in enumerate(reference)]
  for plan, i, main_line in lines:  # Main plans solid with a ★ at the best b; references dashed.
    color = colors[i % len(colors)]
    fmt, style, note = ('o-', dict(ms=4), '') if main_line else ('--', dict(lw=1), reference_note)
    b = [r.batch_size for r in plan.rows]
    for ax, (field, _) in zip(axes, panels):
      ax.plot(
        b,
        [getattr(r, field) for r in plan.rows],
        fmt,
        color=color,
        **style,
        label=f'{plan.sampler}{note}, ε = {plan.target_epsilon:g}',
      )
    if main_line:
      best = [r for r in plan.rows if r.batch_size == plan.best_batch_size][0]
      axes[1].plot([best.batch_size], [best.effective_noise], '*', color=color, ms=12)
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
  fig.suptitle(
    f'Calibrated noise vs batch size at fixed (ε, δ = {first.delta:g}, '
    f'{first.num_epochs} epochs), N = {first.num_examples}, C = {first.clip_norm:g}'
    f'; ★ smallest σ·C/b'
  )
  fig.tight_layout(rect=(0, 0.045 * rows + 0.02, 1, 1))
  fig.savefig(path, dpi=120)


def _load(path: str) -> batch_size_plan.Plan:
  with open(path) as f:
    return batch_size_plan.Plan.from_dict(json.load(f))


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('plans', nargs='+', help="the planner's --json files")
  p.add_argument('--out', required=True, help='the PNG to write')
  p.add_argument('--reference', nargs='*', default=(), help='plans drawn dashed')
  p.add_argument('--reference_note', default='', help='appended to the reference labels')
  args = p.parse_args(argv)
  plot_plans(
    [_load(path) for path in args.plans],
    args.out,
    reference=[_load(path) for path in args.reference],
    reference_note=args.reference_note,
  )
  print(f'wrote {args.out}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
