"""Every example command in a CLI's docstring (its --help) runs, exits 0 and is right.

The examples are read from the module docstrings of `dpjax.account`,
`dpjax.planner`, `dpjax.checkpoints` and `dpjax.train`, not copied here: a
`python -m dpjax.<cli>` line, its `\\` continuations joined, `# comments` and
`[optional ...]` groups dropped. `<workdir>` is a workdir that a tiny training
run prepared; `--workdir X` becomes a fresh directory; paths of the repository
(configs) are made absolute and the command runs in a temporary directory, so
outputs (`plan.json`) land there. account, planner and checkpoints run
in-process through `main(argv)` (balls-and-bins PLDs built in-process:
`in_process_pld_builds`); train through a subprocess (absl app: exit code and
the `Final:` line are the point). Each output is checked against an
independent computation (dp_accounting called directly) where one exists.
"""

import importlib
import json
import math
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from dpjax.privacy import samplers
from dpjax.utils.child_env import child_env
from dpjax.trainer.planning import batch_size_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLIS = ('account', 'planner', 'checkpoints', 'train', 'audit')


def docstring_examples(doc: str) -> list[list[str]]:
  """The `python -m dpjax.<cli> ...` commands of a docstring, each split like a shell does."""
  joined = re.sub(r'\\\n\s*', ' ', doc)
  commands = []
  for line in joined.splitlines():
    line = line.strip()
    if line.startswith('python -m dpjax.'):
      line = re.sub(r'\[[^\]]*\]', ' ', line)  # Optional groups of usage notation.
      commands.append(shlex.split(line, comments=True))
  return commands


def _examples():
  params = []
  for cli in CLIS:
    for i, command in enumerate(
      docstring_examples(importlib.import_module(f'dpjax.{cli}').__doc__)
    ):
      assert command[:3] == ['python', '-m', f'dpjax.{cli}'], command
      params.append(pytest.param(cli, command[3:], id=f'{cli}-{i}'))
  return params


EXAMPLES = _examples()


@pytest.mark.slow
def test_every_cli_has_examples_and_its_help_shows_them(capsys):
  """--help prints the docstring, so the examples tested here are the ones users see.

  `python -m dpjax.planner --help` as a real process (the planner's only one); the account
  command in-process (`main(['--help'])` exits 0 and prints the help; tests/e2e/test_account_cli.py
  runs it as a process)."""
  for cli in CLIS:
    assert any(p.values[0] == cli for p in EXAMPLES), f'dpjax.{cli} has no example'
  planner = subprocess.run(
    [sys.executable, '-m', 'dpjax.planner', '--help'],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=child_env(),
    timeout=120,
  )
  assert planner.returncode == 0, planner.stderr
  capsys.readouterr()
  with pytest.raises(SystemExit) as info:
    importlib.import_module('dpjax.account').main(['--help'])
  assert info.value.code == 0
  for cli, text in (('planner', planner.stdout), ('account', capsys.readouterr().out)):
    help_text = ' '.join(text.split())
    for p in EXAMPLES:
      if p.values[0] == cli:
        assert ' '.join(p.values[1][:4]) in help_text


def test_docstring_parser_joins_continuations_and_drops_comments_and_optional_groups():
  doc = (
    'Intro.\n\n  python -m dpjax.x --a 1 \\\n      --b "two words"  # note\n'
    '  python -m dpjax.x --c [--d=1 ...]\nnot python -m dpjax.y\n'
  )
  assert docstring_examples(doc) == [
    ['python', '-m', 'dpjax.x', '--a', '1', '--b', 'two words'],
    ['python', '-m', 'dpjax.x', '--c'],
  ]


def _prepare_workdir(workdir):
  from dpjax.configs import digits_mlp  # pylint: disable=g-import-not-at-top
  from dpjax import train  # pylint: disable=g-import-not-at-top

  config = digits_mlp.get_config()
  config.update_from_flattened_dict(
    {
      'num_epochs': 0,
      'num_steps': 4,
      'sampler.batch_size': 64,
      'sampler.physical_batch_size': 32,
      'privacy.target_epsilon': 0.0,
      'privacy.noise_multiplier': 1.0,
      'log_every_steps': 2,
      'eval_every_steps': 4,
      'checkpoint_every_steps': 2,
      'audit.num_canaries': 50,
    }
  )  # audit needs canaries.
  train.train_and_evaluate(config, str(workdir))


@pytest.fixture(scope='module')
def prepared_workdir(shared_setup):
  """A workdir with checkpoints: 4 steps of the digits MLP (seconds), trained once per test
  session (pytest-xdist workers share it; the examples only read a workdir)."""
  return shared_setup('cli_examples_workdir', _prepare_workdir)


def _run_train_examples(root):
  """Every `python -m dpjax.train` example, each a process of its own: forked from one
  interpreter that imported dpjax.train's dependencies once (tests/forked_cli.py), each in a
  folder of its own. Writes [{'argv', 'returncode', 'stdout', 'stderr'}, ...] to runs.json."""
  examples = [list(p.values[1]) for p in EXAMPLES if p.values[0] == 'train']
  cases = []
  for i, argv in enumerate(examples):
    (root / str(i)).mkdir()
    argv = _resolve(argv, '<no workdir>', root / str(i))
    cases.append({'argv': argv, 'cwd': str(root / str(i))})
  (root / 'cases.json').write_text(json.dumps(cases))
  # DPJAX_CACHE_DIR: the suite's XLA compilation cache (tests/conftest.py), not ~/.cache.
  env = child_env(DPJAX_CACHE_DIR=os.environ['JAX_COMPILATION_CACHE_DIR'])
  subprocess.run(
    [sys.executable, '-m', 'tests.forked_cli', 'dpjax.train', 'cases.json', 'results.json'],
    cwd=root,
    env=env,
    timeout=600,
    check=True,
  )
  results = json.loads((root / 'results.json').read_text())
  runs = [dict(result, argv=case['argv']) for case, result in zip(cases, results)]
  (root / 'runs.json').write_text(json.dumps(runs))


@pytest.fixture
def train_runs(shared_setup):
  """`train_runs(argv)`: the run of the train example `argv` (resolved), once per session."""
  import pathlib  # pylint: disable=g-import-not-at-top

  def run(argv):
    root = pathlib.Path(shared_setup('cli_train_examples', _run_train_examples))
    runs = json.loads((root / 'runs.json').read_text())
    # The example's own arguments, its fresh --workdir aside (each case has its own).
    strip = lambda a: [x for i, x in enumerate(a) if i == 0 or a[i - 1] != '--workdir']
    return next(r for r in runs if strip(r['argv']) == strip(argv))

  return run


def _resolve(argv, workdir, tmp_path):
  """Placeholders and repository paths of an example, for a run in `tmp_path`."""
  out = []
  for i, arg in enumerate(argv):
    if arg == '<workdir>':
      arg = workdir
    elif i > 0 and argv[i - 1] == '--workdir' and arg != workdir:
      arg = str(tmp_path / 'workdir')
    elif os.path.exists(os.path.join(REPO, arg.partition(':')[0])):
      arg = os.path.join(REPO, arg)
    assert '<' not in arg, f'unknown placeholder {arg!r}'
    out.append(arg)
  return out


def _direct_epsilon(sampler, n, b, sigma, steps, delta) -> float:
  """ε by dp_accounting's PLD accountant, called directly (no dpjax code)."""
  if sampler == 'poisson':
    event = dp_event.PoissonSampledDpEvent(b / n, dp_event.GaussianDpEvent(sigma))
  else:  # fixed_size, add/remove: MoG [0, 2] with [1 - b/N, b/N] (Ganesh, seed 004), i.e. the
    # pair (1 - q)·N(0, σ²) + q·N(2, σ²) vs N(0, σ²), q = b/N: exactly the Poisson-subsampled
    # Gaussian of sensitivity 2, the same privacy loss as sensitivity 1 at σ/2. dp_accounting
    # builds that PLD in a fraction of a second; its MixtureOfGaussiansDpEvent construction of
    # the same pair takes ~15 s here and agrees to 1e-10 (tests/privacy/accounting/test_accounting_events.py
    # checks the fixed_size accountant against that construction directly).
    event = dp_event.PoissonSampledDpEvent(b / n, dp_event.GaussianDpEvent(sigma / 2))
  # Grid 2e-4: half the cost of 1e-4 and within 7e-5 (relative) of it on these examples
  # (account-0: 1.1014180 vs 1.1013418; fixed_size at σ/2: 1e-8; planner rows: 1.2e-6), far
  # inside the 2e-3 (accounts) and 2e-2 (plans) these checks allow.
  acct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=2e-4)
  acct.compose(event, steps)
  return acct.get_epsilon(delta)


def _check_account(report, argv):
  eps = report['epsilon']
  assert math.isfinite(eps) and eps > 0
  d = report['details']
  target = d.get('calibrated_for_target_epsilon')
  if target is not None:
    assert target * 0.99 <= eps <= target
  if report['sampler'] in ('poisson', 'fixed_size'):
    # A run's config accounts the float rounding η of its sum: σ/(1 + η) (dpjax.privacy.rounding).
    sigma = report['noise_multiplier'] / d.get('sensitivity', 1.0)
    direct = _direct_epsilon(
      report['sampler'], d['num_examples'], d['batch_size'], sigma, report['steps'], report['delta']
    )
    # Truncation (a cap B from a config) may only add its TV penalty; here it is ~1e-32.
    assert eps == pytest.approx(direct, rel=2e-3)
  if report['sampler'] == 'balls_and_bins':
    if report['bound'] == 'upper':
      assert d['max_test_lower_bound'] <= eps <= d['deterministic_epsilon']
    else:
      assert report['bound'] == 'high_probability_upper' and '--accountant' in argv
      assert 0 < report['confidence'] < 1 and eps <= d['deterministic_epsilon']


def _run_account(argv, capsys):
  from dpjax import account  # pylint: disable=g-import-not-at-top

  assert account.main(argv) == 0
  text = capsys.readouterr().out
  if '--json' in argv:
    return json.loads(text)
  # The table: re-run with --json for the numbers, and check the table shows the same ε.
  assert account.main(argv + ['--json']) == 0
  report = json.loads(capsys.readouterr().out)
  row = next(line for line in text.splitlines() if line.startswith('ε '))
  assert float(row.split()[1]) == pytest.approx(report['epsilon'], rel=1e-5)
  return report


def _check_plan(plan, argv, tmp_path):
  assert plan.rows
  for row in plan.rows:
    assert row.epsilon <= plan.target_epsilon and math.isfinite(row.noise_multiplier)
    if plan.sampler == 'poisson':
      direct = _direct_epsilon(
        'poisson',
        plan.num_examples,
        row.batch_size,
        row.noise_multiplier,
        row.num_steps,
        plan.delta,
      )
      assert direct == pytest.approx(plan.target_epsilon, rel=0.02)
      assert direct <= plan.target_epsilon * (1 + 1e-3)
  for flag in ('--json',):
    if flag in argv:
      path = tmp_path / argv[argv.index(flag) + 1]
      assert path.stat().st_size > 0
  if '--json' in argv:
    saved = json.loads((tmp_path / argv[argv.index('--json') + 1]).read_text())
    assert [r['noise_multiplier'] for r in saved['rows']] == [r.noise_multiplier for r in plan.rows]


@pytest.mark.slow
@pytest.mark.parametrize('cli, argv', EXAMPLES)
def test_example_runs(
  cli, argv, tmp_path, monkeypatch, capsys, prepared_workdir, in_process_pld_builds, train_runs
):
  monkeypatch.setenv('DPJAX_CACHE_DIR', str(tmp_path / 'cache'))
  monkeypatch.chdir(tmp_path)
  argv = _resolve(argv, prepared_workdir, tmp_path)
  if '--workers' in argv:
    # The Monte-Carlo estimate does not depend on its workers (test_monte_carlo.py: a spawned
    # worker computes the same bits; test_account_cli.py: --workers 2 gives the serial numbers):
    # drawn here by this process alone, without a spawned interpreter's imports (~3 s CPU).
    argv[argv.index('--workers') + 1] = '1'
  if cli == 'account':
    _check_account(_run_account(argv, capsys), argv)
  elif cli == 'planner':
    from dpjax import planner  # pylint: disable=g-import-not-at-top

    plans = []
    real = batch_size_plan.plan_batch_sizes
    monkeypatch.setattr(
      batch_size_plan, 'plan_batch_sizes', lambda *a, **k: plans.append(real(*a, **k)) or plans[-1]
    )
    assert planner.main(argv) == 0
    assert len(plans) == 1
    _check_plan(plans[0], argv, tmp_path)
  elif cli == 'checkpoints':
    from dpjax.privacy import accounting  # pylint: disable=g-import-not-at-top
    from dpjax import checkpoints as checkpoints_cli  # pylint: disable=g-import-not-at-top
    from dpjax.trainer.workdir import checkpoints  # pylint: disable=g-import-not-at-top

    assert checkpoints_cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = sorted(
      int(d) for d in os.listdir(os.path.join(prepared_workdir, 'checkpoints')) if d.isdigit()
    )
    assert steps and [int(line.split()[0]) for line in lines[1:]] == steps
    # The ε of each row, recomputed from the run's sampler, σ and η (of its cap B and matmul
    # format; not from the metadata).
    from dpjax.privacy import precision, rounding  # pylint: disable=g-import-not-at-top

    config = json.load(open(os.path.join(prepared_workdir, 'config.json')))
    n = next(r for r in checkpoints.read_metadata(prepared_workdir))['num_examples']
    sampler = samplers.sampler_class(config['sampler']['name'])(
      num_examples=n, batch_size=config['sampler']['batch_size']
    )
    eta = rounding.eta(
      config['sampler']['max_batch_size'], precision.matmul_format(config['precision'])
    )
    acct = accounting.Accountant(
      sampler,
      config['privacy']['noise_multiplier'],
      config['privacy']['delta'],
      max_batch_size=None,
      sensitivity=1 + eta,
    )
    for line, step in zip(lines[1:], steps):
      assert float(line.split()[1]) == pytest.approx(acct.epsilon(step), abs=1e-4)
  elif cli == 'audit':
    from dpjax import audit  # pylint: disable=g-import-not-at-top
    from dpjax.trainer.workdir import checkpoints  # pylint: disable=g-import-not-at-top

    assert audit.main(argv) == 0
    text = capsys.readouterr().out
    last = checkpoints.read_metadata(prepared_workdir)[-1]
    if '--json' in argv:  # The saved claim and the bound the trainer stored, recomputed.
      out = json.loads(text)
      assert out['epsilon'] == last['privacy']['epsilon'] and out['num_canaries'] == 50
      assert out['audit_epsilon_lower'] == pytest.approx(last['audit']['audit_epsilon_lower'])
    else:
      assert f'{last["privacy"]["epsilon"]:.4f}' in text
  else:
    out = train_runs(argv)
    assert out['returncode'] == 0, out['stderr'][-3000:]
    final = [line for line in (out['stdout'] + out['stderr']).splitlines() if 'Final:' in line]
    assert final and re.search(r'ε = [0-9.]+ \(upper bound', final[-1]), final
    assert np.isfinite(float(re.search(r'ε = ([0-9.]+)', final[-1]).group(1)))
