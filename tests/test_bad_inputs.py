"""Every bad input gets one clear line before any compute, and leaves the workdir as it was.

In-process cases call `train.train_and_evaluate` on a config with one bad
field: a ValueError naming the field and its valid range, raised before
anything in the workdir changes. Subprocess cases check what only a command
line shows: exit code 2, one line on stderr, no traceback. docs/errors.md
lists every case with its message (`python -m tests.test_bad_inputs` prints
that table).
"""

import math
import os
import subprocess
import sys

import pytest

from dpjax import train
from tests.run_configs import small_config
from tests.run_configs import tree_digest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INF, NAN = math.inf, math.nan

# (overrides, regex the message must match). Each names the field and its valid range.
CONFIG_CASES = [
    ({'seed': -1}, r'seed = -1: must be an integer in \[0, \d+\] or None'),
    ({'data.source': 'imagenet'}, r"data.source = 'imagenet': must be one of 'digits'"),
    ({'data.label_format': 'onehot'}, r"data.label_format = 'onehot': must be one of 'int'"),
    ({'data.scale': 0.0}, r'data.scale = 0.0: must be a finite number > 0'),
    ({'data.scale': NAN}, r'data.scale = nan: must be a finite number > 0'),
    ({'data.std': (0.0,)}, r'data.std = \(0.0,\): must be a tuple of finite numbers, each > 0'),
    ({'data.num_classes': 1}, r'data.num_classes = 1: must be an integer >= 2'),
    ({'data.input_shape': (0, 8)}, r'data.input_shape = \(0, 8\): must be a tuple of integers, '
                                   r'each >= 1'),
    ({'data.source': 'npz'}, r"data.path = '':? must name an existing .npz file"),
    ({'data.source': 'memmap', 'data.path': '/nonexistent'}, r"data.path = '/nonexistent':? must "
                                                             r'be an existing directory'),
    ({'data.source': 'tfds'}, r'data.name must name a TFDS dataset'),
    ({'sampler.name': 'poison'}, r"sampler.name = 'poison': must be one of 'poisson'"),
    ({'sampler.batch_size': 0}, r'sampler.batch_size = 0: must be an integer >= 1'),
    ({'sampler.batch_size': 5000}, r'sampler.batch_size = 5000 must be in \[1, N = 1437\]'),
    ({'sampler.physical_batch_size': -1}, r'sampler.physical_batch_size = -1: must be an integer >= 0'),
    ({'sampler.max_batch_size': -1}, r'sampler.max_batch_size = -1: must be an integer >= 0'),
    ({'sampler.max_batch_size': 100}, r'sampler.max_batch_size = 100: must be 0 \(auto\) or a '
                                      r'multiple of sampler.physical_batch_size = 32'),
    ({'privacy.clip_norm': 0.0}, r'privacy.clip_norm = 0.0: must be a finite number > 0 .*'
                                 r'privacy.enabled=False'),
    ({'privacy.clip_norm': -1.0}, r'privacy.clip_norm = -1.0: must be a finite number > 0'),
    ({'privacy.clip_norm': INF}, r'privacy.clip_norm = inf: must be a finite number > 0'),
    ({'privacy.clip_norm': NAN}, r'privacy.clip_norm = nan: must be a finite number > 0'),
    ({'privacy.noise_multiplier': 0.0}, r'privacy.noise_multiplier = 0.0: must be a finite number '
                                        r'> 0 or None .*privacy.enabled=False'),
    ({'privacy.noise_multiplier': -1.0}, r'privacy.noise_multiplier = -1.0: must be a finite'),
    ({'privacy.noise_multiplier': INF}, r'privacy.noise_multiplier = inf: must be a finite'),
    ({'privacy.noise_multiplier': NAN}, r'privacy.noise_multiplier = nan: must be a finite'),
    ({'privacy.target_epsilon': -1.0}, r'privacy.target_epsilon = -1.0: must be a finite number '
                                       r'>= 0'),
    ({'privacy.target_epsilon': INF}, r'privacy.target_epsilon = inf: must be a finite number'),
    ({'privacy.delta': 0.0}, r'privacy.delta = 0.0: must be a finite number in \(0, 1\)'),
    ({'privacy.delta': 1.0}, r'privacy.delta = 1.0: must be a finite number in \(0, 1\)'),
    ({'privacy.delta': 1.5}, r'privacy.delta = 1.5: must be a finite number in \(0, 1\)'),
    ({'privacy.delta': 0.5}, r'privacy.delta = 0.5 is >= 1/N = 0.000696 \(N = 1437\).*'
                             r'privacy.allow_large_delta = True'),
    ({'privacy.delta': 1 / 1437}, r'privacy.delta = 0.000695894 is >= 1/N'),
    ({'privacy.accountant': 'moments'}, r"privacy.accountant = 'moments': must be one of 'auto'"),
    ({'privacy.accountant': 'monte_carlo'}, r"privacy.accountant = 'monte_carlo' is not supported "
                                            r"for sampler 'poisson'"),
    ({'privacy.group_size': 0}, r'privacy.group_size = 0: must be an integer >= 1'),
    ({'privacy.monte_carlo_workers': 0}, r'privacy.monte_carlo_workers = 0: must be an integer '
                                         r'>= 1'),
    ({'privacy.clipping': 'fast'}, r"privacy.clipping = 'fast': must be one of 'auto'"),
    ({'privacy.noise_multiplier': None}, r'privacy.noise_multiplier or privacy.target_epsilon must '
                                         r'be set'),
    ({'privacy.noise_multiplier': 0.3, 'privacy.target_epsilon': 1.0},
     r'would reach ε = \d+\.\d+ .*above privacy.target_epsilon = 1'),
    ({'optimizer.name': 'lamb'}, r"optimizer.name = 'lamb': must be one of 'sgd', 'adam'"),
    ({'optimizer.learning_rate': 0.0}, r'optimizer.learning_rate = 0.0: must be a finite number '
                                       r'> 0'),
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
    ({'augmult.num_views': 4, 'augmult.crop_padding': 8},
     r'augmult.crop_padding = 8: must be < min\(H, W\) = 8'),
    ({'augmult.num_views': -1}, r'augmult.num_views = -1: must be an integer >= 0'),
    ({'audit.num_canaries': -1}, r'audit.num_canaries must be an integer >= 0'),
    ({'audit.kind': 'loss'}, r"audit.kind = 'loss'; valid: "),
    ({'model.name': 'resnet'}, r"config.model.name='resnet' is not a model"),
    ({'model.activation': 'swish'}, r"config.model.activation='swish'"),
]


def test_there_are_at_least_forty_cases():
  assert len(CONFIG_CASES) + len(CLI_CASES) >= 40


@pytest.mark.parametrize('overrides, message', CONFIG_CASES,
                         ids=[','.join(f'{k}={v}' for k, v in o.items()) for o, _ in CONFIG_CASES])
def test_bad_config_field_is_one_clear_error_before_any_change(tmp_path, overrides, message):
  work = tmp_path / 'work'
  work.mkdir()
  (work / 'notes.txt').write_text('a file the user keeps here')
  before = tree_digest(work)
  with pytest.raises(ValueError, match=message) as info:
    train.train_and_evaluate(small_config(**overrides), str(work))
  assert '\n' not in str(info.value).strip() or 'TFDS' in str(info.value)
  assert tree_digest(work) == before and sorted(os.listdir(work)) == ['notes.txt']


def test_non_private_run_ignores_privacy_fields(tmp_path):
  """σ = 0 and C = inf are errors only under privacy.enabled=True."""
  result = train.train_and_evaluate(small_config(**{
      'privacy.enabled': False, 'privacy.noise_multiplier': 0.0, 'privacy.clip_norm': INF,
      'num_steps': 2}), str(tmp_path))
  assert 'privacy' not in result and result['step'] == 2


# (extra command-line arguments, regex of the one stderr line). Through a subprocess: the exit
# code and the single line are the point.
CLI_CASES = [
    (['--config.foo=1'], r"--config.foo: the config has no field 'foo'"),
    (['--config.privacy.nois_multiplier=1'], r'Did you mean --config.privacy.noise_multiplier\?'),
    (['--config.num_steps=abc'], r'--config.num_steps=abc'),
    (['--config.privacy.noise_multiplier=0'], r'privacy.noise_multiplier = 0.0: must be'),
    (['--config.privacy.clip_norm=inf'], r'privacy.clip_norm = inf: must be'),
    (['--num_processes=2'], r'only apply with --distributed'),
    ('missing_config', r"no such file .*missing.py"),
    ('broken_config', r'syntax error at line 1'),
    ('workdir_is_file', r'is a file, not a directory'),
    ('workdir_unwritable', r'not writable'),
]


@pytest.mark.parametrize('args, message', CLI_CASES,
                         ids=[a if isinstance(a, str) else a[0] for a, _ in CLI_CASES])
def test_command_line_error_is_one_line_with_exit_code_2(tmp_path, args, message):
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
  proc = subprocess.run(
      [sys.executable, '-m', 'dpjax.train', f'--config={config}', f'--workdir={workdir}', *args],
      cwd=REPO, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS='cpu'),
      timeout=120)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('dpjax.train: error: '), proc.stderr
  assert 'Traceback' not in proc.stderr
  import re  # pylint: disable=import-outside-toplevel
  assert re.search(message, lines[0]), lines[0]
  if args == [] and workdir.endswith('/w') and not (tmp_path / 'w').is_file():
    assert not os.path.exists(workdir)


def error_table() -> str:
  """docs/errors.md's table: each bad config field and the message dpjax gives."""
  rows = ['| bad input | message (one line, exit code 2 from the CLI) |', '|---|---|']
  import tempfile  # pylint: disable=import-outside-toplevel
  for overrides, _ in CONFIG_CASES:
    with tempfile.TemporaryDirectory() as work:
      try:
        train.train_and_evaluate(small_config(**overrides), work)
        text = '(accepted)'
      except ValueError as e:
        text = ' '.join(str(e).split())
    given = ', '.join(f'`{k}={v!r}`' for k, v in overrides.items())
    rows.append(f'| {given} | {text.replace("|", "/")} |')
  return '\n'.join(rows)


if __name__ == '__main__':
  print(error_table())
