"""The cap B an accountant is told: required where the batcher truncates.

Poisson and balls-and-bins batch sizes are Binomial(N, q): a batcher keeps at most B rows of
a logical batch (`dpjax.privacy.batching`), and the ε of a truncated run is larger (16.39
against 4.07 untruncated in tests/privacy/test_privacy_plan.py). An accountant cannot know
B unless told, so for these samplers B must be given: the batcher's cap, or None for a run
whose batches are never truncated. Fixed-size samplers never exceed b: B >= b or None.
"""

from __future__ import annotations

from dpjax.privacy import samplers as samplers_lib
from dpjax.privacy.accounting import sampler_events


class _NotGiven:
  """The default of `Accountant(max_batch_size=...)`: the caller did not say what B is."""

  def __repr__(self) -> str:
    return 'CAP_NOT_GIVEN'


CAP_NOT_GIVEN = _NotGiven()


def check_max_batch_size(sampler: samplers_lib.Sampler, max_batch_size) -> int | None:
  """B as an int >= 1 (>= b where batches never exceed b), or None; ValueError (one line)
  for CAP_NOT_GIVEN where batch sizes are binomial, naming what to pass."""
  if max_batch_size is CAP_NOT_GIVEN:
    if sampler.binomial_batch_size:
      raise ValueError(
        f'max_batch_size is required for the {sampler.name} sampler: its batch sizes are '
        'Binomial(N, q), a batcher truncates them at its cap B, and truncation raises ε. '
        "Pass the batcher's cap (plan.max_batch_size, batcher.max_batch_size), or None if "
        'no batch is ever truncated.'
      )
    return None
  if max_batch_size is not None:
    sampler_events.check_positive_int('sampler.max_batch_size', max_batch_size)
    if not sampler.binomial_batch_size and max_batch_size < sampler.batch_size:
      raise ValueError(
        f'sampler.max_batch_size = {max_batch_size} must be >= sampler.batch_size = '
        f'{sampler.batch_size} for the {sampler.name} sampler (its batches are never '
        f'larger than b, and truncating every batch is not accounted).'
      )
  return max_batch_size
