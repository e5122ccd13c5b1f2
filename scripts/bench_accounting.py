"""Accounting benchmark: the timings of issue 4 and the reference numbers, as JSON.

  python scripts/bench_accounting.py          # writes scripts/results/bench_accounting.json
  python scripts/bench_accounting.py --quick  # smaller sweeps, shorter timeouts
  python scripts/bench_accounting.py --only monte_carlo,epoch_pld  # update some sections

Measures (docs/accounting.md; targets from issue 4):
  * Poisson PLD ε for 1e5 steps (target < 2 s) and σ calibration (target < 10 s);
  * balls-and-bins Monte-Carlo UCB, T = 1e4, one epoch, 1e5 samples, order statistics
    (target < 60 s), and how its time grows with T and with the number of samples;
  * random-allocation PLD (pld-accounting) for T = 1e2, 1e3, 1e4, each in a subprocess with a
    timeout (it grows steeply with T), which sets the default policy in
    dpjax/privacy/accounting/balls_and_bins.py, and the one-epoch dominating PLD composed E times
    (the E > 1 policy);
  * reference values: truncated Poisson (4.20 / 4.20 / 5.60 / 14.2), FS-RDP (0.454 / 0.659 /
    1.083), the MoG PLD in the same setting.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

from dpjax_bench import provenance
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import calibration
from dpjax.privacy.accounting import fixed_size_rdp
from dpjax.privacy.accounting import monte_carlo

DELTA = 1e-5


def _timed(fn):
  start = time.perf_counter()
  value = fn()
  return value, time.perf_counter() - start


def _log(*args):
  print(*args, file=sys.stderr, flush=True)


def bench_poisson(results):
  sampler = samplers.sampler_class('poisson')(num_examples=60_000, batch_size=256)
  eps, seconds = _timed(
    lambda: accountant_lib.Accountant(sampler, 1.0, DELTA, max_batch_size=None).epsilon(100_000)
  )
  results['poisson_pld_1e5_steps'] = dict(
    num_examples=60_000,
    batch_size=256,
    noise_multiplier=1.0,
    steps=100_000,
    epsilon=eps,
    seconds=seconds,
    target_seconds=2.0,
  )
  _log('poisson pld 1e5 steps', eps, seconds)
  sigma, seconds = _timed(
    lambda: calibration.calibrate_noise_multiplier(sampler, 3.0, DELTA, 20_000, max_batch_size=None)
  )
  eps = accountant_lib.Accountant(sampler, sigma, DELTA, max_batch_size=None).epsilon(20_000)
  results['poisson_calibration'] = dict(
    num_examples=60_000,
    batch_size=256,
    steps=20_000,
    target_epsilon=3.0,
    noise_multiplier=sigma,
    epsilon=eps,
    seconds=seconds,
    target_seconds=10.0,
  )
  _log('poisson calibration', sigma, eps, seconds)


def bench_truncation(results):
  sampler = samplers.sampler_class('poisson')(num_examples=10_000, batch_size=100)
  rows = []
  for cap, reference in ((None, 4.20), (150, 4.20), (130, 5.60), (110, 14.2)):
    report, seconds = _timed(
      lambda: accountant_lib.Accountant(sampler, 1.0, DELTA, max_batch_size=cap).epsilon_at(
        5000, estimates=False
      )
    )
    rows.append(
      dict(
        max_batch_size=cap,
        epsilon=report.epsilon,
        reference=reference,
        method=report.details['method'],
        seconds=seconds,
      )
    )
    _log('truncated poisson', cap, report.epsilon, seconds)
  results['poisson_truncation_reference'] = dict(
    num_examples=10_000, sampling_probability=0.01, noise_multiplier=1.0, steps=5000, rows=rows
  )


def bench_fixed_size(results):
  sampler = samplers.sampler_class('fixed_size')(num_examples=50_000, batch_size=120)
  rows = []
  for epochs, reference in ((50, 0.454), (100, 0.659), (250, 1.083)):
    steps = 416 * epochs
    (fs, _), fs_seconds = _timed(
      lambda: fixed_size_rdp.fixed_size_rdp_epsilon(120 / 50_000, 6.0, steps, DELTA)
    )
    pld, pld_seconds = _timed(lambda: accountant_lib.Accountant(sampler, 6.0, DELTA).epsilon(steps))
    rows.append(
      dict(
        epochs=epochs,
        fs_rdp=fs,
        fs_rdp_reference=reference,
        mog_pld=pld,
        fs_rdp_seconds=fs_seconds,
        mog_pld_seconds=pld_seconds,
      )
    )
    _log('fixed size', epochs, fs, pld)
  results['fixed_size_reference'] = dict(
    num_examples=50_000, batch_size=120, noise_multiplier=6.0, steps_per_epoch=416, rows=rows
  )


def bench_monte_carlo(results, quick):
  rows = []
  steps_sweep = (1000, 10_000) if quick else (1000, 10_000, 100_000)
  samples_sweep = (100_000, 200_000) if quick else (100_000, 200_000, 400_000)
  cases = [(t, 100_000) for t in steps_sweep] + [(10_000, m) for m in samples_sweep if m != 100_000]
  # δ = 1e-4: a Chernoff UCB of a [0, 1] mean from m samples cannot go below
  # log(2/β)/m ≈ 7.6/m, so δ = 1e-5 needs m > 7.6e5 whenever importance sampling cannot shrink
  # the event (large T). The cost per sample does not depend on δ.
  delta = 1e-4
  for num_steps, num_samples in cases:
    sigma = 0.7
    result, seconds = _timed(
      lambda: monte_carlo.balls_and_bins_epsilon(
        sigma,
        num_steps,
        delta,
        num_samples=num_samples,
        method='importance_order_statistics',
        seed=0,
      )
    )
    det = balls_and_bins.deterministic_epsilon(sigma, 1, delta)
    rows.append(
      dict(
        num_steps=num_steps,
        num_samples=num_samples,
        noise_multiplier=sigma,
        epsilon_ucb=result.epsilon,
        deterministic_epsilon=det,
        method=result.method,
        epsilon_point=result.epsilon_point,
        confidence=result.confidence,
        seconds=seconds,
      )
    )
    _log('monte carlo', num_steps, num_samples, result.epsilon, seconds)
  results['balls_and_bins_monte_carlo'] = dict(
    method='importance_order_statistics',
    num_epochs=1,
    delta=delta,
    target_seconds=60.0,
    target_case=dict(num_steps=10_000, num_samples=100_000),
    rows=rows,
  )


def bench_random_allocation(results, timeout, quick):
  rows = []
  cases = [(100, 1, 1.0), (100, 1, 2.0), (100, 4, 1.0), (1000, 1, 1.0), (10_000, 1, 1.0)]
  if quick:
    cases = [(100, 1, 1.0), (1000, 1, 1.0)]
  with tempfile.TemporaryDirectory() as cache:  # Time the computation, not the cache.
    os.environ['DPJAX_CACHE_DIR'] = cache
    for num_steps, epochs, sigma in cases:
      value, seconds = _timed(
        lambda: balls_and_bins.random_allocation_epsilon_range(
          sigma, num_steps, DELTA, num_epochs=epochs, timeout=timeout
        )
      )
      det = balls_and_bins.deterministic_epsilon(sigma, epochs, DELTA)
      row = dict(
        num_steps=num_steps,
        num_epochs=epochs,
        noise_multiplier=sigma,
        seconds=seconds,
        timed_out=value is None,
        timeout=timeout,
        deterministic_epsilon=det,
      )
      if value is not None:
        row.update(upper=value[0], lower=value[1])
      rows.append(row)
      _log('random allocation', num_steps, epochs, sigma, value, seconds)
  results['random_allocation_pld'] = dict(delta=DELTA, rows=rows)


def bench_epoch_pld(results, timeout):
  """E > 1 policy: one dominating one-epoch PLD per (σ, T), composed E times."""
  with tempfile.TemporaryDirectory() as cache:
    os.environ['DPJAX_CACHE_DIR'] = cache
    epoch_rows = []
    for num_steps, sigma in ((6, 1.0), (10, 1.0), (100, 1.0), (100, 2.0)):
      pld, seconds = _timed(
        lambda: balls_and_bins.random_allocation_epoch_pld(sigma, num_steps, timeout=timeout)
      )
      row = dict(
        num_steps=num_steps, noise_multiplier=sigma, build_seconds=seconds, timed_out=pld is None
      )
      if pld is not None:
        for epochs in (1, 10, 40):
          eps, seconds = _timed(
            lambda: float(pld.self_compose(epochs).get_epsilon_for_delta(DELTA))
          )
          row[f'epsilon_{epochs}_epochs'] = eps
          row[f'compose_seconds_{epochs}_epochs'] = seconds
          row[f'deterministic_epsilon_{epochs}_epochs'] = balls_and_bins.deterministic_epsilon(
            sigma, epochs, DELTA
          )
      epoch_rows.append(row)
      _log('one-epoch pld', num_steps, sigma, row)
  results['random_allocation_epoch_pld_composed'] = dict(
    delta=DELTA,
    discretization=balls_and_bins.EPOCH_PLD_DISCRETIZATION,
    tail_truncation=balls_and_bins.EPOCH_PLD_TAIL_TRUNCATION,
    rows=epoch_rows,
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument(
    '--out', default=os.path.join(os.path.dirname(__file__), 'results', 'bench_accounting.json')
  )
  parser.add_argument('--quick', action='store_true')
  parser.add_argument(
    '--ra-timeout',
    type=float,
    default=900.0,
    help='seconds allowed to each random-allocation PLD run',
  )
  parser.add_argument('--only', default='', help='comma-separated subset of sections')
  args = parser.parse_args()
  sections = {
    'poisson': lambda r: bench_poisson(r),
    'truncation': lambda r: bench_truncation(r),
    'fixed_size': lambda r: bench_fixed_size(r),
    'monte_carlo': lambda r: bench_monte_carlo(r, args.quick),
    'epoch_pld': lambda r: bench_epoch_pld(r, 300.0),
    'random_allocation': lambda r: bench_random_allocation(
      r, 60.0 if args.quick else args.ra_timeout, args.quick
    ),
  }
  chosen = [s for s in args.only.split(',') if s] or list(sections)
  results = {}
  if os.path.exists(args.out) and args.only:
    with open(args.out) as f:
      results = json.load(f)  # Update the chosen sections only.
  results['machine'] = dict(
    provenance.machine(), time=time.strftime('%Y-%m-%d %H:%M:%S'), git=provenance.git_state()
  )
  # The default policy chosen from these measurements (dpjax/privacy/accounting/balls_and_bins.py).
  results.get('random_allocation_pld', {}).pop('policy', None)
  results['random_allocation_policy'] = dict(
    attempt='every T and E',
    timeout_seconds=balls_and_bins.RANDOM_ALLOCATION_TIMEOUT,
    any_epochs='one-epoch dominating PLD (grid ε_Poisson/12, '
    'random_allocation.default_discretization) composed E times',
    otherwise='deterministic bound (labelled fallback)',
  )
  for name in chosen:
    sections[name](results)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
      json.dump(results, f, indent=1, default=lambda x: None if x is None else float(x))
  print(json.dumps(results, indent=1))


if __name__ == '__main__':
  main()
