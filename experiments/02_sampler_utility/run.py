"""Samplers' utility (seed 000, Figure 1 style): test accuracy vs σ at equal σ.

Question: at the same noise multiplier σ (and the same b, C, learning rate and
number of epochs), does DP-SGD with balls-and-bins sampling train as well as
with shuffling and with Poisson subsampling? Seed 000 (Chua et al., "Balls-and-
Bins Sampling for DP-SGD") reports that balls-and-bins matches shuffling in
utility while its privacy analysis is close to Poisson's.

  python experiments/02_sampler_utility/run.py            # digits, 102 runs, ≈ 10 min on 2 cores
  python experiments/02_sampler_utility/run.py --full     # more seeds and σ
  python experiments/02_sampler_utility/run.py --full --mnist_data_dir ~/tfds  # + MNIST CNN

Every run calls `dpjax.train.train_and_evaluate` in a fresh temporary workdir
with configs/digits_mlp.py, changing only: the sampler, σ
(`privacy.noise_multiplier`, with `privacy.target_epsilon = 0`: no
calibration), the seed, the number of epochs, and the cap B on the logical
batch, set to its no-truncation value (B > N for Poisson and balls-and-bins,
B = b for shuffle) so that ε carries no truncation penalty; the runs report
how many batches were truncated (none can be). ε does not depend on the seed;
each run records the report of its own accountant: ε, its kind of bound
('upper', 'high_probability_upper' or 'lower'), the method, and the lower
bound beside it where the accountant gives one. A lower bound is never
plotted or tabulated as an upper bound.

Batch-size control. The noisy sum is divided by the expected batch size:
b for Poisson and shuffle, N/T (T = ceil(N/b) bins) for balls-and-bins. On
digits (N = 1437) the config's b = 256 gives N/T = 239.5, so at equal σ
balls-and-bins carries 7 % more noise per averaged gradient, Poisson sees
6·256 = 1536 examples per epoch, and shuffle's last batch holds 157 of 256. The
control series reruns σ ≥ 4 with b = 240 ≈ N/6, where the three divisors and
the examples per epoch agree to 0.2 %.

Writes results.json (every run with its git commit, and the settings) and
sampler_utility.png (accuracy vs σ, mean ± std over seeds; ε vs σ by bound
type), plus sampler_utility_mnist.png when MNIST runs; prints the Markdown
table used in README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))  # For `configs` (dpjax itself is installed).

from absl import logging  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import numpy as np

from dpjax.trainer.planning import plan as plan_lib  # pylint: disable=g-import-not-at-top
from dpjax.configs import digits_mlp  # pylint: disable=g-import-not-at-top
from dpjax.configs import mnist_cnn  # pylint: disable=g-import-not-at-top
from dpjax.data import sources as data  # pylint: disable=g-import-not-at-top
from dpjax_bench import provenance  # pylint: disable=g-import-not-at-top
from dpjax import train  # pylint: disable=g-import-not-at-top

SAMPLERS = ('poisson', 'balls_and_bins', 'shuffle')
DEFAULT_SIGMAS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
FULL_SIGMAS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
DEFAULT_CONTROL_SIGMAS = (4.0, 8.0, 16.0, 32.0)
DEFAULT_SEEDS = (0, 1, 2)
FULL_SEEDS = (0, 1, 2, 3, 4)
LARGE = 10**6  # A period longer than any run: log / eval / checkpoint at the last step only.


def _csv(kind):
  return lambda text: tuple(kind(v) for v in text.split(',') if v)


def make_config(
  dataset: str,
  sampler: str,
  sigma: float | None,
  seed: int,
  epochs: int,
  batch_size: int = 0,
  mnist_data_dir: str = '',
):
  """The experiment's config: the dataset's default config with these fields changed.

  `sigma=None` is the non-private baseline through the same pipeline; `batch_size=0`
  keeps the config's b.
  """
  config = digits_mlp.get_config() if dataset == 'digits' else mnist_cnn.get_config()
  if dataset == 'mnist':
    config.data.data_dir = mnist_data_dir
  config.seed = seed
  config.sampler.name = sampler
  if batch_size:
    config.sampler.batch_size = batch_size
  # No truncation: resolve_max_batch_size clamps any larger request to the no-truncation cap.
  config.sampler.max_batch_size = config.sampler.physical_batch_size * LARGE
  config.num_epochs, config.num_steps = epochs, 0
  config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = LARGE
  if sigma is None:
    config.privacy.enabled = False
  else:
    config.privacy.noise_multiplier = float(sigma)
    config.privacy.target_epsilon = 0.0  # σ is given: no calibration, no budget check.
  return config


def run_one(
  dataset: str,
  sampler: str,
  sigma: float | None,
  seed: int,
  epochs: int,
  batch_size: int = 0,
  mnist_data_dir: str = '',
) -> dict[str, Any]:
  """One training run in a fresh temporary workdir; the record stored in results.json."""
  config = make_config(dataset, sampler, sigma, seed, epochs, batch_size, mnist_data_dir)
  start = time.time()
  log = io.StringIO()  # train_and_evaluate prints the whole config; keep it off the console.
  with tempfile.TemporaryDirectory(prefix='dpjax_exp02_') as workdir:
    try:
      with contextlib.redirect_stdout(log):
        result = train.train_and_evaluate(config, workdir)
      error = None
    except FloatingPointError as e:  # Diverged: recorded, not hidden.
      result, error = {}, str(e)
  report = result.get('privacy')
  num_examples = (
    report['details']['num_examples']
    if report is not None
    else len(data.make_sources(config.data, seed=config.seed)[0])
  )
  record = {
    'dataset': dataset,
    'sampler': sampler,
    'sigma': sigma,
    'seed': seed,
    'epochs': epochs,
    'batch_size': config.sampler.batch_size,
    # The divisor of the noisy sum: b, or N/T for balls-and-bins.
    'expected_batch_size': plan_lib.make_sampler(config, num_examples).expected_batch_size,
    'num_examples': num_examples,
    'private': sigma is not None,
    'steps': result.get('step'),
    'test_accuracy': result.get('eval_accuracy'),
    'test_loss': result.get('eval_loss'),
    'train_accuracy_last_epoch': result.get('nonprivate_train_accuracy'),
    'num_truncated': result.get('nonprivate_num_truncated'),
    'wall_time_s': time.time() - start,
    'error': error,
  }
  if report is not None:
    details = report['details']
    record.update(
      {
        'epsilon': report['epsilon'],
        'delta': report['delta'],
        'bound': report['bound'],  # 'upper' | 'high_probability_upper' | 'lower'
        'accountant': report['accountant'],
        'method': details.get('method'),
        'epsilon_lower': report['epsilon_lower'],  # A lower bound on the true ε (None: unknown).
        'lower_bound_method': _lower_bound_method(report),
        'max_test_lower_bound': details.get('max_test_lower_bound'),
        'random_allocation_lower': details.get('random_allocation_lower'),
        'max_batch_size': details.get('max_batch_size'),
        'truncation_mass': details.get('truncation_mass'),
        'as_if_poisson_epsilon_not_a_guarantee': details.get('as_if_poisson_not_a_guarantee'),
        'monte_carlo_epsilon_high_probability': details.get('monte_carlo_epsilon_high_probability'),
      }
    )
  return record


def _lower_bound_method(report: dict) -> str | None:
  """Which analysis gave the report's `epsilon_lower` (balls-and-bins takes the larger of two)."""
  details, lower = report['details'], report['epsilon_lower']
  if lower is None:
    return None
  if 'lower_bound_method' in details:
    return details['lower_bound_method']
  if (
    details.get('random_allocation_lower') is not None
    and lower == details['random_allocation_lower']
  ):
    return 'random-allocation PLD lower bound'
  return 'max test' if 'max_test_lower_bound' in details else 'unknown'


def _key(record: dict) -> tuple:
  return (
    record['dataset'],
    record['batch_size'],
    record['sampler'],
    record['sigma'],
    record['seed'],
    record['epochs'],
  )


def git_state() -> dict[str, Any]:
  """The commit the runs used, and whether the code and configs they import differed from it."""
  return provenance.git_state(paths=('dpjax', 'configs'))


def summarise(records: list[dict], dataset: str, batch_size: int) -> dict:
  """{sampler: {σ: (mean, std, n, ε, bound, ε_lower)}} over seeds (std with ddof = 1)."""
  table: dict[str, dict[float, tuple]] = {}
  for r in records:
    if (
      r['dataset'] != dataset
      or r['batch_size'] != batch_size
      or not r['private']
      or r['test_accuracy'] is None
    ):
      continue
    table.setdefault(r['sampler'], {}).setdefault(r['sigma'], []).append(r)
  out = {}
  for sampler, by_sigma in table.items():
    out[sampler] = {}
    for sigma, rs in sorted(by_sigma.items()):
      acc = np.array([r['test_accuracy'] for r in rs])
      out[sampler][sigma] = dict(
        mean=float(acc.mean()),
        std=float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
        n=len(acc),
        epsilon=rs[0]['epsilon'],
        bound=rs[0]['bound'],
        method=rs[0]['method'],
        epsilon_lower=rs[0]['epsilon_lower'],
      )
  return out


def baseline(records: list[dict], dataset: str, batch_size: int) -> tuple[float, float, int] | None:
  """Non-private test accuracy (mean, std, number of seeds), if those runs exist."""
  acc = [
    r['test_accuracy']
    for r in records
    if r['dataset'] == dataset
    and r['batch_size'] == batch_size
    and not r['private']
    and r['test_accuracy'] is not None
  ]
  if not acc:
    return None
  return float(np.mean(acc)), float(np.std(acc, ddof=1)) if len(acc) > 1 else 0.0, len(acc)


def paired_differences(records: list[dict], dataset: str, batch_size: int) -> str:
  """Balls-and-bins minus each other sampler, same seed (same init and noise stream), in points.

  Seeds share the model initialisation and the noise key, so per-seed differences remove
  most of the seed-to-seed spread that the mean ± std table shows.
  """
  acc = {
    (r['sampler'], r['sigma'], r['seed']): r['test_accuracy']
    for r in records
    if r['dataset'] == dataset
    and r['batch_size'] == batch_size
    and r['private']
    and r['test_accuracy'] is not None
  }
  others = [s for s in ('poisson', 'shuffle') if any(k[0] == s for k in acc)]
  sigmas = sorted({k[1] for k in acc if k[0] == 'balls_and_bins'})
  lines = [
    f'b = {batch_size}: balls-and-bins − other sampler, same seed, accuracy points '
    '(mean ± std over seeds; [min, max]):',
    '',
    '| σ | ' + ' | '.join(f'b&b − {s}' for s in others) + ' |',
    '|---|' + '---|' * len(others),
  ]
  for sigma in sigmas:
    cells = []
    for other in others:
      d = 100 * np.array(
        [
          acc[('balls_and_bins', sigma, seed)] - acc[(other, sigma, seed)]
          for (s, x, seed) in acc
          if s == 'balls_and_bins' and x == sigma and (other, sigma, seed) in acc
        ]
      )
      cells.append(
        f'{d.mean():+.1f} ± {d.std(ddof=1) if len(d) > 1 else 0:.1f} '
        f'[{d.min():+.1f}, {d.max():+.1f}]'
        if len(d)
        else '–'
      )
    lines.append(f'| {sigma:g} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def _fmt_eps(value) -> str:
  if value is None:
    return '–'
  return '∞' if not math.isfinite(value) else f'{value:.3g}'


def markdown_table(
  records: list[dict], dataset: str, batch_size: int, with_epsilon: bool = True
) -> str:
  """Accuracy (mean ± std over seeds, %) per sampler × σ, then ε per sampler × σ."""
  summary = summarise(records, dataset, batch_size)
  samplers = [s for s in SAMPLERS if s in summary]
  sigmas = sorted({s for by in summary.values() for s in by})
  n = {summary[s][sig]['n'] for s in samplers for sig in summary[s]}
  divisors = {
    s: next(
      r['expected_batch_size']
      for r in records
      if r['dataset'] == dataset
      and r['batch_size'] == batch_size
      and r['sampler'] == s
      and r['private']
    )
    for s in samplers
  }
  lines = [
    f'b = {batch_size} (noise divisor: '
    + ', '.join(f'{s} {d:g}' for s, d in divisors.items())
    + f'). Test accuracy (%), mean ± std over {"/".join(map(str, sorted(n)))} seeds:',
    '',
    '| σ | ' + ' | '.join(samplers) + ' |',
    '|---|' + '---|' * len(samplers),
  ]
  for sigma in sigmas:
    cells = []
    for s in samplers:
      c = summary[s].get(sigma)
      cells.append(f'{100 * c["mean"]:.1f} ± {100 * c["std"]:.1f}' if c else '–')
    lines.append(f'| {sigma:g} | ' + ' | '.join(cells) + ' |')
  base = baseline(records, dataset, batch_size)
  if base:
    lines.append(
      f'| non-private | {100 * base[0]:.1f} ± {100 * base[1]:.1f} (Poisson batches, '
      f'{base[2]} seeds) |' + ' |' * (len(samplers) - 1)
    )
  if not with_epsilon:
    return '\n'.join(lines)
  delta = next(r['delta'] for r in records if r['dataset'] == dataset and r['private'])
  lines += [
    '',
    f'ε at δ = {delta:g} after the run (the attached bound; [lower bound] where '
    'the accountant gives one):',
    '',
    '| σ | ' + ' | '.join(samplers) + ' |',
    '|---|' + '---|' * len(samplers),
  ]
  for sigma in sigmas:
    cells = []
    for s in samplers:
      c = summary[s].get(sigma)
      if not c:
        cells.append('–')
        continue
      text = f'{_fmt_eps(c["epsilon"])} ({c["bound"]})'
      if c['epsilon_lower'] is not None:
        text += f' [≥ {_fmt_eps(c["epsilon_lower"])}]'
      cells.append(text)
    lines.append(f'| {sigma:g} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


STYLE = {
  'poisson': ('tab:blue', 'o'),
  'balls_and_bins': ('tab:orange', 's'),
  'shuffle': ('tab:green', '^'),
}
LABELS = {'poisson': 'Poisson', 'balls_and_bins': 'balls-and-bins', 'shuffle': 'shuffle'}


def _method_label(sampler: str, methods: set[str]) -> str:
  """A short name for the accountant's method(s) behind a sampler's attached ε."""
  if sampler == 'shuffle':
    return 'deterministic-order bound'
  names = set()
  for m in methods:
    if m and m.startswith('random_allocation_pld'):
      names.add('random-allocation PLD')
    elif m and m.startswith('deterministic'):
      names.add('deterministic-order bound')
    elif m:
      names.add(m.replace('pld', 'PLD'))
  return ' / '.join(sorted(names))


def _sigma_axis(ax, sigmas) -> None:
  ax.set_xscale('log', base=2)
  ax.set_xticks(sigmas, [f'{x:g}' for x in sigmas])
  ax.minorticks_off()
  ax.set_xlabel('noise multiplier σ')
  ax.grid(alpha=0.3, which='both')


def _accuracy_panel(ax, records: list[dict], dataset: str, batch_size: int, title: str) -> None:
  """Test accuracy vs σ, mean ± std over seeds, one line per sampler."""
  summary = summarise(records, dataset, batch_size)
  offsets = {'poisson': 0.96, 'balls_and_bins': 1.0, 'shuffle': 1.04}  # Keep error bars apart.
  for s in [s for s in SAMPLERS if s in summary]:
    color, marker = STYLE[s]
    sigmas = sorted(summary[s])
    mean = np.array([summary[s][x]['mean'] for x in sigmas]) * 100
    std = np.array([summary[s][x]['std'] for x in sigmas]) * 100
    n = summary[s][sigmas[0]]['n']
    divisor = next(
      r['expected_batch_size']
      for r in records
      if r['dataset'] == dataset
      and r['batch_size'] == batch_size
      and r['sampler'] == s
      and r['private']
    )
    ax.errorbar(
      np.array(sigmas) * offsets[s],
      mean,
      yerr=std,
      color=color,
      marker=marker,
      capsize=3,
      label=f'{LABELS[s]} (÷{divisor:g}; mean ± std, {n} seeds)',
    )
  base = baseline(records, dataset, batch_size)
  if base:
    ax.axhline(100 * base[0], color='gray', ls=':', label=f'non-private ({base[2]} seeds)')
  _sigma_axis(ax, sorted({x for by in summary.values() for x in by}))
  ax.set_ylabel('test accuracy (%)')
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=7)


def plot(
  records: list[dict], dataset: str, path: pathlib.Path, epochs: int, batch_sizes: list[int]
) -> None:
  """Accuracy vs σ per batch size (the first is the config's), then ε vs σ at the first."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, len(batch_sizes) + 1, figsize=(6 * (len(batch_sizes) + 1), 4.8))
  for i, (ax, b) in enumerate(zip(axes, batch_sizes)):
    kind = 'config b' if i == 0 else 'control: b ≈ N/T, equal noise divisors'
    _accuracy_panel(
      ax,
      records,
      dataset,
      b,
      f'{dataset}: test accuracy after {epochs} epochs at equal σ\n{kind} = {b}',
    )
  ax_eps = axes[-1]
  summary = summarise(records, dataset, batch_sizes[0])
  samplers = [s for s in SAMPLERS if s in summary]
  for s in samplers:
    color, marker = STYLE[s]
    sigmas = sorted(summary[s])
    eps = [summary[s][x]['epsilon'] for x in sigmas]
    bounds = {summary[s][x]['bound'] for x in sigmas}
    methods = {summary[s][x]['method'] for x in sigmas}
    ax_eps.plot(
      sigmas,
      eps,
      color=color,
      marker=marker,
      ls='-',
      label=f'{LABELS[s]}: {"/".join(sorted(bounds))} bound ({_method_label(s, methods)})',
    )
    lower = [
      (x, summary[s][x]['epsilon_lower'])
      for x in sigmas
      if summary[s][x]['epsilon_lower'] is not None
    ]
    if lower:
      ax_eps.plot(
        *zip(*lower),
        color=color,
        marker=marker,
        ls='--',
        mfc='none',
        label=f'{LABELS[s]}: lower bound (true ε is at least this)',
      )
  delta = next(r['delta'] for r in records if r['dataset'] == dataset and r['private'])
  _sigma_axis(ax_eps, sorted({x for by in summary.values() for x in by}))
  ax_eps.set_yscale('log')
  ax_eps.set_ylabel(f'ε at δ = {delta:g}')
  ax_eps.set_title(
    f'{dataset}: ε after {epochs} epochs, b = {batch_sizes[0]}\n'
    '(solid: attached upper bound; dashed: lower bound)',
    fontsize=10,
  )
  ax_eps.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument(
    '--sigmas',
    type=_csv(float),
    default=None,
    help=f'comma-separated σ grid (default {DEFAULT_SIGMAS}, --full {FULL_SIGMAS})',
  )
  parser.add_argument(
    '--seeds',
    type=_csv(int),
    default=None,
    help=f'comma-separated seeds (default {DEFAULT_SEEDS}, --full {FULL_SEEDS})',
  )
  parser.add_argument('--samplers', type=_csv(str), default=SAMPLERS)
  parser.add_argument('--epochs', type=int, default=20, help='digits epochs (6 steps each)')
  parser.add_argument(
    '--control_batch_size',
    type=int,
    default=240,
    help='digits control series with this b (0: none); 240 ≈ N/6 equalises the noise divisors',
  )
  parser.add_argument(
    '--control_sigmas',
    type=_csv(float),
    default=None,
    help=f'σ of the control series (default {DEFAULT_CONTROL_SIGMAS}, --full: the whole grid)',
  )
  parser.add_argument('--full', action='store_true', help='more seeds and σ; MNIST if prepared')
  parser.add_argument(
    '--mnist_data_dir', default='', help='prepared TFDS data_dir holding mnist (used with --full)'
  )
  parser.add_argument('--mnist_epochs', type=int, default=5)
  parser.add_argument(
    '--no_baseline', action='store_true', help='skip the non-private reference runs (one per seed)'
  )
  parser.add_argument(
    '--resume',
    action='store_true',
    help='reuse runs already in results.json with the same settings',
  )
  parser.add_argument(
    '--plot_only',
    action='store_true',
    help='redraw the plots and print the tables from results.json',
  )
  parser.add_argument('--out', type=pathlib.Path, default=HERE)
  args = parser.parse_args()
  if args.plot_only:
    stored = json.loads((args.out / 'results.json').read_text())
    report(stored['runs'], stored['settings'], args.out)
    return
  sigmas = args.sigmas or (FULL_SIGMAS if args.full else DEFAULT_SIGMAS)
  seeds = args.seeds or (FULL_SEEDS if args.full else DEFAULT_SEEDS)
  for s in args.samplers:
    if s not in SAMPLERS:
      parser.error(f'--samplers: {s!r} is not one of {SAMPLERS}')
  if any(not (x > 0 and math.isfinite(x)) for x in sigmas):
    parser.error(f'--sigmas must be positive and finite, got {sigmas}')
  control_sigmas = args.control_sigmas or (sigmas if args.full else DEFAULT_CONTROL_SIGMAS)
  if any(not (x > 0 and math.isfinite(x)) for x in control_sigmas):
    parser.error(f'--control_sigmas must be positive and finite, got {control_sigmas}')
  if args.epochs < 1 or args.mnist_epochs < 1:
    parser.error('--epochs and --mnist_epochs must be >= 1')
  if args.control_batch_size < 0:
    parser.error('--control_batch_size must be >= 0 (0: no control series)')
  datasets = [('digits', args.epochs)]
  if args.full and args.mnist_data_dir:
    datasets.append(('mnist', args.mnist_epochs))
  elif args.full:
    print(
      'MNIST skipped: pass --mnist_data_dir with a prepared TFDS data_dir '
      '(see configs/mnist_cnn.py).',
      flush=True,
    )
  elif args.mnist_data_dir:
    print('MNIST runs only with --full; --mnist_data_dir ignored.', flush=True)

  logging.set_verbosity(logging.ERROR)
  # Every run compiles the same ~25 small programs; a persistent cache turns the compile time
  # (most of a short run's wall time) into a lookup. A cached executable is the same program.
  jax.config.update(
    'jax_compilation_cache_dir',
    os.environ.get(
      'JAX_COMPILATION_CACHE_DIR', os.path.join(tempfile.gettempdir(), 'dpjax-exp02-xla-cache')
    ),
  )
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  args.out.mkdir(parents=True, exist_ok=True)
  results_path = args.out / 'results.json'
  # Batch sizes per dataset: the config's b, then the control (digits only).
  batch_sizes = {d: [make_config(d, 'poisson', None, 0, 1).sampler.batch_size] for d, _ in datasets}
  if args.control_batch_size and args.control_batch_size != batch_sizes['digits'][0]:
    batch_sizes['digits'].append(args.control_batch_size)
  settings = {
    'sigmas': list(sigmas),
    'seeds': list(seeds),
    'samplers': list(args.samplers),
    'batch_sizes': batch_sizes,
    'control_sigmas': list(control_sigmas),
    'epochs': args.epochs,
    'mnist_epochs': args.mnist_epochs,
    'datasets': [d for d, _ in datasets],
    'full': args.full,
    'baseline': not args.no_baseline,
    'config': 'configs/digits_mlp.py (digits), configs/mnist_cnn.py (mnist); '
    'changed: sampler.name, seed, privacy.noise_multiplier, '
    'privacy.target_epsilon = 0, num_epochs, sampler.max_batch_size = '
    'no-truncation cap, log/eval/checkpoint at the last step only; '
    'sampler.batch_size in the control series',
  }
  previous = {}
  if args.resume and results_path.exists():
    previous = {
      _key(r): r for r in json.loads(results_path.read_text())['runs'] if r.get('error') is None
    }

  plan = []  # (dataset, b, sampler, σ, seed, epochs), the key of a run.
  for dataset, epochs in datasets:
    for j, b in enumerate(batch_sizes[dataset]):
      for seed in seeds:
        if j == 0 and not args.no_baseline:
          plan.append((dataset, b, 'poisson', None, seed, epochs))
        for sigma in sigmas if j == 0 else control_sigmas:
          for sampler in args.samplers:
            plan.append((dataset, b, sampler, sigma, seed, epochs))
  git_at_start = git_state()
  records, start = [], time.time()
  for i, key in enumerate(plan):
    if key in previous:
      records.append(previous[key])
      continue
    dataset, b, sampler, sigma, seed, epochs = key
    git = git_state()  # Per run: other engineers commit while a sweep runs.
    r = run_one(dataset, sampler, sigma, seed, epochs, b, args.mnist_data_dir)
    r['git'] = git
    records.append(r)
    eps = f'ε = {_fmt_eps(r.get("epsilon"))} ({r.get("bound")})' if r['private'] else 'non-private'
    acc = 'diverged' if r['test_accuracy'] is None else f'acc {r["test_accuracy"]:.4f}'
    print(
      f'[{i + 1}/{len(plan)}] {dataset} b={b} {sampler:>14} σ={sigma} seed={seed}: {acc}, {eps}, '
      f'{r["wall_time_s"]:.1f} s (total {time.time() - start:.0f} s)',
      flush=True,
    )
    results_path.write_text(
      json.dumps(  # After every run: an interrupted sweep keeps its runs.
        {'settings': settings, 'git_at_start': git_at_start, 'runs': records}, indent=1
      )
    )
  results_path.write_text(
    json.dumps(
      {
        'settings': settings,
        'git_at_start': git_at_start,
        'machine': provenance.machine(),
        'wall_time_s_this_invocation': time.time() - start,
        'sum_of_run_wall_times_s': sum(r['wall_time_s'] for r in records),
        'runs': records,
      },
      indent=1,
    )
  )
  report(records, settings, args.out)
  print(f'Wrote {results_path}.')


def report(records: list[dict], settings: dict, out: pathlib.Path) -> None:
  """The plot of each dataset and the Markdown tables of README.md."""
  for dataset in settings['datasets']:
    if not any(r['dataset'] == dataset and r['private'] for r in records):
      continue
    epochs = settings['epochs'] if dataset == 'digits' else settings['mnist_epochs']
    name = 'sampler_utility.png' if dataset == 'digits' else f'sampler_utility_{dataset}.png'
    sizes = settings['batch_sizes'][dataset]
    plot(records, dataset, out / name, epochs, sizes)
    print(f'\n## {dataset}\n')
    for j, b in enumerate(sizes):
      print(markdown_table(records, dataset, b, with_epsilon=j == 0) + '\n')
      print(paired_differences(records, dataset, b) + '\n')
    print(f'Wrote {out / name}.')


if __name__ == '__main__':
  main()
