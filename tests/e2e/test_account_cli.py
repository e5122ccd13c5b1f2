"""`python -m dpjax.account`: JSON keys and values agree with the Python API; errors.

The command runs in-process through `account.main(argv)` (its stdout, stderr and exit code
are what the command prints and returns); one case runs as a real `python -m` process, for
what only a process shows: exit code 2, one line on stderr, no traceback.
"""

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys

import pytest

from dpjax.privacy import samplers
from dpjax.utils.child_env import child_env
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import monte_carlo

ROOT = pathlib.Path(__file__).resolve().parents[2]
REQUIRED = (
  'epsilon',
  'delta',
  'noise_multiplier',
  'steps',
  'steps_per_epoch',
  'sampler',
  'accountant',
  'bound',
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
  monkeypatch.setenv('DPJAX_CACHE_DIR', str(tmp_path))


def _run(*args, check=True):
  """`python -m dpjax.account ARGS` in-process: returncode, stdout and stderr as a process's."""
  from dpjax import account  # pylint: disable=import-outside-toplevel

  stdout, stderr, cwd = io.StringIO(), io.StringIO(), os.getcwd()
  os.chdir(ROOT)  # Where the command ran: config paths are relative to the repository.
  try:
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
      returncode = account.main(list(args))
  except SystemExit as e:  # --help (0) and `dpjax.account: error: ...` (2).
    returncode = e.code
  finally:
    os.chdir(cwd)
  out = subprocess.CompletedProcess(
    ['dpjax.account', *args], returncode, stdout.getvalue(), stderr.getvalue()
  )
  if check:
    assert out.returncode == 0, out.stderr
  return out


def _process(*args):
  """`python -m dpjax.account ARGS` as a real process."""
  env = child_env()
  return subprocess.run(
    [sys.executable, '-m', 'dpjax.account', *args],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env,
    timeout=300,
  )


def test_help():
  out = _run('--help')
  for flag in (
    '--sampler',
    '--num-examples',
    '--batch-size',
    '--steps',
    '--epochs',
    '--noise-multiplier',
    '--target-epsilon',
    '--delta',
    '--accountant',
    '--max-batch-size',
    '--group-size',
    '--json',
    '--config',
    '--workers',
  ):
    assert flag in out.stdout


def test_poisson_json_matches_the_api():
  out = _run(
    '--sampler',
    'poisson',
    '--num-examples',
    '60000',
    '--batch-size',
    '256',
    '--epochs',
    '3',
    '--noise-multiplier',
    '1.1',
    '--delta',
    '1e-5',
    '--json',
  )
  got = json.loads(out.stdout)
  assert all(key in got for key in REQUIRED)
  sampler = samplers.sampler_class('poisson')(num_examples=60_000, batch_size=256)
  steps = 3 * sampler.steps_per_epoch
  expected = accountant_lib.Accountant(sampler, 1.1, 1e-5, max_batch_size=None).epsilon(steps)
  assert got['epsilon'] == pytest.approx(expected, rel=1e-12)
  assert (got['steps'], got['steps_per_epoch']) == (steps, 235)
  assert (got['sampler'], got['accountant'], got['bound']) == ('poisson', 'pld', 'upper')
  assert got['details']['truncation'].startswith('none')


@pytest.mark.slow
def test_balls_and_bins_json_reports_estimates_beside_the_provable_bound(in_process_pld_builds):
  out = _run(
    '--sampler',
    'balls_and_bins',
    '--num-examples',
    '1000',
    '--batch-size',
    '100',
    '--steps',
    '10',
    '--noise-multiplier',
    '1.0',
    '--delta',
    '1e-5',
    '--monte-carlo',
    '--monte-carlo-samples',
    '200000',
    '--workers',
    '2',
    '--json',
  )
  got = json.loads(out.stdout)
  assert got['bound'] == 'upper' and got['steps_per_epoch'] == 10
  assert got['epsilon'] == got['details']['provable_epsilon']
  assert got['epsilon_lower'] <= got['epsilon'] <= got['details']['deterministic_epsilon']
  m = 200_000  # > 96973, the least count that gives an estimate here (default: 10x that)
  assert (got['confidence'], got['num_samples']) == (0.999, m)
  assert got['details']['monte_carlo_epsilon_high_probability'] >= got['epsilon_lower']
  # Two worker processes, the numbers of one (untruncated: δ₀ = δ).
  serial = monte_carlo.balls_and_bins_epsilon(1.0, 10, 1e-5, num_samples=m, beta=1e-3, workers=1)
  assert got['details']['monte_carlo_epsilon_high_probability'] == min(
    serial.epsilon, got['details']['deterministic_epsilon']
  )


def test_config_and_calibration():
  out = _run(
    '--config',
    'configs/digits_mlp.py',
    '--num-examples',
    '1437',
    '--target-epsilon',
    '4.0',
    '--json',
  )
  got = json.loads(out.stdout)
  assert got['sampler'] == 'poisson' and got['steps'] == 20 * got['steps_per_epoch']
  assert 0.99 * 4.0 <= got['epsilon'] <= 4.0
  assert got['details']['calibrated_for_target_epsilon'] == 4.0
  assert got['details']['max_batch_size'] % 64 == 0  # From batching, a multiple of P.


@pytest.mark.slow
def test_the_account_cli_resolves_sigma_as_training_does_with_audit_canaries():
  """Issue 24 item 8: the canaries add m rows (N + m); the CLI used N and calibrated another σ."""
  from dpjax.configs import digits_mlp  # pylint: disable=import-outside-toplevel
  from dpjax.trainer.planning import plan as plan_lib  # pylint: disable=import-outside-toplevel

  out = _run(
    '--config',
    'configs/digits_mlp.py',
    '--config.audit.num_canaries=200',
    '--config.num_epochs=2',
    '--json',
  )
  got = json.loads(out.stdout)
  config = digits_mlp.get_config()
  config.audit.num_canaries, config.num_epochs = 200, 2
  train_source = plan_lib.make_training_sources(config)[0]
  plan = plan_lib.make_plan(config, train_source)
  assert got['details']['num_examples'] == len(train_source) == 1437 + 200
  assert got['noise_multiplier'] == plan.privacy.noise_multiplier
  assert got['epsilon'] == plan.privacy.accountant.epsilon(plan.num_steps)


_POISSON = tuple('--sampler poisson --num-examples 1000 --batch-size 100 --steps 10'.split())


@pytest.mark.slow
def test_delta_at_or_above_one_over_n_is_refused_unless_allowed():
  base = (*_POISSON, '--noise-multiplier', '1.0')
  out = _process(*base, '--delta', '0.5')  # A real process: exit code, one line, no traceback.
  assert out.returncode == 2 and 'delta = 0.5 is >= 1/N' in out.stderr
  assert '--allow-large-delta' in out.stderr  # The flag a user of this command can type.
  assert len(out.stderr.strip().splitlines()) == 1 and 'Traceback' not in out.stderr
  assert out.stdout == ''
  got = json.loads(_run(*base, '--delta', '0.5', '--allow-large-delta', '--json').stdout)
  assert got['delta'] == 0.5


def test_table_labels_shuffle_numbers():
  out = _run(
    '--sampler',
    'shuffle',
    '--num-examples',
    '10000',
    '--batch-size',
    '100',
    '--epochs',
    '1',
    '--noise-multiplier',
    '1.0',
    '--delta',
    '1e-5',
  )
  assert 'upper bound (provable)' in out.stdout
  assert 'NOT a guarantee' in out.stdout
  assert 'lower bound' in out.stdout


@pytest.mark.parametrize(
  'args, message',
  [
    (('--noise-multiplier', '-1'), '--noise-multiplier must be'),
    (('--noise-multiplier', '1', '--batch-size', '20000'), 'batch_size'),
    (('--noise-multiplier', '1', '--workers', '0'), '--workers'),
  ],
)
def test_errors_name_the_field(args, message):
  base = {
    '--sampler': 'poisson',
    '--num-examples': '10000',
    '--batch-size': '100',
    '--steps': '10',
    '--delta': '1e-5',
  }
  for flag, value in zip(args[::2], args[1::2]):
    base[flag] = value
  out = _run(*[x for kv in base.items() for x in kv], check=False)
  assert out.returncode == 2
  assert message in out.stderr


@pytest.mark.parametrize(
  'args, line',
  [
    (
      (*_POISSON, '--noise-multiplier', '1', '--delta', '2'),
      '--delta must be a finite number > 0 and < 1, got 2.0.',
    ),
    (
      (*_POISSON, '--noise-multiplier', '1', '--delta', '0'),
      '--delta must be a finite number > 0 and < 1, got 0.0.',
    ),
    (
      (*_POISSON, '--noise-multiplier', 'nan', '--delta', '1e-5'),
      '--noise-multiplier must be a finite number > 0, got nan.',
    ),
    (
      (*_POISSON, '--target-epsilon', '-1', '--delta', '1e-5'),
      '--target-epsilon must be a finite number > 0, got -1.0.',
    ),
    (
      ('--config', 'digits_mlp', '--delta', '2'),
      '--delta must be a finite number > 0 and < 1, got 2.0.',
    ),
    (
      (*_POISSON, '--noise-multiplier', '1', '--delta', '0.5'),
      '--delta = 0.5 is >= 1/N = 0.001 (N = 1000): such a guarantee allows publishing a random '
      'record in the clear. Use δ well below 1/N (e.g. <= 1/(10·N)), or set '
      '--allow-large-delta to accept it.',
    ),
  ],
)
def test_sigma_target_and_delta_out_of_range_name_the_flag(args, line):
  """The line names the flag the user typed, as the trainer names the config field. Fails on
  da06065 (checked): it said 'privacy.delta must be in (0, 1)', 'noise_multiplier σ must be …',
  'privacy.target_epsilon must be …', 'privacy.delta = 2.0: must be …' (with --config) and
  'delta = 0.5 is >= 1/N … allow_large_delta=True (--allow-large-delta)'; on 11c40e5 'delta
  must be …' and 'noise_multiplier must be …'."""
  out = _run(*args, check=False)
  assert (out.returncode, out.stdout) == (2, '')
  assert out.stderr == f'python -m dpjax.account: error: {line}\n'


@pytest.mark.parametrize(
  'extra, named',
  [
    (('--config', 'digits_mlp', '--config.num_epochs=50'), '--config, --config.num_epochs'),
    (('--epochs', '50', '--noise-multiplier', '2', '--json'), '--epochs, --noise-multiplier'),
    (('--delta', '1e-8'), '--delta'),
  ],
)
def test_workdir_with_any_flag_it_would_ignore_is_refused(tmp_path, extra, named):
  """`--workdir w --config ... --config.num_epochs=50` printed the checkpoint's ε as if it
  answered for 50 epochs; now one line naming the ignored flags, before the workdir is read
  (here it does not even exist). Fails on da06065: it answered (here: 'not a directory')."""
  out = _run('--workdir', str(tmp_path / 'w'), *extra, check=False)
  assert out.returncode == 2 and out.stdout == ''
  assert out.stderr == (
    f"python -m dpjax.account: error: --workdir reports the ε that the run's "
    f'checkpoints carry, so {named} would be ignored: give --workdir alone '
    '(with --json at most), or leave it out to compute ε from the flags or '
    'the config.\n'
  )


def test_an_oversized_privacy_loss_grid_names_the_flags_that_fix_it():
  """k = 1024 > b: the accountant refuses the grid before building it. Fails on da06065: the
  fixes named max_grid_points and value_discretization_interval (no flag sets them) and the
  config fields privacy.group_size and privacy.noise_multiplier instead of the flags."""
  out = _run(
    '--sampler',
    'poisson',
    '--num-examples',
    '50000',
    '--batch-size',
    '256',
    '--steps',
    '100',
    '--noise-multiplier',
    '1',
    '--delta',
    '1e-5',
    '--group-size',
    '1024',
    check=False,
  )
  assert out.returncode == 2 and len(out.stderr.splitlines()) == 1
  assert out.stderr.endswith(
    'more than the 2e+06 allowed (minutes and GBs of memory). To fix: '
    'lower --group-size = 1024; or raise σ (--noise-multiplier = 1).\n'
  )


@pytest.mark.slow
def test_a_workdirs_planned_epsilon_is_of_the_sigma_and_eta_that_ran(reference_run, monkeypatch):
  """`--workdir` of an unfinished run: its planned final ε is accounted with the σ the run
  used (read from the checkpoint, never calibrated again) and the η of the matmul format it
  recorded (TF32 here, as on a GPU), whatever machine asks. Before (the merge of items 6 and
  9), this machine's float32 η was used: ~0.7 % lower here, for a run that paid TF32's."""
  from dp_accounting import dp_event  # pylint: disable=import-outside-toplevel
  from dp_accounting.pld import pld_privacy_accountant  # pylint: disable=import-outside-toplevel
  from dpjax.privacy import rounding  # pylint: disable=import-outside-toplevel
  from dpjax.trainer.workdir import checkpoints  # pylint: disable=import-outside-toplevel

  workdir = reference_run[0]  # The session's 6-step small_config run (read only).
  meta = checkpoints.read_metadata(str(workdir))[-1]
  read = checkpoints.read_metadata

  def unfinished(path):  # As if it planned 40 steps, had σ calibrated and ran on a GPU.
    rows = read(path)
    for row in rows:
      row['config']['num_steps'] = 40
      row['config']['privacy'].update(noise_multiplier=None, target_epsilon=50.0)
      row['fingerprint']['privacy.matmul_format'] = 'tf32'
    return rows

  monkeypatch.setattr(checkpoints, 'read_metadata', unfinished)
  out = json.loads(_run('--workdir', str(workdir), '--json').stdout)['details']
  cap = meta['sampler']['max_batch_size']
  eta = rounding.eta(cap, 'tf32')
  q = meta['sampler']['sampling_probability']

  def reference(noise):  # dp_accounting at a fine grid: the bound is at or above, within 0.3 %.
    # 1e-4, not 1e-5: ε moves by ~3e-8 relative here, 2.5 s instead of 30 s per reference;
    # a coarser grid only raises the reference, so `tf32 <= ε` only gets stricter.
    direct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    direct.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(noise)), 40)
    return direct.get_epsilon(meta['privacy']['delta'])

  tf32 = reference(meta['noise_multiplier'] / (1 + eta))
  assert out['planned_steps'] == 40
  assert tf32 <= out['planned_final_epsilon'] <= tf32 * 1.003
  assert (
    out['planned_final_epsilon']
    > reference(meta['noise_multiplier'] / (1 + rounding.eta(cap, 'float32'))) * 1.003
  )
