"""Every `python -m dpjax.<command>` answers --help and a bad argument without importing jax, and
`dpjax.account` computes ε without flax, optax, orbax or TFDS (issue 35, item 7).

Each case is a fresh interpreter that runs the command as `python -m` does (runpy, as
__main__), catches its exit and writes which heavy modules are in `sys.modules` at the end: a
fact about imports, not a timing, so it cannot be flaky. The cases run side by side. The times
themselves: scripts/bench_cli_start.py (scripts/results/cli_start.json).

Fails on da06065 (checked): `dpjax.trainer.commands.cli` imported `config_fields` (clipping: jax, flax,
optax) at its top, so every command's --help and bad argument imported jax; train, export,
audit and checkpoints imported orbax too, and `dpjax.account` the accountants (numpy,
dp_accounting) for its flags' choices. (The names test fails there on the new module.)
"""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

from dpjax.utils.child_env import child_env

pytestmark = pytest.mark.slow  # Child interpreters, one per command line.

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The modules no --help or argument error needs; their imports take seconds.
HEAVY = ('jax', 'flax', 'optax', 'orbax.checkpoint', 'tensorflow_datasets', 'tensorflow')
# What an accounting answer from flags must not import (it needs dp_accounting and numpy).
NOT_FOR_ACCOUNTING = HEAVY
# Runs `module` with argv as `python -m module argv` would, then records its exit and imports.
RUN_AS_MAIN = """
import json, runpy, sys
report, module = sys.argv[1], sys.argv[2]
sys.argv = [module, *sys.argv[3:]]
code = 0
try:
  runpy.run_module(module, run_name='__main__', alter_sys=True)
except SystemExit as e:
  code = e.code
with open(report, 'w') as f:
  json.dump({'exit': code, 'modules': sorted(sys.modules)}, f)
"""
# Each command's program name and one bad argument (rejected by the flags, before any compute).
COMMANDS = {
  'account': (
    'python -m dpjax.account',
    ['--steps', '1', '--epochs', '2'],
    '--steps and --epochs: give one of them, not both.',
  ),
  'train': ('dpjax.train', ['--workdir', 'w'], '--config: required'),
  'export': ('python -m dpjax.export', ['--workdir', 'w'], '--workdir and --out are required'),
  'planner': (
    'python -m dpjax.planner',
    ['--num_examples', 'many'],
    "flag --num_examples=many: invalid literal for int() with base 10: 'many'",
  ),
  'audit': ('python -m dpjax.audit', ['--json'], '--workdir is required'),
  'checkpoints': (
    'python -m dpjax.checkpoints',
    [],
    'expected positional arguments: <workdir>; got []',
  ),
}
ACCOUNTING_ANSWER = [
  '--sampler',
  'poisson',
  '--num-examples',
  '1000',
  '--batch-size',
  '10',
  '--steps',
  '10',
  '--noise-multiplier',
  '1.0',
  '--delta',
  '1e-5',
  '--accountant',
  'rdp',
  '--json',
]


def _cases():
  for name, (_, bad, _) in COMMANDS.items():
    yield name, 'help', ['--help']
    yield name, 'bad', bad
  yield 'account', 'answer', ACCOUNTING_ANSWER


def _run_all(root) -> dict:
  started = {}
  for name, kind, argv in _cases():  # All at once: the wall time of the slowest.
    cwd = root / f'{name}_{kind}'
    cwd.mkdir(parents=True)
    report = root / f'{cwd.name}.json'
    started[name, kind] = (
      cwd,
      report,
      subprocess.Popen(
        [sys.executable, '-c', RUN_AS_MAIN, str(report), f'dpjax.{name}', *argv],
        cwd=cwd,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      ),
    )
  out = {}
  for key, (cwd, report, proc) in started.items():
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, (key, stderr)  # The wrapper itself ended normally.
    result = json.loads(report.read_text())
    out[key] = (
      result['exit'],
      stdout,
      stderr,
      set(result['modules']),
      sorted(p.name for p in cwd.iterdir()),
    )
  return out


@pytest.fixture
def runs(shared_result):
  """(command, kind) -> (exit code, stdout, stderr, modules, files left in its cwd), the child
  interpreters run once per test session."""
  return shared_result('cli_start', _run_all)[1]


def test_every_command_line_entry_point_is_covered():
  """Each top-level module with a `__main__` block is a `python -m dpjax.<name>` command."""
  found = set()
  for path in (ROOT / 'dpjax').glob('*.py'):
    for node in ast.parse(path.read_text()).body:
      if (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and getattr(node.test.left, 'id', '') == '__name__'
      ):
        found.add(path.stem)
  assert found == set(COMMANDS)


@pytest.mark.parametrize('name', COMMANDS)
def test_help_answers_without_jax(runs, name):
  code, stdout, stderr, modules, left = runs[name, 'help']
  assert code == 0 and stderr == '', stderr
  assert stdout.startswith(f'usage: {COMMANDS[name][0]}'), stdout[:200]
  assert sorted(modules.intersection(HEAVY)) == []
  assert left == []


@pytest.mark.parametrize('name', COMMANDS)
def test_a_bad_argument_is_one_line_without_jax(runs, name):
  prog, _, message = COMMANDS[name]
  code, stdout, stderr, modules, left = runs[name, 'bad']
  assert code == 2 and stdout == ''
  assert stderr.startswith(f'{prog}: error: ') and stderr.count('\n') == 1, stderr
  assert message in stderr
  assert sorted(modules.intersection(HEAVY)) == []
  assert left == []  # Nothing written (train's --workdir w is not created).


def test_account_help_imports_no_accountant(runs):
  """Its flags' choices come from `dpjax.privacy.names`, not from the accountants' modules."""
  modules = runs['account', 'help'][3]
  assert sorted(modules.intersection({'numpy', 'dp_accounting', 'scipy'})) == []
  assert not any(m.startswith('dpjax.privacy.accounting.') for m in modules)


def test_an_accounting_answer_imports_no_training_library(runs):
  code, stdout, stderr, modules, _ = runs['account', 'answer']
  assert code == 0, stderr
  report = json.loads(stdout)
  assert report['accountant'] == 'rdp' and report['steps'] == 10 and report['epsilon'] > 0
  assert 'dp_accounting' in modules  # The answer's own library: the check sees imports.
  assert sorted(modules.intersection(NOT_FOR_ACCOUNTING)) == []
