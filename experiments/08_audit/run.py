"""Experiment 8: claimed ε vs audited ε lower bound, and planted bugs caught by the audit.

  .venv/bin/python experiments/08_audit/run.py              # ~5 min on a shared 2-core box
  .venv/bin/python experiments/08_audit/run.py --plot-only  # redraw from results.json

Setting: digits MLP (one hidden layer of 32), 1437 training digits + m = 500 gradient
canaries (N = 1937), b = 256, 48 steps (Poisson q = b/N; balls-and-bins T = 8 steps per
epoch, 6 epochs), C = 1, SGD η = 1, δ = 1e-5, audit confidence 0.95, white-box confidence
0.999. Runs use `dpjax.privacy.auditing.audited_sgd.train` (samplers, batching, clipping of dpjax,
canaries through the sampler as N + m data rows). For every run: the claimed ε (dpjax's
accountant for the sampler that ran, N + m examples), the one-run lower bound (Steinke et al.
2023) from white-box scores, and the white-box effective-σ test.

* correct code: σ ∈ {0.5, 0.7, 1, 2, 4}, both samplers, 3 seeds each;
* planted bugs (test-only `_bug` argument): noise σ/10, clipping skipped, every example counted
  twice, noise skipped on every 4th step, at σ = 1 and σ = 2, both samplers;
* the non-private baseline (no clipping, no noise) and the largest bound m canaries allow.

Writes results.json and audit.png next to this file.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import platform
import subprocess
import time

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from dpjax.trainer.commands import cli
from dpjax.trainer.planning import plan as plan_lib
from dpjax.privacy import accounting
from dpjax.data import sources as data
from dpjax.models import factory as models
from dpjax.privacy.auditing import audited_sgd
from dpjax.privacy.auditing import one_run
from dpjax.privacy.auditing import white_box

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
M, STEPS, DELTA, CONFIDENCE = 500, 48, 1e-5, 0.95
SIGMAS = (0.5, 0.7, 1.0, 2.0, 4.0)
BUG_SIGMAS = (1.0, 2.0)
SEEDS = (0, 1, 2)
SAMPLERS = ('poisson', 'balls_and_bins')
CANARY_COUNTS = (100, 300, 1000, 3000, 10_000, 30_000, 100_000)


def base_config():
  c = cli.load_config_file(str(ROOT / 'configs' / 'digits_mlp.py'))
  c.model.hidden_sizes = (32,)
  c.num_epochs, c.num_steps = 0, STEPS
  c.privacy.target_epsilon, c.privacy.delta = 0.0, DELTA
  return c


def one(config, model, train, *, private=True, bug=None) -> dict:
  start = time.time()
  run = audited_sgd.train(
    plan_lib.audit_settings(config), model, train, num_canaries=M, private=private, _bug=bug
  )
  audit = one_run.audit(run.scores(), run.canaries.membership, delta=DELTA, confidence=CONFIDENCE)
  row = {
    'sampler': config.sampler.name,
    'sigma': run.noise_multiplier,
    'seed': config.seed,
    'bug': bug,
    'private': private,
    'audit': audit.to_dict(),
    'epsilon_lower': audit.epsilon_lower,
  }
  if private:
    report = accounting.make_accountant(config, run.num_examples).epsilon_at(STEPS)
    test = white_box.effective_sigma(
      run.released,
      run.ordinary,
      run.counts,
      run.canaries.membership,
      clip_norm=run.clip_norm,
      noise_multiplier=run.noise_multiplier,
    )
    row.update(
      epsilon=report.epsilon,
      bound=report.bound,
      accountant=report.accountant,
      white_box=test.to_dict(),
      refuted=audit.epsilon_lower > report.epsilon,
      flagged=audit.epsilon_lower > report.epsilon or test.flagged,
    )
  row['seconds'] = time.time() - start
  print(
    {k: row[k] for k in ('sampler', 'sigma', 'seed', 'bug', 'epsilon_lower')},
    {k: row.get(k) for k in ('epsilon', 'flagged')},
    row.get('white_box', {}).get('effective'),
    f'{row["seconds"]:.1f}s',
    flush=True,
  )
  return row


def compute() -> dict:
  logging.getLogger('absl').setLevel(logging.ERROR)
  config = base_config()
  train, _ = data.make_sources(config.data)
  model = models.make_model(config.model, train.num_classes, train.input_shape)
  rows = []
  for name in SAMPLERS:
    config.sampler.name = name
    for sigma in SIGMAS:
      for seed in SEEDS:
        config.seed, config.privacy.noise_multiplier = seed, sigma
        rows.append(one(config, model, train))
    config.seed = 0
    for sigma in BUG_SIGMAS:
      for bug in audited_sgd.PLANTED_BUGS:
        config.privacy.noise_multiplier = sigma
        rows.append(one(config, model, train, bug=bug))
    rows.append(one(config, model, train, private=False))
  limits = [
    {
      'num_canaries': m,
      'max_epsilon_lower': one_run.max_epsilon_lower(m, delta=DELTA, confidence=CONFIDENCE),
    }
    for m in CANARY_COUNTS
  ]
  commit = subprocess.run(
    ['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True
  ).stdout.strip()
  return {
    'settings': {
      'num_canaries': M,
      'num_base_examples': len(train),
      'num_examples': len(train) + M,
      'batch_size': config.sampler.batch_size,
      'steps': STEPS,
      'delta': DELTA,
      'confidence': CONFIDENCE,
      'white_box_confidence': white_box.DEFAULT_CONFIDENCE,
      'clip_norm': 1.0,
      'learning_rate': config.optimizer.learning_rate,
      'model': 'MLP hidden (32,)',
      'guess_fractions': one_run.DEFAULT_GUESS_FRACTIONS,
    },
    'runs': rows,
    'limits': limits,
    'git': commit,
    'machine': platform.platform(),
  }


def plot(results: dict) -> None:
  runs = results['runs']
  fig, axes = plt.subplots(1, 2, figsize=(13, 5))
  ax = axes[0]
  colors = {'poisson': 'tab:blue', 'balls_and_bins': 'tab:orange'}
  settings = results['settings']
  top = one_run.max_epsilon_lower(
    settings['num_canaries'], delta=settings['delta'], confidence=settings['confidence']
  )
  for name in SAMPLERS:
    ok = [r for r in runs if r['sampler'] == name and r['private'] and r['bug'] is None]
    sig = sorted({r['sigma'] for r in ok})
    claim = [next(r['epsilon'] for r in ok if r['sigma'] == s) for s in sig]
    ax.plot(sig, claim, '-', color=colors[name], label=f'{name}: claimed ε (upper bound)')
    ax.plot(
      [r['sigma'] for r in ok],
      [r['epsilon_lower'] for r in ok],
      'o',
      mfc='none',
      color=colors[name],
      label=f'{name}: audit lower bound (3 seeds)',
    )
  ax.axhline(
    top, color='grey', ls=':', label=f'largest bound with m = {results["settings"]["num_canaries"]}'
  )
  ax.set_xscale('log')
  ax.set_yscale('log')
  ax.set_xlabel('noise multiplier σ')
  ax.set_ylabel('ε')
  ax.set_title('Correct code: claimed ε vs one-run audit (95%)')
  ax.legend(fontsize=8)
  ax = axes[1]
  bugs = [r for r in runs if r['bug'] is not None]
  labels = [
    f'{r["bug"]}\n{"P" if r["sampler"] == "poisson" else "BB"} σ={r["sigma"]:g}' for r in bugs
  ]
  x = range(len(bugs))
  ax.bar([i - 0.2 for i in x], [r['epsilon'] for r in bugs], 0.4, label='claimed ε')
  ax.bar([i + 0.2 for i in x], [r['epsilon_lower'] for r in bugs], 0.4, label='audit lower bound')
  for i, r in zip(x, bugs):
    w = r['white_box']
    ax.text(
      i,
      max(r['epsilon'], r['epsilon_lower']) + 0.15,
      f'σ_eff/σ = {w["effective"] / r["sigma"]:.2f}, {"flagged" if r["flagged"] else "MISSED"}',
      ha='center',
      va='bottom',
      rotation=90,
      fontsize=6,
    )
  ax.set_ylim(0, 1.6 * max(max(r['epsilon'], r['epsilon_lower']) for r in bugs))
  ax.set_xticks(list(x))
  ax.set_xticklabels(labels, rotation=90, fontsize=6)
  ax.set_ylabel('ε')
  ax.set_title('Planted bugs (P = Poisson, BB = balls-and-bins)')
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(HERE / 'audit.png', dpi=130)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--plot-only', action='store_true')
  args = parser.parse_args()
  path = HERE / 'results.json'
  if args.plot_only:
    results = json.loads(path.read_text())
  else:
    start = time.time()
    results = compute()
    results['seconds'] = time.time() - start
    path.write_text(json.dumps(results, indent=1))
  plot(results)


if __name__ == '__main__':
  main()
