"""The PLD grid that follows ε (issue 34, item 9): ε and CPU seconds before and after, as JSON.

  python scripts/bench_accounting_grid.py   # writes scripts/results/accounting_grid.json (~1-2 min)

For each case: ε on da06065's fixed grid (1e-4; 1e-3 for mixtures of more than two Gaussians,
as da06065 chose them; `Accountant(value_discretization_interval=...)` reproduces it), ε on
the grid that follows ε (the default now: `pld_grid`), and dp_accounting's own pessimistic ε at
a finer grid (an upper bound) called directly as the reference; CPU seconds
(time.process_time, robust to the load of a shared machine) of each accountant call, from a
fresh process cache. Then σ calibrations, old rule vs new, and the random-allocation grid
(ε_Poisson/12 from a fixed-grid estimate, kept) beside the one the tight Poisson ε would give.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import calibration
from dpjax.privacy.accounting import random_allocation
from dpjax.privacy.accounting import step_pld
from dpjax_bench import provenance

# (label, sampler, N, b, σ, T, δ, group size, reference grid)
CASES = [
  (
    'issue 34: N = 12.8M, b = 1024, T = 12,500',
    'poisson',
    12_800_000,
    1024,
    2.0,
    12_500,
    1e-8,
    1,
    5e-7,
  ),
  ('large N, small ε', 'poisson', 1_000_000, 100, 2.0, 5000, 1e-7, 1, 5e-7),
  ('large N, small ε, long run', 'poisson', 1_000_000, 100, 3.0, 20_000, 1e-7, 1, 5e-7),
  ('moderate', 'poisson', 10_000, 100, 1.0, 1000, 1e-5, 1, 2e-4),
  ('large ε', 'poisson', 10_000, 100, 0.6, 5000, 1e-5, 1, 4e-4),
  ('fixed size (MoG [0, 2])', 'fixed_size', 10_000, 100, 1.0, 1000, 1e-5, 1, 4e-4),
  (
    'with replacement (MoG, 5 components)',
    'fixed_size_with_replacement',
    1000,
    4,
    4.3,
    250,
    1e-5,
    1,
    None,
  ),
  ('group k = 2 (MoG [0, 1, 2])', 'poisson', 10_000, 100, 3.3, 500, 1e-5, 2, None),
]


def _fresh_process_cache():
  step_pld.BUILT_STEPS = step_pld.KeptPLDs(16)
  step_pld.COMPOSED = step_pld.KeptPLDs(16)


def _cpu(fn):
  _fresh_process_cache()
  start = time.process_time()
  value = fn()
  return value, time.process_time() - start


def _reference(name, n, b, sigma, steps, delta, grid):
  """dp_accounting's pessimistic ε at `grid`, directly (fixed size: the Poisson-subsampled
  Gaussian of sensitivity 2, the same pair as the MoG [0, 2])."""
  pld = pld_lib.from_gaussian_mechanism(
    standard_deviation=sigma,
    sensitivity=2.0 if name == 'fixed_size' else 1.0,
    sampling_prob=b / n,
    value_discretization_interval=grid,
  )
  return float(pld.self_compose(steps).get_epsilon_for_delta(delta))


def bench_case(label, name, n, b, sigma, steps, delta, k, fine) -> dict:
  sampler = samplers.sampler_class(name)(num_examples=n, batch_size=b)
  many = name == 'fixed_size_with_replacement' or k > 1
  old_grid = 1e-3 if many else 1e-4
  old, old_seconds = _cpu(
    lambda: accountant_lib.Accountant(
      sampler,
      sigma,
      delta,
      group_size=k,
      value_discretization_interval=old_grid,
      max_batch_size=None,
    ).epsilon(steps)
  )
  new, new_seconds = _cpu(
    lambda: accountant_lib.Accountant(
      sampler, sigma, delta, group_size=k, max_batch_size=None
    ).epsilon_at(steps, estimates=False)
  )
  row = dict(
    case=label,
    sampler=name,
    num_examples=n,
    batch_size=b,
    noise_multiplier=sigma,
    steps=steps,
    delta=delta,
    group_size=k,
    old_grid=old_grid,
    old_epsilon=old,
    old_cpu_seconds=old_seconds,
    new_epsilon=new.epsilon,
    new_grid=new.details['pld_grid'],
    new_grid_converged=new.details['pld_grid_converged'],
    new_grids_tried=new.details['pld_grids_tried'],
    new_cpu_seconds=new_seconds,
  )
  if fine is not None:
    row['reference_grid'] = fine
    row['reference_epsilon'] = _reference(name, n, b, sigma, steps, delta, fine)
    row['old_over_reference'] = old / row['reference_epsilon']
    row['new_over_reference'] = new.epsilon / row['reference_epsilon']
  print(row, file=sys.stderr, flush=True)
  return row


def bench_calibration() -> list[dict]:
  rows = []
  for name, n, b, target, steps, delta, k in [
    ('poisson', 60_000, 256, 3.0, 20_000, 1e-5, 1),
    ('poisson', 1_000_000, 100, 0.006, 1000, 1e-7, 1),
    ('fixed_size', 10_000, 100, 2.0, 1000, 1e-5, 1),
    ('poisson', 10_000, 100, 0.5, 500, 1e-5, 2),
  ]:
    sampler = samplers.sampler_class(name)(num_examples=n, batch_size=b)
    old_grid = 1e-3 if k > 1 else 1e-4
    old, old_seconds = _cpu(
      lambda: calibration.calibrate_noise_multiplier(
        sampler,
        target,
        delta,
        steps,
        group_size=k,
        value_discretization_interval=old_grid,
        max_batch_size=None,
      )
    )
    new, new_seconds = _cpu(
      lambda: calibration.calibrate_noise_multiplier(
        sampler, target, delta, steps, group_size=k, max_batch_size=None
      )
    )
    rows.append(
      dict(
        sampler=name,
        num_examples=n,
        batch_size=b,
        target_epsilon=target,
        steps=steps,
        delta=delta,
        group_size=k,
        old_sigma=old,
        old_cpu_seconds=old_seconds,
        new_sigma=new,
        new_cpu_seconds=new_seconds,
      )
    )
    print(rows[-1], file=sys.stderr, flush=True)
  return rows


def _two_digits(grid: float) -> float:
  """da06065's rounding of the grid down to two significant digits."""
  digits = 10.0 ** (math.floor(math.log10(grid)) - 1)
  return math.floor(grid / digits) * digits


def bench_random_allocation_grid() -> list[dict]:
  """The random-allocation grid (ε_Poisson/12, `random_allocation.default_discretization`)
  from its fixed-grid Poisson estimate, and what the tight Poisson ε would ask for."""
  rows = []
  for sigma, steps in [(1.0, 100), (1.0, 1000), (0.8, 10_000), (2.0, 10_000)]:
    sampler = samplers.PoissonSampler(num_examples=100 * steps, batch_size=100)
    tight = accountant_lib.Accountant(
      sampler, sigma, 1e-5, allow_large_delta=True, max_batch_size=None
    ).epsilon(steps)
    rows.append(
      dict(
        noise_multiplier=sigma,
        steps=steps,
        delta=1e-5,
        tight_poisson_epsilon=tight,
        grid=random_allocation.default_discretization(sigma, steps, 1e-5),
        grid_from_tight_epsilon=_two_digits(max(1e-4, min(0.02, tight / 12))),
      )
    )
    print(rows[-1], file=sys.stderr, flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument(
    '--out', default=os.path.join(os.path.dirname(__file__), 'results', 'accounting_grid.json')
  )
  args = parser.parse_args()
  record = dict(
    question=__doc__.split('\n\n')[0],
    machine=dict(
      provenance.machine(), time=time.strftime('%Y-%m-%d %H:%M:%S'), git=provenance.git_state()
    ),
  )
  record['cases'] = [bench_case(*case) for case in CASES]
  record['calibration'] = bench_calibration()
  record['random_allocation_grid'] = bench_random_allocation_grid()
  record['machine']['load_average_after'] = provenance.load_average()
  provenance.write_json(args.out, record)
  print(args.out)


if __name__ == '__main__':
  main()
