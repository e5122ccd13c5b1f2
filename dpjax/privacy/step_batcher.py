"""A plan's logical batches in order, each drawn once: the step counter of a library loop.

The batch of step t and the noise of step t are used together, once. A loop that restarts
t each epoch draws the identical batches again (`Batcher.logical_batch` is a pure function
of (seed, t)): each batch is then released E times under fresh noise, which is the
subsampled Gaussian at σ/√E over one epoch, not σ over E epochs as the plan's ε says.
`PrivacyPlan.batcher(P, opt_state)` makes a `StepBatcher` that starts at the privatizer
state's step (`noise_state`); `logical_batch(t)` refuses every t but the next one, and
iterating yields t = next, …, T − 1 (the plan's num_steps), continuing across epochs.

  >>> from dpjax.privacy.samplers import PoissonSampler
  >>> from dpjax.privacy.batching import Batcher
  >>> batcher = StepBatcher(Batcher(PoissonSampler(num_examples=100, batch_size=10, seed=0),
  ...                               physical_batch_size=8, max_batch_size=32), num_steps=3)
  >>> [batch.step for batch in batcher]
  [0, 1, 2]
  >>> batcher.logical_batch(0)  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  ValueError: logical_batch(0): step 0 was drawn already (the next is 3, of num_steps = 3): ...
"""

from __future__ import annotations

from typing import Iterator

from dpjax.privacy import batching
from dpjax.privacy import checks as _checks


class StepBatcher:
  """A `batching.Batcher` that is also the loop's step counter: steps start..T − 1, once each.

  Args:
    batcher: the plan's batcher (sampler, P and the cap B).
    num_steps: T, the steps the plan's ε covers.
    start: the first step (the privatizer state's step on a resume).
  """

  def __init__(self, batcher: batching.Batcher, num_steps: int, start: int = 0):
    self.batcher = batcher
    self.num_steps = _checks.check_int('num_steps', num_steps, 1)
    self._next = _checks.check_int('start', start, 0)

  @property
  def next_step(self) -> int:
    """The step `logical_batch` accepts next."""
    return self._next

  @property
  def physical_batch_size(self) -> int:
    return self.batcher.physical_batch_size

  @property
  def max_batch_size(self) -> int:
    return self.batcher.max_batch_size

  @property
  def max_physical_batches(self) -> int:
    return self.batcher.max_physical_batches

  def logical_batch(self, step: int) -> batching.LogicalBatch:
    """The padded physical batches of `step`, which must be `next_step` (ValueError, one line)."""
    _checks.check_int('step', step, 0)
    where = f'(the next is {self._next}, of num_steps = {self.num_steps})'
    if step < self._next:
      raise ValueError(
        f"logical_batch({step}): step {step} was drawn already {where}: each step's batch "
        'is used once. Iterate the batcher (t continues across epochs) rather than '
        'restarting t: the same batches under fresh noise are not what ε covers.'
      )
    if step > self._next:
      raise ValueError(
        f'logical_batch({step}) skips steps {where}: steps are drawn in order, '
        'each once, as the privatizer noises them.'
      )
    if step >= self.num_steps:
      raise ValueError(
        f'logical_batch({step}): the plan covers steps 0..{self.num_steps - 1} '
        '(its num_steps); a longer run needs a plan with more steps '
        '(PrivacyPlan.create(..., resume_from=opt_state)).'
      )
    batch = self.batcher.logical_batch(step)
    self._next = step + 1
    return batch

  def __iter__(self) -> Iterator[batching.LogicalBatch]:
    """The batches of next_step, …, num_steps − 1 (a second loop continues where one stopped)."""
    while self._next < self.num_steps:
      yield self.logical_batch(self._next)
