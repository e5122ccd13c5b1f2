"""Every bad input gets one clear line before any compute, and leaves the workdir as it was.

In-process cases call `train.train_and_evaluate` on a config with one bad
field: a ValueError naming the field and its valid range, raised before
anything in the workdir changes. Command-line cases check what only a command
line shows: exit code 2, one line on stderr, no traceback (each a process of its
own, forked after the imports: tests/forked_cli.py; one also as a plain
`python -m dpjax.train`). docs/errors.md
lists every case with its message (`python -m tests.e2e.test_bad_inputs` prints
that table).
"""

import json
import math
import os
import subprocess
import sys

import pytest

from dpjax.trainer.configuration import config_fields
from dpjax import train
from tests.run_configs import small_config
from tests.run_configs import tree_digest
from tests.settable_names import unsettable_names

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INF, NAN = math.inf, math.nan

# (overrides, regex the message must match). Each names the field and its valid range.
CONFIG_CASES = [
  ({'seed': -1}, r'seed = -1: must be an integer in \[0, \d+\] or None'),
  ({'data.source': 'imagenet'}, r"data.source = 'imagenet': must be one of 'digits'"),
  ({'data.label_format': 'onehot'}, r"data.label_format = 'onehot': must be one of 'int'"),
  ({'data.max_abs_feature': 0.0}, r'data.max_abs_feature = 0.0: must be a finite number > 0'),
  ({'data.scale': -1.0}, r'data.scale = -1.0: must be a finite number >= 0'),
  ({'data.scale': NAN}, r'data.scale = nan: must be a finite number >= 0'),
  ({'data.std': (0.0,)}, r'data.std = \(0.0,\): must be a tuple of finite numbers, each > 0'),
  ({'data.num_classes': -1}, r'data.num_classes = -1: must be an integer >= 0'),
  (
    {'data.source': 'synthetic', 'data.num_examples': 100, 'data.num_classes': 1},
    r"data.num_classes = 1: must be an integer >= 2 for data.source = 'synthetic'",
  ),
  ({'data.num_classes': 9}, r'digits: y_train: label 9 in row \d+ is not in \[0, 9\)'),
  ({'data.public_num_examples': -1}, r'data.public_num_examples = -1: must be an integer >= 0'),
  (
    {'data.public_num_examples': 1000},
    r'data.public_num_examples = 1000: the training set has '
    r'more examples .*a public upper bound',
  ),
  (
    {'data.public_num_examples': 2000, 'sampler.name': 'shuffle'},
    r"data.public_num_examples = 2000 needs sampler.name = 'poisson': the shuffle sampler's",
  ),
  (
    {'data.input_shape': (0, 8)},
    r'data.input_shape = \(0, 8\): must be a tuple of integers, '
    r'each >= 1',
  ),
  (
    {'data.source': 'npz'},
    r'data.num_classes = 0: set it to the number of classes K \(labels '
    r"in \[0, K\)\) of your task \(data.source = 'npz'\)",
  ),
  (
    {'data.source': 'npz', 'data.num_classes': 10},
    r"data.path = '':? must name an existing "
    r'.npz file',
  ),
  (
    {'data.source': 'memmap', 'data.path': '/nonexistent', 'data.num_classes': 10},
    r"data.path = '/nonexistent':? must be an existing directory",
  ),
  ({'data.source': 'tfds'}, r'data.name must name a TFDS dataset'),
  ({'sampler.name': 'poison'}, r"sampler.name = 'poison': must be one of 'poisson'"),
  ({'sampler.batch_size': 0}, r'sampler.batch_size = 0: must be an integer >= 1'),
  ({'sampler.batch_size': 5000}, r'sampler.batch_size = 5000 must be in \[1, N = 1437\]'),
  (
    {'sampler.physical_batch_size': -1},
    r'sampler.physical_batch_size = -1: must be an integer >= 0',
  ),
  ({'sampler.max_batch_size': -1}, r'sampler.max_batch_size = -1: must be an integer >= 0'),
  # Issue 34: accepted on da06065 (B became 2^20), it compiled a step over a million rows.
  (
    {'sampler.physical_batch_size': 2**20},
    r'sampler.physical_batch_size = 1048576: must be '
    r'<= 512 \(the cap on a logical batch rounded up',
  ),
  (
    {'sampler.max_batch_size': 100},
    r'sampler.max_batch_size = 100: must be 0 \(auto\) or a '
    r'multiple of sampler.physical_batch_size = 32',
  ),
  (
    {'privacy.clip_norm': 0.0},
    r'privacy.clip_norm = 0.0: must be a finite number > 0 .*'
    r'privacy.enabled=False',
  ),
  ({'privacy.clip_norm': -1.0}, r'privacy.clip_norm = -1.0: must be a finite number > 0'),
  ({'privacy.clip_norm': INF}, r'privacy.clip_norm = inf: must be a finite number > 0'),
  ({'privacy.clip_norm': NAN}, r'privacy.clip_norm = nan: must be a finite number > 0'),
  (
    {'privacy.noise_multiplier': 0.0},
    r'privacy.noise_multiplier = 0.0: must be a finite number '
    r'> 0 or None .*privacy.enabled=False',
  ),
  ({'privacy.noise_multiplier': -1.0}, r'privacy.noise_multiplier = -1.0: must be a finite'),
  ({'privacy.noise_multiplier': INF}, r'privacy.noise_multiplier = inf: must be a finite'),
  ({'privacy.noise_multiplier': NAN}, r'privacy.noise_multiplier = nan: must be a finite'),
  (
    {'privacy.target_epsilon': -1.0},
    r'privacy.target_epsilon = -1.0: must be a finite number '
    r'>= 0',
  ),
  ({'privacy.target_epsilon': INF}, r'privacy.target_epsilon = inf: must be a finite number'),
  ({'privacy.delta': 0.0}, r'privacy.delta = 0.0: must be a finite number in \(0, 1\)'),
  ({'privacy.delta': 1.0}, r'privacy.delta = 1.0: must be a finite number in \(0, 1\)'),
  ({'privacy.delta': 1.5}, r'privacy.delta = 1.5: must be a finite number in \(0, 1\)'),
  (
    {'privacy.delta': 0.5},
    r'privacy.delta = 0.5 is >= 1/N = 0.000696 \(N = 1437\).*'
    r'privacy.allow_large_delta = True',
  ),
  ({'privacy.delta': 1 / 1437}, r'privacy.delta = 0.000695894 is >= 1/N'),
  ({'privacy.accountant': 'moments'}, r"privacy.accountant = 'moments': must be one of 'auto'"),
  (
    {'privacy.accountant': 'monte_carlo'},
    r"privacy.accountant = 'monte_carlo' is not supported "
    r"for sampler 'poisson'",
  ),
  ({'privacy.group_size': 0}, r'privacy.group_size = 0: must be an integer >= 1'),
  (
    {'privacy.monte_carlo_workers': 0},
    r'privacy.monte_carlo_workers = 0: must be an integer '
    r'>= 1',
  ),
  ({'privacy.clipping': 'fast'}, r"privacy.clipping = 'fast': must be one of 'auto'"),
  (
    {'privacy.noise_multiplier': None},
    r'privacy.noise_multiplier or privacy.target_epsilon must '
    r'be set',
  ),
  (
    {'privacy.noise_multiplier': 0.3, 'privacy.target_epsilon': 1.0},
    r'would reach ε = \d+\.\d+ .*above privacy.target_epsilon = 1',
  ),
  ({'optimizer.name': 'lamb'}, r"optimizer.name = 'lamb': must be one of 'sgd', 'adam'"),
  (
    {'optimizer.learning_rate': 0.0},
    r'optimizer.learning_rate = 0.0: must be a finite number '
    r'> 0',
  ),
  ({'optimizer.learning_rate': NAN}, r'optimizer.learning_rate = nan: must be a finite number'),
  ({'optimizer.momentum': 1.0}, r'optimizer.momentum = 1.0: must be a finite number in \[0, 1\)'),
  ({'optimizer.momentum': -0.5}, r'optimizer.momentum = -0.5: must be a finite number in'),
  ({'num_devices': -1}, r'num_devices = -1: must be an integer >= 0'),
  ({'num_devices': 64}, r'num_devices'),
  ({'steps_per_call': -1}, r'steps_per_call = -1: must be an integer in \[0, 4096\]'),
  ({'num_steps': -2}, r'num_steps = -2: must be an integer >= 0'),
  ({'num_epochs': -1}, r'num_epochs = -1: must be an integer >= 0'),
  ({'num_steps': 0}, r'num_steps = 0, num_epochs = 0: exactly one must be > 0'),
  ({'num_epochs': 3}, r'num_steps = 6, num_epochs = 3: exactly one must be > 0'),
  ({'log_every_steps': 0}, r'log_every_steps = 0: must be an integer >= 1'),
  ({'eval_every_steps': 0}, r'eval_every_steps = 0: must be an integer >= 1'),
  ({'checkpoint_every_steps': -5}, r'checkpoint_every_steps = -5: must be an integer >= 1'),
  ({'keep_checkpoints': 0}, r'keep_checkpoints = 0: must be an integer >= 1'),
  (
    {'augmult.num_views': 4, 'augmult.crop_padding': 8},
    r'augmult.crop_padding = 8: must be < min\(H, W\) = 8',
  ),
  ({'augmult.num_views': -1}, r'augmult.num_views = -1: must be an integer >= 0'),
  ({'audit.num_canaries': -1}, r'audit.num_canaries = -1: must be an integer >= 0'),
  ({'audit.kind': 'loss'}, r"audit.kind = 'loss': must be one of 'gradient'"),
  ({'model.name': 'resnet'}, r"model.name = 'resnet': must be one of 'mlp', 'cnn'"),
  ({'model.activation': 'swish'}, r"config.model.activation='swish'"),
  # Fails on da06065: it named max_grid_points and value_discretization_interval, settings
  # no config has.
  (
    {'privacy.group_size': 1024},
    r'needs ~[0-9.]+e\+[0-9]+ grid points × components, more than the '
    r'2e\+06 allowed .* To fix: lower privacy.group_size = 1024; '
    r'or raise σ \(privacy.noise_multiplier = 1\)\.$',
  ),
  # Fails on da06065: "Did you mean model.hidden_size?", a field the command line cannot add.
  (
    {'model.name': 'cnn'},
    r"model.hidden_sizes: a field of model 'mlp', not of model.name = "
    r"'cnn', whose fields are model.activation, .*default_model_config"
    r"\('cnn'\)",
  ),
]


def test_there_are_at_least_forty_cases():
  assert len(CONFIG_CASES) + len(CLI_CASES) >= 40


@pytest.mark.slow
@pytest.mark.parametrize(
  'overrides, message',
  CONFIG_CASES,
  ids=[','.join(f'{k}={v}' for k, v in o.items()) for o, _ in CONFIG_CASES],
)
def test_bad_config_field_is_one_clear_error_before_any_change(tmp_path, overrides, message):
  work = tmp_path / 'work'
  work.mkdir()
  (work / 'notes.txt').write_text('a file the user keeps here')
  before = tree_digest(work)
  with pytest.raises(ValueError, match=message) as info:
    train.train_and_evaluate(small_config(**overrides), str(work))
  assert '\n' not in str(info.value).strip() or 'TFDS' in str(info.value)
  assert unsettable_names(str(info.value), given=str(overrides)) == []
  assert tree_digest(work) == before and sorted(os.listdir(work)) == ['notes.txt']


@pytest.mark.slow
def test_non_private_run_ignores_privacy_fields(tmp_path):
  """σ = 0 and C = inf are errors only under privacy.enabled=True."""
  result = train.train_and_evaluate(
    small_config(
      **{
        'privacy.enabled': False,
        'privacy.noise_multiplier': 0.0,
        'privacy.clip_norm': INF,
        'num_steps': 2,
      }
    ),
    str(tmp_path),
  )
  assert 'privacy' not in result and result['step'] == 2


# (extra command-line arguments, regex of the one stderr line). As processes: the exit code and
# the single line are the point.
CLI_CASES = [
  (['--config.foo=1'], r"--config.foo: the config has no field 'foo'"),
  (['--config.privacy.nois_multiplier=1'], r'Did you mean --config.privacy.noise_multiplier\?'),
  (['--config.num_steps=abc'], r'--config.num_steps=abc'),
  (['--config.privacy.noise_multiplier=0'], r'privacy.noise_multiplier = 0.0: must be'),
  (['--config.privacy.clip_norm=inf'], r'privacy.clip_norm = inf: must be'),
  (['--num_processes=2'], r'only apply with --distributed'),
  (['--config.sampler.num_groups=4'], r'sampler.num_groups = 4: not a setting of sampler.name'),
  (
    ['--config.privacy.noise=bandmf', '--config.privacy.num_bands=4'],
    r"privacy.noise = 'bandmf': .*accounted for sampler cyclic_poisson",
  ),
  ('missing_config', r'no such file .*missing.py'),
  ('broken_config', r'syntax error at line 1'),
  ('workdir_is_file', r'is a file, not a directory'),
  ('workdir_unwritable', r'not writable'),
]


CLI_IDS = [a if isinstance(a, str) else a[0] for a, _ in CLI_CASES]
REAL_PROCESS_CASE = '--config.privacy.noise_multiplier=0'


def _command_line(args, tmp_path):
  """A CLI_CASES entry's `python -m dpjax.train` arguments (the files it needs made in tmp_path),
  its workdir, and whether that workdir must not exist afterwards."""
  config, workdir = os.path.join(REPO, 'configs', 'digits_mlp.py'), str(tmp_path / 'w')
  if args == 'missing_config':
    config, args = str(tmp_path / 'missing.py'), []
  elif args == 'broken_config':
    config, args = str(tmp_path / 'broken.py'), []
    (tmp_path / 'broken.py').write_text('def get_config(:\n')
  elif args == 'workdir_is_file':
    (tmp_path / 'w').write_text('')
    args = []
  elif args == 'workdir_unwritable':
    workdir, args = '/proc/dpjax-test/w', []  # Not creatable even by root.
  must_not_exist = args == [] and workdir.endswith('/w') and not (tmp_path / 'w').is_file()
  return [f'--config={config}', f'--workdir={workdir}', *args], workdir, must_not_exist


def _from_any_directory(root):
  """The two runs of test_configs_work_from_any_directory_and_help_exits_0, in root/anydir (the
  working directory: the repository is not on sys.path): the packaged config by its path, one
  step with a fixed σ (calibration is not what that test is about), then a resume with
  --workdir alone (its config.json), extended by an override."""
  cwd = root / 'anydir'
  cwd.mkdir()
  first = [
    f'--config={os.path.join(REPO, "configs", "digits_mlp.py")}:runlocal',
    f'--workdir={cwd / "w"}',
    '--config.num_steps=1',
    '--config.privacy.target_epsilon=0',
    '--config.privacy.noise_multiplier=1',
  ]
  second = [f'--workdir={cwd / "w"}', '--config.num_steps=2']
  return [{'argv': argv, 'cwd': str(cwd)} for argv in (first, second)]


def _run_command_lines(root):
  """Every CLI_CASES command line, each a process of its own: forked from one interpreter that
  imported dpjax.train's dependencies once (tests/forked_cli.py: each runs `python -m
  dpjax.train` as a fresh interpreter would after those imports, in its case's working
  directory, first on sys.path as for `python -m`), and REAL_PROCESS_CASE also as a real
  `python -m dpjax.train` (what the imports print included), at the same time. The same
  interpreter then forks the two runs of `_from_any_directory` (one interpreter's imports
  spared; they were a driver of their own). Writes {case id: [(result, workdir,
  must_not_exist), ...], 'from_any_directory': [started, resumed]} to root/runs.json."""
  import json  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel

  root = pathlib.Path(root)
  # The suite's XLA compilation cache (tests/conftest.py), not ~/.cache/dpjax/xla.
  env = dict(
    os.environ, JAX_PLATFORMS='cpu', DPJAX_CACHE_DIR=os.environ['JAX_COMPILATION_CACHE_DIR']
  )
  real_argv, real_workdir, real_check = _command_line(
    CLI_CASES[CLI_IDS.index(REAL_PROCESS_CASE)][0], root / 'real'
  )
  real = subprocess.Popen(
    [sys.executable, '-m', 'dpjax.train', *real_argv],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=env,
  )
  try:
    cases = []
    for i, (args, _) in enumerate(CLI_CASES):
      (root / str(i)).mkdir()
      cases.append(_command_line(args, root / str(i)))
    anywhere = _from_any_directory(root)
    (root / 'cases.json').write_text(
      json.dumps([{'argv': argv, 'cwd': REPO} for argv, _, _ in cases] + anywhere)
    )
    driver = subprocess.run(
      [
        sys.executable,
        '-m',
        'tests.forked_cli',
        'dpjax.train',
        str(root / 'cases.json'),
        str(root / 'results.json'),
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      env=env,
      timeout=300,
    )
    out, err = real.communicate(timeout=300)
  finally:
    real.kill()
  assert driver.returncode == 0, driver.stderr
  results = json.loads((root / 'results.json').read_text())
  results, runs = results[: len(cases)], {'from_any_directory': results[len(cases) :]}
  runs |= {
    case_id: [(result, workdir, check)]
    for case_id, result, (_, workdir, check) in zip(CLI_IDS, results, cases)
  }
  runs[REAL_PROCESS_CASE].append(
    ({'returncode': real.returncode, 'stdout': out, 'stderr': err}, real_workdir, real_check)
  )
  (root / 'runs.json').write_text(json.dumps(runs))


@pytest.fixture(scope='module')
def command_line_errors(shared_setup):
  """_run_command_lines, once per test session (pytest-xdist workers share the results)."""
  import json  # pylint: disable=import-outside-toplevel

  with open(
    os.path.join(shared_setup('command_line_errors', _run_command_lines), 'runs.json')
  ) as f:
    return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize('args, message', CLI_CASES, ids=CLI_IDS)
def test_command_line_error_is_one_line_with_exit_code_2(command_line_errors, args, message):
  import re  # pylint: disable=import-outside-toplevel

  case_id = args if isinstance(args, str) else args[0]
  runs = command_line_errors[case_id]
  assert len(runs) == 1 + (case_id == REAL_PROCESS_CASE)
  for proc, workdir, must_not_exist in runs:
    assert proc['returncode'] == 2, proc['stderr']
    lines = proc['stderr'].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('dpjax.train: error: '), proc['stderr']
    assert 'Traceback' not in proc['stderr']
    assert re.search(message, lines[0]), lines[0]
    assert unsettable_names(lines[0], given=str(args)) == []
    if must_not_exist:
      assert not os.path.exists(workdir)


_INTRO = """# Refusals and errors

dpjax refuses bad input before any compute, with one line that names the field
(or file, split, array and row) and its valid range. From the command line that
line is `dpjax.train: error: <message>` on stderr with exit code 2, no
traceback, and nothing in `--workdir` changed. Inside Python the same message
is a `ValueError` (`dpjax.trainer.configuration.config_fields.ConfigError`, `dpjax.trainer.planning.plan.PlanError`,
`dpjax.data.validation.DataError`, `dpjax.trainer.workdir.checkpoint_restore.CheckpointMismatchError`).
Every row below is a case of `tests/e2e/test_bad_inputs.py`, and this file is its
output: `python -m tests.e2e.test_bad_inputs > docs/errors.md`.

## Resuming a run

Every checkpoint stores the run's **privacy fingerprint** (`dpjax.trainer.planning.plan`): the
private flag, the sampler's name, N, b and the resolved cap B, the group size,
σ as used, C, δ, the resolved accountant, the SHA-256 of the seed, the audit
canaries, and the dataset's source, split, N and a digest of its content.
Rerunning a workdir with any of them changed is refused, listing each change
(`Changed: sampler.batch_size: 256 → 128. Use a new --workdir ...`). A
checkpoint whose state has another structure than the config builds (the model
or the optimiser changed: e.g. sgd → adam, momentum 0 → 0.9, another width) is
refused as well, naming what differs, and left untouched; only a checkpoint
whose files fail their SHA-256 manifest (or cannot be read) is treated as
corrupt and moved aside once an earlier one restores. When none is readable
the resume is refused, nothing moved, with what to do to start again from
step 0. Allowed on resume: the learning rate and its schedule,
logging, evaluation and checkpoint periods, `keep_checkpoints`, the clipping
method, P when the checkpoint's B is a multiple of it, and a longer run (ε
recomputed for the new total with the checkpoint's σ; `privacy.target_epsilon`
is a budget). `python -m dpjax.train --workdir w` alone resumes with the
config in `w/config.json` (`--config.<field>=v` overrides still apply).

## Interruptions and sizes

SIGTERM or Ctrl-C during training saves a checkpoint within about three calls
(the one running and at most two queued; the automatic steps per call keep a call
near 0.5 s) and exits 128 + signal;
while XLA compiles, the run stops within a second with one line (nothing was
trained since the last checkpoint). Ctrl-C before the loop exits 130 with one
line. An unwritable HOME or cache directory falls back to no cache (a warning;
a `compilation_cache_dir` you named is refused in one line). A run whose
privacy loss cannot be composed in memory (e.g. `num_steps = 10**12`) is
refused before anything is written, and so is a physical batch P above the cap
B rounded up to a power of two.

## A full disk

A write that fails (no space left on device) ends the run with one line and
exit code 1, whichever file it was: a checkpoint, `metrics.jsonl`, the
TensorBoard events, `config.json`, `private/seed.json`, `audit.json`, the lock
file, or an export. Nothing partial is left: files are replaced atomically,
the metrics and events are cut back to the last checkpoint's flush, a failed
checkpoint's temporary directory is removed and the previous checkpoint stays
valid, and an export is staged and removed. Free space and rerun the same
command to resume.

## Non-finite examples

An example whose loss or gradient is not finite contributes exactly zero and
is counted (`nonprivate_num_nonfinite_examples` in metrics.jsonl, never
printed). The run goes on: it stops only on non-finite *parameters* (at the
next logged or saved step, keeping its last checkpoint), never on a count of
the private data (docs/threat_model.md, "What may change a run's course").
Non-finite features, and features beyond the public bound
`data.max_abs_feature` after the preprocessing, are refused when the data is
opened.
"""


def _message(fn) -> str:
  try:
    fn()
    return '(accepted)'
  except ValueError as e:
    return ' '.join(str(e).split()).replace('|', '/')


def document() -> str:
  """docs/errors.md: every case of this file with the message dpjax gives."""
  import tempfile  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  from dpjax.trainer.commands import cli
  from dpjax.trainer.configuration import config_fields  # pylint: disable=import-outside-toplevel

  out = [_INTRO, '## Your data', '', '| data (an .npz) | message |', '|---|---|']
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    for name, replace, _ in DATA_CASES:
      path = _digits_npz(tmp / f'{name}.npz', **replace)
      text = _message(lambda: train.train_and_evaluate(_npz_config(path), str(tmp / 'w')))
      out.append(f'| {name.replace("_", " ")} | {text.replace(str(tmp) + "/", "")} |')
    out += ['', '## Your config file', '', '| the config file does | message |', '|---|---|']
    for body, _ in CONFIG_FILE_CASES:
      path = _config_file(tmp, body)
      text = _message(lambda: config_fields.validate(cli.load_config_file(path)))
      out.append(f'| `{body.strip()}` | {text.replace(str(tmp) + "/", "")} |')
    text = _message(lambda: cli.load_config_file('digits_mlp:runlcoal'))
    out.append(f'| `--config digits_mlp:runlcoal` | {text.replace(REPO + os.sep, "")} |')
  out += [
    '',
    '## Command line',
    '',
    '| bad input | message (the line after "dpjax.train: error: ") |',
    '|---|---|',
  ]
  for args, message in CLI_CASES:
    shown = args if isinstance(args, str) else ' '.join(args)
    out.append(f'| `{shown}` | matches `{message}` |')
  out += ['', '## Config fields', '', '| bad input | message |', '|---|---|']
  for overrides, _ in CONFIG_CASES:
    with tempfile.TemporaryDirectory() as work:
      text = _message(lambda: train.train_and_evaluate(small_config(**overrides), work))
    given = ', '.join(f'`{k}={v!r}`' for k, v in overrides.items())
    out.append(f'| {given} | {text} |')
  return '\n'.join(out) + '\n'


# --------------------------------------------------------------------------------------------
# Issue 25: a new user's own data, config files, resumes, interruptions and surprises.
# --------------------------------------------------------------------------------------------


def _digits_npz(path, **replace):
  from dpjax.data import digits  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  x_train, y_train, x_test, y_test = digits.load_digits_arrays()
  arrays = dict(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
  arrays.update({k: (v(arrays[k]) if callable(v) else v) for k, v in replace.items()})
  np.savez(path, **arrays)
  return str(path)


def _npz_config(path, **overrides):
  """small_config on the .npz `path`, its 10 classes declared (npz labels are private)."""
  return small_config(
    **{'data.source': 'npz', 'data.path': path, 'data.num_classes': 10, **overrides}
  )


def _at(row, value):
  import numpy as np  # pylint: disable=import-outside-toplevel

  return lambda y: np.where(np.arange(len(y)) == row, value, y)


# (name, the npz's replaced arrays, regex of the one line). Each trained "successfully" before.
DATA_CASES = [
  (
    'fractional_label',
    dict(
      y_train=lambda y: (
        y.astype(float) + 0.5 * (y == y[3]) * (__import__('numpy').arange(len(y)) == 3)
      )
    ),
    r'y_train: label 3.5 in row 3 is not an integer',
  ),
  ('negative_label', dict(y_train=_at(5, -1)), r'y_train: label -1 in row 5 is negative'),
  ('lengths_differ', dict(y_train=lambda y: y[:-1]), r'1437 examples but 1436 labels'),
  ('all_nan', dict(x_train=lambda x: x * float('nan')), r'x_train: example 0 has a non-finite'),
  (
    'one_inf_pixel',
    dict(
      x_train=lambda x: __import__('numpy').where(
        __import__('numpy').arange(x.size).reshape(x.shape) == 64 * 9 + 3, float('inf'), x
      )
    ),
    r'x_train: example 9 has a non-finite feature value \(inf\)',
  ),
  (
    'absurd_feature',
    dict(
      x_train=lambda x: (
        x
        * __import__('numpy').where(__import__('numpy').arange(len(x)) == 4, 1e30, 1.0)[
          :, None, None, None
        ]
      )
    ),
    r'x_train: example 4 has the feature value .* beyond the public bound',
  ),
  (
    'stray_label_id',
    dict(y_train=_at(7, 1_000_000)),
    r'y_train: label 1000000 in row 7 is not in \[0, 10\) \(data.num_classes = 10',
  ),
  ('class_only_in_test', dict(y_test=_at(2, 10)), r'y_test: label 10 in row 2 is not in \[0, 10\)'),
  (
    'other_test_shape',
    dict(x_test=lambda x: x.reshape(len(x), 64)),
    r'x_test: rows have shape \(64,\) but the training rows',
  ),
  ('string_labels', dict(y_train=lambda y: y.astype(str)), r'labels have dtype <U\d+'),
]


@pytest.mark.slow
@pytest.mark.parametrize('name, replace, message', DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_malformed_data_is_one_line_before_any_change(tmp_path, name, replace, message):
  path = _digits_npz(tmp_path / f'{name}.npz', **replace)
  work = tmp_path / 'work'
  with pytest.raises(ValueError, match=message) as info:
    train.train_and_evaluate(_npz_config(path), str(work))
  assert path in str(info.value) and '\n' not in str(info.value)
  assert unsettable_names(str(info.value)) == []
  assert not work.exists()


@pytest.mark.slow
def test_a_npy_file_as_npz_and_a_declared_class_count(tmp_path):
  import numpy as np  # pylint: disable=import-outside-toplevel

  np.save(tmp_path / 'x.npy', np.zeros((4, 3)))
  with pytest.raises(ValueError, match=r'a single .npy array, not an .npz archive'):
    train.train_and_evaluate(_npz_config(str(tmp_path / 'x.npy')), str(tmp_path / 'w'))
  path = _digits_npz(tmp_path / 'ok.npz')  # 10 classes in the data, 9 declared: refused.
  with pytest.raises(ValueError, match=r'label 9 in row \d+ is not in \[0, 9\)'):
    train.train_and_evaluate(_npz_config(path, **{'data.num_classes': 9}), str(tmp_path / 'w'))


@pytest.mark.slow
def test_the_scale_is_derived_from_the_dtype_and_printed(tmp_path, capsys, monkeypatch):
  """data.scale = 0 (the default): uint8 data is divided by 255, not by digits' 16. The run
  stops once it has printed its start (where the scale is stated), before its loop compiles
  anything: a 1-step run compiled uint8 programs of this test alone (~3 s of CPU) to print the
  same lines."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from dpjax.trainer.loop import training_loop  # pylint: disable=import-outside-toplevel

  class Started(Exception):
    pass

  def stop(*args, **kwargs):
    raise Started

  path = _digits_npz(
    tmp_path / 'u8.npz',
    x_train=lambda x: (x * 15).astype(np.uint8),
    x_test=lambda x: (x * 15).astype(np.uint8),
  )
  monkeypatch.setattr(training_loop.Loop, 'run', stop)
  with pytest.raises(Started):
    train.train_and_evaluate(_npz_config(path, num_steps=1), str(tmp_path / 'w'))
  assert (
    'x = (raw / 255 − (0.5)) / (0.5) [scale: data.scale = 0: derived from the uint8 data]'
    in capsys.readouterr().out
  )


def _config_file(tmp_path, body):
  path = tmp_path / 'my_config.py'
  path.write_text(
    'from dpjax.configs import digits_mlp\n\n\ndef get_config(arg=None):\n'
    '  c = digits_mlp.get_config(arg)\n' + body + '  return c\n'
  )
  return str(path)


# (what the user's config file does, regex of the one line). Silent or a traceback before.
CONFIG_FILE_CASES = [
  (
    '  c.privacy.target_epislon = 1.0\n',
    r'privacy.target_epislon: not a field.*Did you mean privacy.target_epsilon\?',
  ),
  ('  c.privacy.detla = 1e-6\n', r'privacy.detla: not a field.*Did you mean privacy.delta\?'),
  (
    '  c.sampler.batchsize = 64\n',
    r'sampler.batchsize: not a field.*Did you mean sampler.batch_size\?',
  ),
  ('  c.num_steps = 10.0\n', r"Could not override field 'num_steps'"),
  (
    '  c.max_nonfinite_fraction = 0.01\n',
    r'max_nonfinite_fraction: this field was removed: '
    r'.*data.max_abs_feature',
  ),
  (
    '  raise RuntimeError("my bug")\n',
    r"get_config\(\) in .*my_config.py' raised "
    r'RuntimeError: my bug',
  ),
  ('  c = {"seed": 1}\n', r'returned a dict, not an ml_collections.ConfigDict'),
]


@pytest.mark.parametrize(
  'body, message',
  CONFIG_FILE_CASES,
  ids=[b.strip().split('=')[0].split('(')[0] for b, _ in CONFIG_FILE_CASES],
)
def test_config_file_mistakes_are_one_line(tmp_path, body, message):
  from dpjax.trainer.commands import cli
  from dpjax.trainer.configuration import config_fields  # pylint: disable=import-outside-toplevel

  with pytest.raises(ValueError, match=message) as info:
    config_fields.validate(cli.load_config_file(_config_file(tmp_path, body)))
  assert '\n' not in str(info.value) and unsettable_names(str(info.value), given=body) == []


def test_an_unknown_config_argument_is_refused(tmp_path):
  from dpjax.trainer.commands import cli  # pylint: disable=import-outside-toplevel

  with pytest.raises(ValueError, match=r"argument 'runlcoal' is unknown; valid: runlocal"):
    cli.load_config_file('digits_mlp:runlcoal')
  path = tmp_path / 'plain.py'  # A user's config that takes no argument at all.
  path.write_text(
    'from dpjax.trainer import config_fields\n\n\ndef get_config(arg=None):\n'
    '  return config_fields.default_config()\n'
  )
  with pytest.raises(ValueError, match=r"the argument 'runlocal' changes nothing"):
    cli.load_config_file(f'{path}:runlocal')


def test_a_config_whose_get_config_takes_no_argument_loads(tmp_path):
  """ml_collections' idiom `def get_config():` was refused ('get_config(None) … raised
  TypeError: get_config() takes 0 positional arguments but 1 was given'); an argument given to
  it is still refused in one line."""
  from dpjax.trainer.commands import cli  # pylint: disable=import-outside-toplevel

  path = tmp_path / 'zero_args.py'
  path.write_text(
    'from dpjax.trainer import config_fields\n\n\ndef get_config():\n'
    '  c = config_fields.default_config()\n  c.num_epochs = 3\n  return c\n'
  )
  assert cli.load_config_file(str(path)).num_epochs == 3
  with pytest.raises(ValueError, match=r"get_config\('runlocal'\) in .* raised TypeError"):
    cli.load_config_file(f'{path}:runlocal')


@pytest.mark.slow
def test_configs_work_from_any_directory_and_help_exits_0(command_line_errors, capsys):
  """The repository's configs imported `from configs import ...` and failed outside its root;
  `dpjax.train --help` exited 1 and -h was an error; a workdir could not be resumed alone.
  The two runs (`_from_any_directory`) are processes forked by `_run_command_lines`."""
  from dpjax import configs
  from dpjax.trainer.commands import cli  # pylint: disable=import-outside-toplevel

  assert (
    cli.resolve_config_spec('digits_mlp:runlocal') == configs.path_of('digits_mlp') + ':runlocal'
  )
  started, resumed = command_line_errors['from_any_directory']
  assert started['returncode'] == 0 and 'Final: step 1' in started['stdout'], started['stderr']
  assert resumed['returncode'] == 0 and 'Resuming from step 1' in resumed['stdout'], resumed
  for flag in ('--help', '-h'):
    with pytest.raises(SystemExit) as info:
      train.parse_flags(['dpjax.train', flag])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert '--workdir' in out and '--config' in out and 'resume' in out


@pytest.mark.slow
@pytest.mark.parametrize(
  'overrides, refused',
  [
    ({'optimizer.name': 'adam', 'optimizer.learning_rate': 1e-3}, 'optimizer state differ'),
    ({'optimizer.momentum': 0.9}, 'optimizer state differ'),
    ({'model.hidden_sizes': (32,)}, 'model parameters differ'),
    ({'optimizer.schedule': 'cosine'}, None),  # Same state structure: allowed, resumes.
  ],
)
def test_a_changed_model_or_optimizer_is_refused_and_the_checkpoint_kept(
  reference_run, tmp_path, overrides, refused
):
  """A state that does not fit the checkpoint was renamed *.unreadable-* as if corrupt and the
  run restarted at step 0; now: one line naming what differs, the workdir byte-identical.
  (A copy of the session's reference run, checkpoints 2, 4, 6; it was a 2-step run of its
  own.)"""
  import shutil  # pylint: disable=import-outside-toplevel

  work = tmp_path / 'copy'
  shutil.copytree(reference_run[0], work)
  config = small_config(**{'num_steps': 7, **overrides})
  if refused is None:
    assert train.train_and_evaluate(config, str(work))['step'] == 7
    return
  before = tree_digest(work)
  with pytest.raises(
    ValueError,
    match=f'checkpoint 6 .* holds a state of another structure.*'
    f'{refused}.*the checkpoint is untouched',
  ) as info:
    train.train_and_evaluate(config, str(work))
  assert '\n' not in str(info.value)
  assert tree_digest(work) == before


@pytest.mark.slow
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(tmp_path):
  import signal  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  proc = subprocess.Popen(  # Calibrating σ for balls-and-bins takes seconds: interrupt it.
    [
      sys.executable,
      '-m',
      'dpjax.train',
      '--config=digits_mlp',
      f'--workdir={tmp_path / "w"}',
      '--config.sampler.name=balls_and_bins',
      '--config.privacy.random_allocation_timeout=600',
    ],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=dict(os.environ, JAX_PLATFORMS='cpu', DPJAX_CACHE_DIR=str(tmp_path / 'cache')),
  )
  time.sleep(6)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err
  lines = [line for line in err.strip().splitlines() if not line.startswith('dpjax: building')]
  assert len(lines) == 1 and 'interrupted (Ctrl-C)' in lines[0] and 'Traceback' not in err


@pytest.mark.slow
def test_sizes_that_cannot_fit_and_unwritable_caches(tmp_path, monkeypatch, capsys):
  with pytest.raises(
    ValueError,
    match=r'not reached even with σ = 10000 \(or its privacy loss '
    r'cannot be composed in memory\)',
  ):
    train.train_and_evaluate(
      small_config(
        **{'num_steps': 10**12, 'privacy.noise_multiplier': None, 'privacy.target_epsilon': 3.0}
      ),
      str(tmp_path / 'w'),
    )
  with pytest.raises(ValueError, match=r'num_steps = 1000000000000: composing the privacy loss'):
    train.train_and_evaluate(small_config(num_steps=10**12), str(tmp_path / 'w'))
  assert not (tmp_path / 'w').exists()
  from dpjax.trainer.loop import compilation_cache  # pylint: disable=import-outside-toplevel

  monkeypatch.setenv('HOME', '/proc/dpjax-no-home')
  monkeypatch.delenv('DPJAX_CACHE_DIR', raising=False)
  assert compilation_cache.resolve_cache_dir('') is not None
  with pytest.raises(ValueError, match=r"compilation_cache_dir = '/proc/x': .* cannot be created"):
    compilation_cache.enable_compilation_cache('/proc/x')
  import jax  # pylint: disable=import-outside-toplevel

  saved = jax.config.jax_compilation_cache_dir
  try:
    assert compilation_cache.enable_compilation_cache('') is None  # Falls back: no cache.
  finally:
    jax.config.update('jax_compilation_cache_dir', saved)
    jax.config.update('jax_enable_compilation_cache', True)
  assert 'compiling without a persistent cache' in capsys.readouterr().err


@pytest.mark.slow
def test_surprising_runs_are_flagged_and_a_workdir_reports_its_epsilon(tmp_path, capsys):
  """σ = 0.3 gave ε = 297 silently; C = 1e-30 trained to chance silently; the account CLI could
  not read a workdir."""
  train.train_and_evaluate(
    small_config(**{'num_steps': 2, 'privacy.noise_multiplier': 0.35, 'privacy.clip_norm': 1e-30}),
    str(tmp_path / 'w'),
  )
  out = capsys.readouterr().out
  assert 'WARNING: the final ε = ' in out and 'is above 10' in out
  assert 'WARNING: every example was clipped in steps 1-2, at C = 1e-30' in out
  from dpjax import account  # pylint: disable=import-outside-toplevel

  assert account.main(['--workdir', str(tmp_path / 'w'), '--json']) == 0
  import json  # pylint: disable=import-outside-toplevel

  report = json.loads(capsys.readouterr().out)
  assert report['steps'] == 2 and report['epsilon'] > 10 and report['bound'] == 'upper'


if __name__ == '__main__':
  import contextlib  # pylint: disable=import-outside-toplevel
  import io  # pylint: disable=import-outside-toplevel

  with contextlib.redirect_stdout(io.StringIO()):  # The trainer's start lines.
    text = document()
  sys.stdout.write(text)


def test_docs_config_md_is_generated_from_the_field_declarations():
  """docs/config.md is `python -m dpjax.trainer.configuration.config_fields` (one declaration per field)."""
  with open(os.path.join(REPO, 'docs', 'config.md')) as f:
    assert f.read() == config_fields.markdown(), (
      'regenerate: python -m dpjax.trainer.configuration.config_fields'
    )
