"""N on the card: exact and treated as public, or a declared public bound (issue 34 item 4).

Under add/remove neighbours N alone decides membership. On da06065 the card carried the exact
N while dpjax said "no statistics of the private data", and there was no way to keep N
private. The tests below use the new field `data.public_num_examples`, so on da06065 they fail
on the missing field (checked): the field is the feature.
"""

import math
import types

from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
import numpy as np
import pytest

from dpjax import export
from dpjax.data import digits
from dpjax.privacy import samplers
from dpjax.privacy import sharding
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.trainer.loop import chunks
from dpjax.trainer.planning import plan as plan_lib
from dpjax.trainer.workdir import privacy_metadata
from dpjax.trainer.loop import run_report
from tests.run_configs import small_config


def _release(tmp_path, rows: int, bound: int):
  """The privacy card and the start lines of a run on the first `rows` digits rows."""
  x_train, y_train, x_test, y_test = digits.load_digits_arrays()
  path = tmp_path / f'd{rows}.npz'
  np.savez(path, x_train=x_train[:rows], y_train=y_train[:rows], x_test=x_test, y_test=y_test)
  config = small_config(
    **{
      'data.source': 'npz',
      'data.path': str(path),
      'data.num_classes': 10,
      'data.public_num_examples': bound,
      'privacy.accountant': 'rdp',
    }
  )  # 3x faster than pld here.
  train_source, _ = plan_lib.make_training_sources(config)
  plan = plan_lib.make_plan(config, train_source, seed=0)
  lines = []
  run_report.announce(
    plan, str(tmp_path), train_source, sharding.make_mesh(1), {'w': np.zeros(3)}, log=lines.append
  )
  step_fns = types.SimpleNamespace(  # What the metadata reads of the step that ran.
    noise_multiplier=plan.privacy.noise_multiplier,
    clip_norm=plan.privacy.clip_norm,
    privatizer=plan.privacy.mechanism(),
  )
  report = plan.privacy.accountant.epsilon_at(plan.num_steps, estimates=False)
  meta = privacy_metadata.privacy_metadata(
    plan.num_steps, report, plan, step_fns, chunks.make_batcher(plan), 0
  )
  return export.privacy_card(meta), [line.replace(str(path), '<data>') for line in lines]


@pytest.mark.slow
def test_with_a_public_bound_the_card_of_d_and_d_minus_one_row_are_identical(tmp_path):
  """The attack: D = the 1437 digits rows, D' = D minus its last row.

  N treated as public (the default): the cards differ in num_examples (1437 vs 1436) and,
  through q = b/N, in ε; the card says N is treated as public. With
  data.public_num_examples = 1500 the cards and the start lines are identical and name
  no exact N: an observer of the release cannot tell D from D'.
  """
  card, _ = _release(tmp_path, 1437, 0)
  card_minus, _ = _release(tmp_path, 1436, 0)
  assert {k for k in card if card[k] != card_minus[k]} == {
    'num_examples',
    'epsilon',
    'guarantee',
    'accounting',
    'float_rounding',
  }
  assert (card['num_examples'], card_minus['num_examples']) == (1437, 1436)
  assert card['exact_num_examples_is_public'] is True
  assert card['num_examples_note'].startswith(
    'num_examples is the exact number of training examples and is treated as public'
  )
  card, lines = _release(tmp_path, 1437, 1500)
  card_minus, lines_minus = _release(tmp_path, 1436, 1500)
  assert card == card_minus and lines == lines_minus
  assert card['num_examples'] == 1500 and card['exact_num_examples_is_public'] is False
  assert card['sampler']['expected_batch_size'] == 128.0  # q·N̄ = b: the public divisor.
  text = repr(card) + '\n'.join(lines)
  assert '1437' not in text and '1436' not in text
  assert 'N ≤ 1500 (data.public_num_examples; the exact N stays private)' in text


def test_a_bounded_poisson_sampler_draws_each_present_row_at_rate_b_over_the_bound():
  """q = b/N̄ for each of the rows present, none beyond them; ε does not depend on the rows
  and matches dp_accounting's Poisson subsampled Gaussian at q = b/N̄."""
  bound, rows, b, steps = 4000, 1500, 400, 200
  sampler = samplers.PoissonSampler(num_examples=bound, batch_size=b, seed=3, num_rows=rows)
  counts = np.zeros(rows)
  for t in range(steps):
    idx = sampler.indices(t)
    counts[idx] += 1
  q = b / bound
  total = counts.sum()  # Binomial(rows · steps, q).
  assert abs(total - rows * steps * q) < 5 * math.sqrt(rows * steps * q * (1 - q))
  assert sampler.sampling_probability == q and sampler.expected_batch_size == b
  assert 'num_rows' not in repr(sampler)  # The exact row count is never logged.
  # ε at the bound, independent of the rows; the exact truncated event is off (TV penalty).
  eps = []
  for present in (1, bound):
    acct = accountant_lib.Accountant(
      samplers.PoissonSampler(num_examples=bound, batch_size=b, num_rows=present),
      2.0,
      1e-6,
      max_batch_size=4000,
    )
    assert acct.exact_truncation is False
    eps.append(acct.epsilon(10))
  assert eps[0] == eps[1]
  direct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
  direct.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(2.0)), 10)
  reference = direct.get_epsilon(1e-6)
  assert reference * (1 - 1e-9) <= eps[0] <= reference * 1.01, (eps[0], reference)


@pytest.mark.parametrize('sampler', ['shuffle', 'balls_and_bins', 'fixed_size'])
def test_samplers_whose_batches_depend_on_n_refuse_a_bound(sampler):
  with pytest.raises(
    ValueError,
    match=rf'^data.public_num_examples = 2000 needs sampler.name = '
    rf"'poisson': the {sampler} sampler's batches depend on",
  ):
    plan_lib.make_plan(
      small_config(**{'data.public_num_examples': 2000, 'sampler.name': sampler}), 1437
    )


def _config(**overrides):
  return small_config(**{'privacy.accountant': 'rdp', **overrides})  # Fast accounting.


def test_the_bound_sets_the_epochs_enters_the_fingerprint_and_must_cover_the_rows():
  config = _config(**{'data.public_num_examples': 2560, 'num_steps': 0, 'num_epochs': 2})
  plan = plan_lib.make_plan(config, 1437)
  assert plan.num_steps == 2 * 2560 // 128  # Epochs of ceil(N̄/b) steps, not ceil(N/b).
  assert plan.fingerprint['data.public_num_examples'] == 2560
  assert plan.fingerprint['sampler.num_examples'] == 2560
  with pytest.raises(ValueError, match=r'data.public_num_examples: 2560 → 3000'):
    plan_lib.make_plan(
      _config(**{'data.public_num_examples': 3000, 'num_steps': 0, 'num_epochs': 2}),
      1437,
      plan.fingerprint,
      resumed_step=1,
    )
  exact = plan_lib.make_plan(_config(), 1437)
  assert 'data.public_num_examples' not in exact.fingerprint  # As in older checkpoints.
  with pytest.raises(
    ValueError,
    match=r'^data.public_num_examples = 1436: the training set has '
    r'more examples',
  ):
    plan_lib.make_plan(small_config(**{'data.public_num_examples': 1436}), 1437)
