"""dpjax.trainer.planning.run_warnings: the README's warnings fire exactly at their thresholds, once.

The README promises a line when every example or none was clipped with C 100× below or
above the mean gradient norm, and when the training loss grew 100× from its first value.
Both are statistics of the private data without noise: each line must say 'nonprivate'.
These tests call the function that decides (`RunWarnings.check`) with log rows on either
side of each threshold; until now no test did.
"""

import pytest

from dpjax.trainer.planning import run_warnings


def _row(fraction=0.5, norm=1.0, loss=None):
  row = {'nonprivate_clip_fraction': fraction, 'nonprivate_mean_grad_norm': norm}
  if loss is not None:
    row['nonprivate_train_loss'] = loss
  return row


@pytest.mark.parametrize(
  'clip_norm,fraction,fires',
  [
    (1e-3, 1.0, True),  # C·100 = 0.1 < 1: every example clipped, C far below the norms.
    (1e-2, 1.0, False),  # C·100 = 1 is not below the norm 1: an ordinary recipe.
    (0.0099, 1.0, True),  # Just past the threshold.
    (1e-3, 0.99, False),  # One example in a hundred not clipped: no line.
  ],
)
def test_every_example_clipped_fires_exactly_past_100x_below_the_norm(clip_norm, fraction, fires):
  lines = run_warnings.RunWarnings().check(_row(fraction, norm=1.0), 3, 4, clip_norm)
  if not fires:
    assert lines == []
    return
  assert lines == [
    f'every example was clipped in steps 3-4, at C = {clip_norm:g} while their '
    'mean gradient norm is 1 (nonprivate: not covered by ε): privacy.clip_norm '
    'is far below the gradient norms.'
  ]


@pytest.mark.parametrize(
  'clip_norm,fraction,fires',
  [
    (101.0, 0.0, True),  # C > 100·norm, none clipped: the noise σ·C swamps the gradients.
    (100.0, 0.0, False),  # Exactly 100×: not past the threshold.
    (1e30, 0.01, False),  # One example in a hundred clipped: no line.
    (1e30, 0.0, True),
  ],
)
def test_no_example_clipped_fires_exactly_past_100x_above_the_norm(clip_norm, fraction, fires):
  lines = run_warnings.RunWarnings().check(_row(fraction, norm=1.0), 1, 2, clip_norm)
  if not fires:
    assert lines == []
    return
  assert len(lines) == 1 and lines[0].startswith(
    f'no example was clipped in steps 1-2, at C = {clip_norm:g} while their mean gradient '
    'norm is 1 (nonprivate: not covered by ε)'
  )


def test_clipping_warnings_need_a_private_run_and_statistics():
  warnings = run_warnings.RunWarnings()
  assert warnings.check(_row(1.0, norm=1.0), 1, 2, None) == []  # Not private: no C.
  assert warnings.check({'nonprivate_clip_fraction': 1.0}, 1, 2, 1e-9) == []  # No norm.
  assert warnings.check(_row(1.0, norm=0.0), 1, 2, 1e-9) == []  # Norm 0: no ratio.


def test_each_clipping_warning_is_given_once_and_both_can_be_given():
  warnings = run_warnings.RunWarnings()
  assert len(warnings.check(_row(1.0), 1, 2, 1e-9)) == 1
  assert warnings.check(_row(1.0), 3, 4, 1e-9) == []  # Once.
  assert len(warnings.check(_row(0.0), 5, 6, 1e9)) == 1  # The other kind is its own.
  assert warnings.check(_row(0.0), 7, 8, 1e9) == []


def test_loss_growth_fires_exactly_past_100x_the_first_window():
  warnings = run_warnings.RunWarnings()
  assert warnings.check(_row(loss=2.5), 1, 2, 1.0) == []  # The first window sets the scale.
  assert warnings.check(_row(loss=249.9), 3, 4, 1.0) == []
  assert warnings.check(_row(loss=250.0), 5, 6, 1.0) == []  # Exactly 100×: no line.
  assert warnings.check(_row(loss=250.1), 7, 8, 1.0) == [
    "the training loss grew to 250 by step 8, 100x the first window's (nonprivate: not "
    'covered by ε): the run may be diverging; try a smaller optimizer.learning_rate.'
  ]
  assert warnings.check(_row(loss=1e6), 9, 10, 1.0) == []  # Once.


def test_loss_growth_is_measured_from_the_first_window_not_the_latest():
  """A loss that grows 10× per window passes 100× of the first at the third window, though
  no window is 100× the one before it."""
  warnings = run_warnings.RunWarnings()
  fired = [
    bool(warnings.check(_row(loss=loss), 2 * i + 1, 2 * i + 2, None))
    for i, loss in enumerate((1.0, 10.0, 99.0, 101.0))
  ]
  assert fired == [False, False, False, True]


def test_loss_growth_also_warns_a_non_private_run():
  warnings = run_warnings.RunWarnings()
  warnings.check({'nonprivate_train_loss': 0.5}, 1, 1, None)
  lines = warnings.check({'nonprivate_train_loss': 51.0}, 2, 2, None)
  assert len(lines) == 1 and '(nonprivate: not covered by ε)' in lines[0]


def test_epsilon_warning_fires_above_10_only():
  assert run_warnings.RunWarnings().epsilon(10.0, 3.0) == []
  assert run_warnings.RunWarnings().epsilon(10.01, 0.0) == [
    'the final ε = 10.01 is above 10 (no privacy.target_epsilon is set): a weak guarantee. '
    'Raise privacy.noise_multiplier, or set a target ε to calibrate σ to.'
  ]
