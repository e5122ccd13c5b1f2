"""Experiment 3: fixed-size batches vs Poisson sampling, ε vs epochs (seed 001 setting).

  python experiments/03_fixed_size_vs_poisson/run.py          # ~1 min on 2 CPU cores
  python experiments/03_fixed_size_vs_poisson/run.py --full   # a denser epoch grid

Setting of Birrell et al. 2024 (seed 001; the slides give σ = 6, b = 120, N = 50000 and no ε,
δ or step count): δ = 1e-5 and 416 = floor(N/b) steps per epoch are the reference setting of
docs/accounting.md §7 (dpjax's samplers would run ceil(N/b) = 417), whose FS-RDP values
0.454 / 0.659 / 1.083 at 50 / 100 / 250 epochs are a computation of the same closed form made
for that note, not numbers from the slides.
Curves (all upper bounds on ε; the neighbouring relation is part of each name):

* fixed size, MoG PLD, add/remove: dpjax's accountant, `fixed_size_step_event`
  = MoG [0, 2] with probabilities [1 − q, q] (Ganesh, seed 004, Thm 3.3).
* fixed size, FS-RDP, add/remove: dpjax's accountant with accountant='rdp',
  `fixed_size_rdp` (Birrell et al. 2024, Thm 3.1, integer orders 2…256).
* fixed size, Wang et al. RDP, replace-one: dp_accounting's
  `SampledWithoutReplacementDpEvent(N, b, GaussianDpEvent(σ/2))` (Wang, Balle,
  Kasiviswanathan 2019), composed directly in dp_accounting's RDP accountant
  with NeighborRel.REPLACE_ONE, and checked against the number the dpjax
  accountant reports beside ε.
* Poisson, q = b/N, PLD and RDP, add/remove: dpjax's accountant.
* Poisson at σ/2 = 3 (PLD, add/remove): a reference only, showing that
  fixed-size add/remove behaves like Poisson with half the noise (the added
  example displaces another: sensitivity 2).

The MoG PLD is also recomputed with dp_accounting's PLDAccountant on
`MixtureOfGaussiansDpEvent` directly at the table's epochs, at the grid dpjax's report names
(a cross-check).
Writes results.json and epsilon_vs_epochs.png next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import sampler_events

NOISE_MULTIPLIER = 6.0
BATCH_SIZE = 120
NUM_EXAMPLES = 50_000
DELTA = 1e-5
STEPS_PER_EPOCH = 416  # docs/accounting.md §7's count (floor(N/b)); the slides give none.
TABLE_EPOCHS = (50, 100, 250)
# docs/accounting.md §7's reference values (computed for that note; not in the slides).
REFERENCE_FS_RDP = {50: 0.454, 100: 0.659, 250: 1.083}
HERE = os.path.dirname(os.path.abspath(__file__))


def epoch_grid(full: bool) -> list[int]:
  """Log-spaced epochs in [1, 250], always including the table's epochs."""
  points = 60 if full else 25
  grid = np.unique(np.round(np.logspace(0, np.log10(250), points)).astype(int))
  return sorted(set(grid.tolist()) | set(TABLE_EPOCHS))


def wang_et_al_epsilon(steps: int) -> float:
  """Wang et al. 2019 fixed-size RDP bound (replace-one), straight from dp_accounting."""
  rdp = rdp_privacy_accountant.RdpAccountant(
    neighboring_relation=rdp_privacy_accountant.NeighborRel.REPLACE_ONE
  )
  # Replace-one moves the clipped sum by up to 2C: noise multiplier σ/2 on sensitivity 1.
  rdp.compose(
    dp_event.SampledWithoutReplacementDpEvent(
      NUM_EXAMPLES, BATCH_SIZE, dp_event.GaussianDpEvent(NOISE_MULTIPLIER / 2)
    ),
    steps,
  )
  return float(rdp.get_epsilon(DELTA))


def mog_pld_direct(steps: int, grid: float) -> float:
  """MoG [0, 2] PLD from dp_accounting's own accountant at `grid` (cross-check of dpjax's fast
  path at the grid its report names)."""
  q = BATCH_SIZE / NUM_EXAMPLES
  pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=grid)
  pld.compose(dp_event.MixtureOfGaussiansDpEvent(NOISE_MULTIPLIER, [0.0, 2.0], [1 - q, q]), steps)
  return float(pld.get_epsilon(DELTA))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--full', action='store_true', help='denser epoch grid (60 points)')
  args = parser.parse_args()
  start = time.perf_counter()
  fixed = samplers.sampler_class('fixed_size')(num_examples=NUM_EXAMPLES, batch_size=BATCH_SIZE)
  poisson = samplers.sampler_class('poisson')(num_examples=NUM_EXAMPLES, batch_size=BATCH_SIZE)
  accountants = {
    'fixed_size_mog_pld_add_remove': accountant_lib.Accountant(
      fixed, NOISE_MULTIPLIER, DELTA, accountant='pld'
    ),
    'fixed_size_fs_rdp_add_remove': accountant_lib.Accountant(
      fixed, NOISE_MULTIPLIER, DELTA, accountant='rdp'
    ),
    'poisson_pld_add_remove': accountant_lib.Accountant(
      poisson, NOISE_MULTIPLIER, DELTA, accountant='pld', max_batch_size=None
    ),
    'poisson_rdp_add_remove': accountant_lib.Accountant(
      poisson, NOISE_MULTIPLIER, DELTA, accountant='rdp', max_batch_size=None
    ),
    'poisson_pld_half_sigma_reference': accountant_lib.Accountant(
      poisson, NOISE_MULTIPLIER / 2, DELTA, accountant='pld', max_batch_size=None
    ),
  }
  epochs = epoch_grid(args.full)
  curves = {name: [] for name in accountants}
  curves['fixed_size_wang_et_al_rdp_replace_one'] = []
  for e in epochs:
    steps = e * STEPS_PER_EPOCH
    for name, acct in accountants.items():
      curves[name].append(acct.epsilon(steps))
    curves['fixed_size_wang_et_al_rdp_replace_one'].append(wang_et_al_epsilon(steps))
    print(f'epochs {e:4d}: ' + ', '.join(f'{n} {c[-1]:.4f}' for n, c in curves.items()), flush=True)

  table = []
  for e in TABLE_EPOCHS:
    i, steps = epochs.index(e), e * STEPS_PER_EPOCH
    # The accountant's own report of the Wang et al. number beside ε (same event).
    report = accountants['fixed_size_mog_pld_add_remove'].epsilon_at(steps)
    row = {name: curve[i] for name, curve in curves.items()}
    row.update(
      epochs=e,
      steps=steps,
      fs_rdp_reference_docs_accounting=REFERENCE_FS_RDP[e],
      mog_pld_grid=report.details['pld_grid'],
      mog_pld_dp_accounting_direct=mog_pld_direct(steps, report.details['pld_grid']),
      wang_et_al_from_dpjax_report=report.details['wang_et_al_rdp_replace_one_epsilon'],
      fs_rdp_order=accountants['fixed_size_fs_rdp_add_remove']
      .epsilon_at(steps, estimates=False)
      .details.get('fs_rdp_order'),
    )
    row['ratio_fixed_size_mog_pld_over_poisson_pld'] = (
      row['fixed_size_mog_pld_add_remove'] / row['poisson_pld_add_remove']
    )
    row['ratio_fs_rdp_over_mog_pld'] = (
      row['fixed_size_fs_rdp_add_remove'] / row['fixed_size_mog_pld_add_remove']
    )
    table.append(row)

  results = dict(
    question='ε vs epochs for fixed-size batches (FS-RDP, Wang et al., MoG PLD) vs Poisson',
    setting=dict(
      noise_multiplier=NOISE_MULTIPLIER,
      batch_size=BATCH_SIZE,
      num_examples=NUM_EXAMPLES,
      delta=DELTA,
      steps_per_epoch=STEPS_PER_EPOCH,
      sampling_probability=BATCH_SIZE / NUM_EXAMPLES,
    ),
    neighbouring_relation={
      'fixed_size_mog_pld_add_remove': 'add/remove one example (datasets of size >= N)',
      'fixed_size_fs_rdp_add_remove': 'add/remove one example',
      'fixed_size_wang_et_al_rdp_replace_one': 'replace one example',
      'poisson_pld_add_remove': 'add/remove one example',
      'poisson_rdp_add_remove': 'add/remove one example',
      'poisson_pld_half_sigma_reference': 'add/remove, σ/2 (reference, not this run)',
    },
    epochs=epochs,
    epsilon=curves,
    table=table,
    seconds=time.perf_counter() - start,
  )
  with open(os.path.join(HERE, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1)
  plot(epochs, curves)
  print(json.dumps(table, indent=1))


def plot(epochs, curves):
  styles = {
    'fixed_size_wang_et_al_rdp_replace_one': (
      'fixed size: Wang et al. RDP (replace-one)',
      'tab:red',
      '-',
    ),
    'fixed_size_fs_rdp_add_remove': (
      'fixed size: FS-RDP, Birrell et al. (add/remove)',
      'tab:orange',
      '-',
    ),
    'fixed_size_mog_pld_add_remove': ('fixed size: MoG PLD, Ganesh (add/remove)', 'tab:blue', '-'),
    'poisson_rdp_add_remove': ('Poisson q=b/N: RDP (add/remove)', 'tab:green', '--'),
    'poisson_pld_add_remove': ('Poisson q=b/N: PLD (add/remove)', 'tab:olive', '--'),
  }
  fig, ax = plt.subplots(figsize=(7.5, 5))
  for name, (label, color, style) in styles.items():
    ax.plot(epochs, curves[name], style, color=color, label=label, lw=1.8)
  ax.plot(
    epochs,
    curves['poisson_pld_half_sigma_reference'],
    'o',
    mfc='none',
    color='0.3',
    ms=5,
    markevery=2,
    label='Poisson PLD at σ/2 = 3 (same pair as the MoG [0, 2])',
  )
  for e in TABLE_EPOCHS:
    ax.axvline(e, color='0.85', lw=0.8, zorder=0)
  ax.plot(
    list(REFERENCE_FS_RDP),
    list(REFERENCE_FS_RDP.values()),
    'x',
    color='k',
    ms=8,
    label='FS-RDP reference values (docs/accounting.md §7)',
  )
  ax.set_xscale('log')
  ax.set_yscale('log')
  ax.set_xlabel('epochs (416 steps each)')
  ax.set_ylabel(f'ε at δ = {DELTA:g}')
  ax.set_title(
    f'Fixed-size vs Poisson: σ = {NOISE_MULTIPLIER:g}, b = {BATCH_SIZE}, N = {NUM_EXAMPLES}'
  )
  ax.grid(True, which='both', alpha=0.3)
  ax.legend(fontsize=8, loc='upper left')
  fig.tight_layout()
  fig.savefig(os.path.join(HERE, 'epsilon_vs_epochs.png'), dpi=120)


if __name__ == '__main__':
  main()
