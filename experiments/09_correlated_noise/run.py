"""Correlated noise (BandMF) against DP-SGD at equal ε, same steps and epochs (issue 36, item 5).

Question: at a fixed (ε, δ), does banded matrix factorisation (Choquette-Choo et al. 2023,
"(Amplified) Banded Matrix Factorization") train to a better accuracy than DP-SGD with
independent noise, on the same data, model, optimiser, batch size and number of steps?

Mechanisms, each with σ calibrated to the target ε by its own accountant (dpjax's PLD,
upper bounds):
  dpsgd_poisson   DP-SGD, Poisson sampling at q = b/N: T steps at rate b/N.
  dpsgd_cyclic    DP-SGD, cyclic Poisson with k groups: ⌈T/k⌉ participations at rate bk/N
                  (the sampler of the next line with C = I: isolates what the sampler costs).
  bandmf_cyclic   BandMF with k bands, cyclic Poisson with k groups: accounted exactly as
                  dpsgd_cyclic (same σ at the same ε); the noise is correlated over k steps.
  blt_cyclic      BLT with 2 buffers, cyclic Poisson with k groups: not banded, so not
                  amplified: one Gaussian of its sensitivity over each group's steps (--blt).
  blt_deterministic  BLT with 2 buffers in dataset order: its sensitivity over the epochs'
                  participations (--blt).

Tasks: the embedded digits (N = 1437, MLP, b = 64, k = 4, 20 epochs) and a synthetic
10-class Gaussian-mixture task large enough for multi-epoch training (N = 20000, d = 32, MLP,
b = 256, k = 8, 10 epochs; written to a temporary .npz, seeded, so the run is offline and
reproducible). SGD with a constant learning rate, no momentum: the released iterates are
prefix sums of the noisy gradients, the workload BandMF is optimised for.

  python experiments/09_correlated_noise/run.py             # both tasks, 5 seeds, ≈ 15 min on 2 cores
  python experiments/09_correlated_noise/run.py --tasks digits --seeds 0,1

Writes results.json (every run, the strategies' expected errors, the settings, the git
commit) and accuracy_vs_epsilon.png; prints the README's table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # pylint: disable=g-import-not-at-top

from dpjax import train  # pylint: disable=g-import-not-at-top
from dpjax.configs import digits_mlp  # pylint: disable=g-import-not-at-top
from dpjax.privacy.correlated import strategy  # pylint: disable=g-import-not-at-top
from dpjax_bench import provenance  # pylint: disable=g-import-not-at-top

EPSILONS = (1.0, 2.0, 4.0, 8.0)
MECHANISMS = ('dpsgd_poisson', 'dpsgd_cyclic', 'bandmf_cyclic')
BLT_MECHANISMS = ('blt_cyclic', 'blt_deterministic')
LARGE = 10**6  # Log, evaluate and checkpoint at the last step only.
TASKS = {
  'digits': {'batch_size': 64, 'groups': 4, 'epochs': 20, 'learning_rate': 1.0},
  'synthetic': {'batch_size': 256, 'groups': 8, 'epochs': 10, 'learning_rate': 1.0},
}


def synthetic_npz(path: pathlib.Path, seed: int = 0) -> None:
  """10 Gaussian classes in 32 dimensions (means at distance ~3.2, unit noise): 20000 train,
  4000 test rows, float32 features, int labels."""
  rng = np.random.default_rng(seed)
  means = rng.normal(size=(10, 32)) * 0.55
  arrays = {}
  for split, n in (('train', 20_000), ('test', 4_000)):
    y = rng.integers(0, 10, n)
    arrays[f'x_{split}'] = (means[y] + rng.normal(size=(n, 32))).astype(np.float32)
    arrays[f'y_{split}'] = y.astype(np.int32)
  np.savez(path, **arrays)


def make_config(task: str, mechanism: str, epsilon: float, seed: int, npz: str):
  settings = TASKS[task]
  config = digits_mlp.get_config()
  if task == 'synthetic':
    config.data.source, config.data.path = 'npz', npz
    config.data.num_classes = 10
    config.data.scale = 1.0
  config.seed = seed
  config.num_epochs, config.num_steps = settings['epochs'], 0
  config.sampler.batch_size = settings['batch_size']
  config.sampler.physical_batch_size = settings['batch_size']
  config.optimizer.learning_rate = settings['learning_rate']
  config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = LARGE
  config.privacy.target_epsilon = epsilon
  config.privacy.noise_multiplier = None  # Calibrated per mechanism to the target ε.
  if mechanism.endswith('_cyclic'):
    config.sampler.name = 'cyclic_poisson'
    config.sampler.num_groups = settings['groups']
  if mechanism == 'blt_deterministic':
    config.sampler.name = 'deterministic'
  if mechanism == 'bandmf_cyclic':
    config.privacy.noise = 'bandmf'
    config.privacy.num_bands = settings['groups']
  if mechanism.startswith('blt'):
    config.privacy.noise = 'blt'
    config.privacy.num_buffers = 2
  return config


def run_one(task, mechanism, epsilon, seed, npz) -> dict:
  config = make_config(task, mechanism, epsilon, seed, npz)
  start = time.time()
  with tempfile.TemporaryDirectory(prefix='dpjax_exp09_') as workdir:
    with contextlib.redirect_stdout(io.StringIO()):
      result = train.train_and_evaluate(config, workdir)
  report = result['privacy']
  return {
    'task': task,
    'mechanism': mechanism,
    'target_epsilon': epsilon,
    'seed': seed,
    'epsilon': report['epsilon'],
    'bound': report['bound'],
    'noise_multiplier': report['noise_multiplier'],
    'steps': result['step'],
    'test_accuracy': result['eval_accuracy'],
    'wall_time_s': time.time() - start,
  }


def strategy_errors(task: str, steps: int) -> dict:
  """BandMF's expected error relative to DP-SGD's at the same σ (prefix sums)."""
  bands = TASKS[task]['groups']
  run_strategy = strategy.for_run('bandmf', steps, num_bands=bands)
  return {
    'bands': bands,
    'steps': steps,
    'coefficients': list(run_strategy.coefs),
    'bandmf_over_dpsgd_expected_error': run_strategy.expected_error(),
  }


def summary(runs: list[dict]) -> list[dict]:
  """Per (task, ε, mechanism): σ and the test accuracy's mean and std over seeds (the table)."""
  out = []
  for task, eps, mech in sorted({(r['task'], r['target_epsilon'], r['mechanism']) for r in runs}):
    group = [
      r for r in runs if (r['task'], r['target_epsilon'], r['mechanism']) == (task, eps, mech)
    ]
    acc = np.array([r['test_accuracy'] for r in group])
    out.append(
      {
        'task': task,
        'target_epsilon': eps,
        'mechanism': mech,
        'noise_multiplier': group[0]['noise_multiplier'],
        'test_accuracy_mean': float(acc.mean()),
        'test_accuracy_std': float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
        'seeds': len(acc),
      }
    )
  return out


def table(runs: list[dict]) -> str:
  lines = [
    '| task | ε | mechanism | σ | test accuracy (mean ± std) | seeds |',
    '|---|---|---|---|---|---|',
  ]
  keys = sorted({(r['task'], r['target_epsilon'], r['mechanism']) for r in runs})
  for task, eps, mech in keys:
    group = [
      r for r in runs if (r['task'], r['target_epsilon'], r['mechanism']) == (task, eps, mech)
    ]
    acc = np.array([r['test_accuracy'] for r in group])
    sigma = group[0]['noise_multiplier']
    lines.append(
      f'| {task} | {eps:g} | {mech} | {sigma:.4g} | {acc.mean():.4f} ± {acc.std(ddof=1) if len(acc) > 1 else 0:.4f} | {len(acc)} |'
    )
  return '\n'.join(lines)


def plot(runs: list[dict], path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel

  tasks = sorted({r['task'] for r in runs})
  fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
  for ax, task in zip(axes[0], tasks):
    for mech in MECHANISMS + BLT_MECHANISMS:
      points = []
      for eps in EPSILONS:
        acc = [
          r['test_accuracy']
          for r in runs
          if (r['task'], r['mechanism'], r['target_epsilon']) == (task, mech, eps)
        ]
        if acc:
          points.append((eps, np.mean(acc), np.std(acc, ddof=1) if len(acc) > 1 else 0.0))
      if points:
        x, m, s = map(np.array, zip(*points))
        ax.errorbar(x, m, yerr=s, marker='o', capsize=3, label=mech)
    ax.set_xscale('log', base=2)
    ax.set_xlabel('ε (δ = 1e-5), σ calibrated per mechanism')
    ax.set_ylabel('test accuracy (mean ± std over seeds)')
    ax.set_title(task)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--tasks', default='digits,synthetic')
  parser.add_argument('--seeds', default='0,1,2,3,4')
  parser.add_argument('--out', default=str(HERE / 'results.json'))
  parser.add_argument(
    '--blt', action='store_true', help='run the BLT mechanisms and add them to --out'
  )
  args = parser.parse_args()
  mechanisms_run = BLT_MECHANISMS if args.blt else MECHANISMS
  tasks = [t for t in args.tasks.split(',') if t]
  seeds = [int(s) for s in args.seeds.split(',') if s]
  runs = []
  with tempfile.TemporaryDirectory(prefix='dpjax_exp09_data_') as tmp:
    npz = str(pathlib.Path(tmp) / 'synthetic.npz')
    synthetic_npz(pathlib.Path(npz))
    for task in tasks:
      for eps in EPSILONS:
        for seed in seeds:
          for mech in mechanisms_run:  # Interleaved: a slow stretch of the machine hits all.
            runs.append(run_one(task, mech, eps, seed, npz))
            r = runs[-1]
            print(
              f'{task} eps={eps:g} seed={seed} {mech}: sigma={r["noise_multiplier"]:.4g} acc={r["test_accuracy"]:.4f} ({r["wall_time_s"]:.1f} s)',
              flush=True,
            )
  errors = {
    task: strategy_errors(task, max(r['steps'] for r in runs if r['task'] == task))
    for task in tasks
  }
  if args.blt:  # Added beside the earlier mechanisms' runs.
    earlier = json.loads(pathlib.Path(args.out).read_text())
    earlier['runs'] += runs
    earlier['summary'] = summary(earlier['runs'])
    earlier['git_blt'] = provenance.git_state()
    pathlib.Path(args.out).write_text(json.dumps(earlier, indent=1))
    plot(earlier['runs'], HERE / 'accuracy_vs_epsilon.png')
    print(table(earlier['runs']))
    return
  out = {
    'git': provenance.git_state(),
    'machine': provenance.machine(),
    'settings': {
      'tasks': {t: TASKS[t] for t in tasks},
      'epsilons': EPSILONS,
      'seeds': seeds,
      'delta': 1e-5,
    },
    'strategies': errors,
    'runs': runs,
    'summary': summary(runs),
  }
  pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
  plot(runs, HERE / 'accuracy_vs_epsilon.png')
  print(table(runs))
  print(json.dumps(errors, indent=1))


if __name__ == '__main__':
  main()
