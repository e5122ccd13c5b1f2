"""What may change a run's course: only quantities ε covers, or public ones (issue 34 item 3).

The attack: neighbouring training sets D and D minus one record; what can an observer of the
release tell? `max_nonfinite_fraction` stopped a run on the exact count of examples with a
non-finite loss or gradient, so with one such record the run ended without a model and
without it the run finished: the release event itself was a function of one record.
"""

import json
import re

import numpy as np
import pytest

from dpjax import train
from dpjax.data import validation as data_validation
from dpjax.trainer.workdir import checkpoints
from dpjax.trainer.commands import cli
from dpjax.trainer.configuration import config_fields
from tests.run_configs import small_config

NUM_ROWS = 800


def _regression_npz(path, outlier_target=None):
  """N = 800 rows of y = x·w (+ one row whose target is `outlier_target`, when given)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(NUM_ROWS + 100, 8)).astype(np.float32)
  y = (x @ rng.normal(size=8)).astype(np.float32)
  x_train, y_train = x[:NUM_ROWS], y[:NUM_ROWS]
  if outlier_target is not None:  # Finite in float32; its squared error is not.
    x_train = np.concatenate([x_train, x[:1]])
    y_train = np.concatenate([y_train, np.float32([outlier_target])])
  np.savez(path, x_train=x_train, y_train=y_train, x_test=x[NUM_ROWS:], y_test=y[NUM_ROWS:])
  return str(path)


def _course(tmp_path, name, capsys, outlier_target=None):
  """(result step, checkpoint steps, logged steps, what was printed, non-finite counts)."""
  path = _regression_npz(tmp_path / f'{name}.npz', outlier_target)
  work = tmp_path / name
  # Two steps, b = 256 of N = 800 (the record is sampled at step 2 with seed 0); vmap clipping
  # traces faster than the default ghost clipping, and the course does not depend on it.
  result = train.train_and_evaluate(
    small_config(
      **{
        'loss': 'mse',
        'data.source': 'npz',
        'data.path': path,
        'num_steps': 2,
        'sampler.batch_size': 256,
        'log_every_steps': 1,
        'eval_every_steps': 1000,
        'privacy.clipping': 'vmap',
      }
    ),
    str(work),
  )
  rows = [json.loads(line) for line in open(work / 'metrics.jsonl')]
  printed = capsys.readouterr()
  return (
    result['step'],
    [m['step'] for m in checkpoints.read_metadata(str(work))],
    [row['step'] for row in rows],
    printed.out + printed.err,
    sum(row.get('nonprivate_num_nonfinite_examples', 0) for row in rows),
  )


@pytest.mark.slow
def test_a_record_with_a_non_finite_loss_does_not_change_the_course(tmp_path, capsys):
  """D = 800 regression rows + one whose target is 1e30 (its squared error overflows: a
  non-finite loss and gradient, dropped with zero contribution) against D minus that record:
  both runs finish at the same step with the same checkpoints and logged steps, and nothing
  printed states the count. Fails on da06065: the run on D stopped at step 1 with
  TooManyNonFinite ("1 of 274 examples since the start had a non-finite loss ..."), without
  a checkpoint."""
  with_record = _course(tmp_path, 'with', capsys, outlier_target=1e30)
  without = _course(tmp_path, 'without', capsys)
  assert with_record[4] >= 1 and without[4] == 0  # The record was sampled, and dropped.
  assert with_record[:3] == without[:3] == (2, [2], [0, 1, 2])
  for printed in (with_record[3], without[3]):
    assert not re.search(r'non-?finite', printed, re.IGNORECASE), printed
    assert printed.count('Final: step 2, ') == 1


@pytest.mark.slow
def test_an_absurd_feature_is_refused_before_training(tmp_path):
  """The issue's record: one digits image with pixels × 1e30 (finite in float32). It is
  outside the public domain (|x| ≤ data.max_abs_feature after the preprocessing), so it is
  refused when the data is opened, with one line, before anything is written; its neighbour
  without it trains (above). Fails on da06065: the run trained, and stopped at step 2 on the
  count of non-finite gradients, printing it ("1 of 242 examples ...")."""
  from dpjax.data import digits  # pylint: disable=import-outside-toplevel

  x_train, y_train, x_test, y_test = digits.load_digits_arrays()
  x_train = np.concatenate([x_train[:NUM_ROWS], x_train[:1] * 1e30]).astype(np.float32)
  y_train = np.concatenate([y_train[:NUM_ROWS], y_train[:1]])
  path = str(tmp_path / 'outlier.npz')
  np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
  work = tmp_path / 'w'
  with pytest.raises(
    ValueError,
    match=rf'x_train: example {NUM_ROWS} has the feature value '
    r'.*beyond the public bound ±1e\+06 '
    r'\(data.max_abs_feature\)',
  ) as info:
    train.train_and_evaluate(
      small_config(
        **{'data.source': 'npz', 'data.path': path, 'data.num_classes': 10, 'num_steps': 20}
      ),
      str(work),
    )
  assert '\n' not in str(info.value) and not work.exists()


def test_the_feature_bound_is_applied_after_the_preprocessing():
  """|(raw / scale − mean) / std| ≤ bound, closed form: raw = 16 at scale 16, mean 0.5, std
  0.5 is 1.0 (inside a bound of 1), raw = 16 + 1e-4 just outside; NaN and inf are outside.
  Fails on da06065: check_feature_bound does not exist (the feature is new)."""
  transform = lambda raw: (np.asarray(raw, np.float32) / 16 - 0.5) / 0.5
  inside = np.float32([[0.0, 16.0], [8.0, 0.0]])
  data_validation.check_feature_bound('x', inside, transform, 1.0)
  for bad in (16.01, np.nan, np.inf, -np.inf):
    x = inside.copy()
    x[1, 1] = bad
    with pytest.raises(data_validation.DataError, match=r'x: example 1 has the feature value '):
      data_validation.check_feature_bound('x', x, transform, 1.0)


def test_the_run_stops_on_the_parameters_alone():
  """The stop rule is a function of the released parameters: a NaN or inf, or ‖θ‖² beyond
  float32's largest value (3.4e38): 1e19 is inside, 2e19 (‖θ‖² = 4e38) outside. Fails on
  da06065: the rule read the training loss (and the count) and had no such function."""
  from dpjax.trainer.loop import stops  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  tree = lambda v: {'w': jnp.ones((3,), jnp.float32), 'b': jnp.float32([v])}
  assert [bool(stops.parameters_diverged(tree(v))) for v in (1.0, 1e19, 2e19, np.nan, -np.inf)] == [
    False,
    False,
    True,
    True,
    True,
  ]


def test_max_nonfinite_fraction_is_refused_naming_what_replaced_it():
  """A config (or a --config. override) that still sets the field gets one line saying why it
  went and what replaced it, not a silent ignore nor a bare "not a field". Fails on da06065:
  the field existed and stopped runs on the count."""
  config = config_fields.default_config()
  config.max_nonfinite_fraction = 0.01
  with pytest.raises(
    config_fields.ConfigError,
    match=r'max_nonfinite_fraction: this field was '
    r'removed: .*data.max_abs_feature',
  ) as info:
    config_fields.validate(config)
  assert '\n' not in str(info.value)
  message = cli.config_override_error(
    ['--config=digits_mlp', '--config.max_nonfinite_fraction=0.1']
  )
  assert message is not None and 'this field was removed' in message
  assert 'stops only on non-finite parameters' in message
