"""Golden accounting numbers: does a refactor of dpjax.privacy.accounting change any ε, σ or bound?

Records, bit for bit (repr of every float), ε reports for every sampler x accountant
(x group size 2 where supported), calibrated σ, max_num_steps and the max-test lower
bounds on small settings, from the code as it is. `--check` recomputes them and exits 1
on any difference, printing it.

  python scripts/accounting_golden.py            # writes scripts/results/accounting_golden.json
  python scripts/accounting_golden.py --check    # compares (about a minute on 2 cores)
  python scripts/accounting_golden.py --check --rtol 1e-8   # floats to a relative tolerance

Bit for bit holds on one machine only: another CPU's FFTs move PLD ε by ~1e-11 relative
(seen between the recording machine and an AMD EPYC one), so compare across machines
with --rtol, or record on the machine that checks (at the commit to compare against).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpjax.privacy import accounting  # pylint: disable=wrong-import-position
from dpjax.privacy import samplers  # pylint: disable=wrong-import-position
from dpjax.privacy.accounting import calibration  # pylint: disable=wrong-import-position
from dpjax.privacy.accounting import max_test  # pylint: disable=wrong-import-position

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'accounting_golden.json')
N, BATCH, SIGMA, DELTA, STEPS = 1000, 50, 1.2, 1e-5, 40


def _plain(value):
  if isinstance(value, float):
    return repr(value)
  if isinstance(value, dict):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def _relative_difference(a, b) -> float:
  """0 if equal; the largest relative difference of the floats (repr strings) in a and b;
  inf where they differ otherwise (keys, strings, None)."""
  if a == b:
    return 0.0
  if isinstance(a, dict) and isinstance(b, dict):
    if set(a) != set(b):
      return float('inf')
    return max(_relative_difference(a[k], b[k]) for k in a)
  if isinstance(a, list) and isinstance(b, list):
    if len(a) != len(b):
      return float('inf')
    return max(_relative_difference(x, y) for x, y in zip(a, b))
  try:
    x, y = float(a), float(b)
  except (TypeError, ValueError):
    return float('inf')
  return abs(x - y) / max(abs(x), abs(y))


def compute() -> dict:
  out = {}
  for name in samplers.SAMPLER_NAMES:
    cls = samplers.sampler_class(name)
    sampler = cls(num_examples=N, batch_size=BATCH, seed=0)
    for accountant in ('auto',) + tuple(cls.accountants):
      for group in sorted(
        {1, 2} if accountant in cls.group_accountants or accountant == 'auto' else {1}
      ):
        kwargs = dict(
          accountant=accountant,
          group_size=group,
          num_steps=STEPS,
          monte_carlo_samples=4000,
          random_allocation=False,
          max_batch_size=None,
        )
        try:
          acct = accounting.Accountant(sampler, SIGMA, DELTA, **kwargs)
          report = acct.epsilon_at(STEPS).to_dict()
        except ValueError as e:  # A refusal is a result too.
          report = {'refused': str(e)}
        out[f'epsilon/{name}/{accountant}/k={group}'] = report
  extra = {  # Branches the grid above does not reach.
    'fswr/sigma=3': ('fixed_size_with_replacement', dict(batch_size=10), 3.0, DELTA, {}),
    'monte_carlo/delta=1e-2': (
      'balls_and_bins',
      {},
      SIGMA,
      1e-2,
      dict(accountant='monte_carlo', monte_carlo_samples=4000, allow_large_delta=True),
    ),
    'random_allocation': (
      'balls_and_bins',
      dict(num_examples=200, batch_size=10),
      2.0,
      DELTA,
      dict(random_allocation=True),
    ),
    'poisson/truncated': ('poisson', {}, SIGMA, DELTA, dict(max_batch_size=70)),
    'balls_and_bins/truncated': ('balls_and_bins', {}, SIGMA, DELTA, dict(max_batch_size=70)),
  }
  for key, (name, sampler_kw, sigma, delta, kwargs) in extra.items():
    sampler = samplers.sampler_class(name)(
      **(dict(num_examples=N, batch_size=BATCH, seed=0) | sampler_kw)
    )
    kwargs = dict(num_steps=STEPS, random_allocation=False, max_batch_size=None) | kwargs
    try:
      report = accounting.Accountant(sampler, sigma, delta, **kwargs).epsilon_at(STEPS).to_dict()
    except ValueError as e:
      report = {'refused': str(e)}
    out[f'epsilon/{key}'] = report
  for name in ('poisson', 'fixed_size', 'shuffle', 'balls_and_bins'):
    sampler = samplers.sampler_class(name)(num_examples=N, batch_size=BATCH, seed=0)
    out[f'sigma/{name}/eps=2'] = calibration.calibrate_noise_multiplier(
      sampler, 2.0, DELTA, STEPS, random_allocation=False, max_batch_size=None
    )
    out[f'max_steps/{name}/sigma=1.2/eps=12'] = calibration.max_num_steps(
      sampler, SIGMA, 12.0, DELTA, max_steps=2000, random_allocation=False, max_batch_size=None
    )
  out['lower/bnb/delta'] = max_test.balls_and_bins_lower_bound_delta(1.0, 20, 1.0)
  out['lower/bnb/epsilon'] = max_test.balls_and_bins_lower_bound_epsilon(1.0, 20, 1e-5)
  out['lower/shuffle/delta'] = max_test.shuffle_lower_bound_delta(1.0, 20, 1.0, num_epochs=2)
  out['lower/shuffle/epsilon'] = max_test.shuffle_lower_bound_epsilon(1.0, 20, 1e-5)
  return _plain(out)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--check', action='store_true', help='compare with the recorded file')
  parser.add_argument(
    '--rtol',
    type=float,
    default=0.0,
    help='with --check: floats may differ by this relative amount (default 0)',
  )
  args = parser.parse_args()
  now = compute()
  if not args.check:
    os.makedirs(os.path.dirname(PATH), exist_ok=True)
    with open(PATH, 'w') as f:
      json.dump(now, f, indent=1, sort_keys=True)
    print(f'wrote {len(now)} entries to {PATH}')
    return 0
  with open(PATH) as f:
    then = json.load(f)
  diffs = {
    k: _relative_difference(then.get(k), now.get(k))
    for k in sorted(set(then) | set(now))
    if then.get(k) != now.get(k)
  }
  for k, rel in diffs.items():
    print(
      f'{k} (largest relative difference {rel:.2g}):\n  recorded {then.get(k)}\n'
      f'  now      {now.get(k)}'
    )
  beyond = [k for k, rel in diffs.items() if rel > args.rtol]
  print(
    f'{len(then)} entries, {len(diffs)} differ, {len(beyond)} by more than rtol = '
    f'{args.rtol:g}' + (f' (largest {max(diffs.values()):.2g})' if diffs else '')
  )
  return 1 if beyond else 0


if __name__ == '__main__':
  sys.exit(main())
