"""Static-shape batching: a logical batch becomes K physical batches of P rows.

A logical batch of n indices is first capped at B (a multiple of P): if
n > B, a uniformly random B of them are kept ("truncation"; Chua et al. 2025,
seed 000, Section 5; the accountant pays for it, see `dpjax.privacy.accounting`).
The kept m = min(n, B) indices fill K = ceil(m / P) physical batches of
exactly P rows; only the last is padded. Padded rows point at example 0 and
carry weight 0, so they contribute exactly zero to any weighted sum. Shapes
never depend on n, so a step jitted on one physical batch compiles once.

The default cap is the smallest multiple of P whose total truncation
probability over the run, τ = T·Pr[n_t > B], is at most δ·1e-3·e^{-50}, so the
accounting penalty (δ grows by at most (1 + e^ε)·τ) is negligible for any ε
up to 50 (`DEFAULT_TRUNCATION_BUDGET`).

  >>> from dpjax.privacy.samplers import FixedSizeSampler
  >>> batcher = Batcher(FixedSizeSampler(num_examples=10, batch_size=4, seed=0),
  ...                   physical_batch_size=3, max_batch_size=6)
  >>> batch = batcher.logical_batch(0)   # 4 examples in K = 2 physical batches of P = 3
  >>> batch.indices.shape, batch.weights.tolist(), batch.size, batch.step
  ((2, 3), [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], 4, 0)

A library loop draws its batches through `PrivacyPlan.batcher` (`step_batcher.StepBatcher`:
each step once, in order, from the privatizer state's step); this `Batcher` is the pure
function of (seed, t) beneath it, which the trainer drives with its own checkpointed step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import numpy as np
from scipy import stats

from dpjax.privacy import checks as _checks
from dpjax.privacy import random_streams
from dpjax.privacy import samplers as samplers_lib

# The automatic cap keeps τ = T·Pr[n_t > B] <= DEFAULT_TRUNCATION_BUDGET · δ, with
# budget 1e-3·e^{-50}: the TV penalty (1 + e^ε)·τ then stays below δ/1000 for every ε <= 50,
# including the deterministic bound attached to long balls-and-bins runs (ε ≈ 10-50), where a
# budget of δ/1000 alone made the penalty exceed δ (ε = ∞; experiments/06_truncation). A
# higher cap costs nothing on ordinary steps: the number of physical batches follows the
# sampled size, B only bounds it (the binomial tail falls like e^{-k²/2} k std above the mean,
# so this is ~6 std more than δ/1000 would give: B = 913 instead of 768 at b = 600, N = 60000).
DEFAULT_TRUNCATION_BUDGET = 1e-3 * math.exp(-50.0)


@dataclasses.dataclass(frozen=True)
class LogicalBatch:
  """One logical step as K physical batches.

  Attributes:
    indices: int64 [K, P] example indices (padding rows hold 0).
    weights: float32 [K, P], 1 for real examples and 0 for padding.
    size: n, the sampled logical batch size before truncation.
    truncated: whether n > B and a random B were kept.
    step: t, the logical step this batch was drawn for (its noise is that of t).
  """

  indices: np.ndarray
  weights: np.ndarray
  size: int
  truncated: bool
  step: int

  @property
  def num_physical_batches(self) -> int:
    return self.indices.shape[0]

  def check_rows(self, num_rows: int) -> None:
    """ValueError (one line) unless every index, padding included, is in [0, num_rows).

    Called before a gather from a source of `num_rows` rows: there an index out of range
    is no error (on the device jnp.take fills it with the dtype's extreme; numpy wraps a
    negative index), so a sampler whose N disagrees with the source would train on rows
    that are no example, without a word. O(B): a min and a max.
    """
    if self.indices.size == 0:
      return
    low, high = int(self.indices.min()), int(self.indices.max())
    if low < 0 or high >= num_rows:
      raise ValueError(
        f'step {self.step}: sampled example index {low if low < 0 else high} is outside '
        f"[0, {num_rows}), the rows of the data source it is gathered from: the sampler's "
        'N and the source disagree (rows counted twice?); nothing was gathered.'
      )

  def physical_batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    yield from zip(self.indices, self.weights)


def _is_binomial(sampler: samplers_lib.Sampler) -> bool:
  """Binomial(N, p) batch sizes (Poisson, balls-and-bins) can exceed any B < N; others are <= b."""
  return sampler.binomial_batch_size


def log_truncation_probability(sampler: samplers_lib.Sampler, max_batch_size: int) -> float:
  """log Pr[n_t > B] for one step, in log-space (no underflow at N = 1e7)."""
  if _is_binomial(sampler):
    return float(
      stats.binom.logsf(max_batch_size, sampler.num_examples, sampler.sampling_probability)
    )
  return 0.0 if max_batch_size < sampler.batch_size else -math.inf


def truncation_probability(sampler: samplers_lib.Sampler, max_batch_size: int) -> float:
  """Pr[n_t > B] for one step."""
  return math.exp(log_truncation_probability(sampler, max_batch_size))


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def resolve_max_batch_size(
  sampler: samplers_lib.Sampler,
  physical_batch_size: int,
  requested: int = 0,
  *,
  num_steps: int = 1,
  delta: float = 1e-5,
) -> int:
  """The cap B on the logical batch size actually used for training.

  Args:
    sampler: the run's sampler.
    physical_batch_size: P; B is a multiple of it. 0 (automatic P, chosen later from the
      device's memory): B is resolved alone, to the row, so it does not depend on P or the
      device; the last physical batch of a full logical batch is then padded.
    requested: the user's B (`sampler.max_batch_size`); 0 derives it.
    num_steps: T, the run's number of steps (for the τ budget).
    delta: the run's δ; the automatic cap keeps τ = T·Pr[n_t > B] <=
      DEFAULT_TRUNCATION_BUDGET·δ (see there).

  Returns:
    B. Samplers with a fixed batch size never truncate: B >= b is required.
  """
  _checks.check_int('sampler.physical_batch_size', physical_batch_size, 0)
  physical_batch_size = physical_batch_size or 1  # P = 0: B to the row (see above).
  if isinstance(requested, bool) or not isinstance(requested, (int, np.integer)) or requested < 0:
    raise ValueError(
      f'sampler.max_batch_size must be 0 (auto) or a positive multiple of '
      f'sampler.physical_batch_size = {physical_batch_size}, got {requested!r}.'
    )
  # Under add/remove adjacency the neighbouring dataset has N + 1 examples, so B > N is what
  # rules truncation out for both (the accountant checks the neighbour too).
  no_truncation = _round_up(
    sampler.num_examples + 1 if _is_binomial(sampler) else sampler.batch_size, physical_batch_size
  )
  if requested:
    if requested % physical_batch_size:
      raise ValueError(
        f'sampler.max_batch_size = {requested} must be a multiple of '
        f'sampler.physical_batch_size = {physical_batch_size}.'
      )
    if not _is_binomial(sampler) and requested < sampler.batch_size:
      raise ValueError(
        f'sampler.max_batch_size = {requested} is below sampler.batch_size = '
        f'{sampler.batch_size}; the {sampler.name} sampler has no truncation accounting, '
        f'so B must be >= b (or 0 for auto).'
      )
    return min(requested, no_truncation)
  if not _is_binomial(sampler):
    return no_truncation
  _checks.check_delta(delta)
  # Smallest multiple of P with log(T) + log Pr[n > B] <= log(budget · δ).
  log_budget = math.log(DEFAULT_TRUNCATION_BUDGET * delta) - math.log(max(num_steps, 1))
  mean = sampler.expected_batch_size
  std = math.sqrt(mean * (1 - sampler.sampling_probability))
  candidate = _round_up(max(int(mean + 4 * std), 1), physical_batch_size)

  # The tail of the larger (N + 1) neighbour, as the accountant pays for it.
  def log_tail(cap):
    return float(stats.binom.logsf(cap, sampler.num_examples + 1, sampler.sampling_probability))

  while candidate < no_truncation and log_tail(candidate) > log_budget:
    candidate += physical_batch_size
  while (
    candidate - physical_batch_size >= physical_batch_size
    and log_tail(candidate - physical_batch_size) <= log_budget
  ):
    candidate -= physical_batch_size
  return min(candidate, no_truncation)


def max_physical_batch_size(
  sampler: samplers_lib.Sampler, requested: int = 0, *, num_steps: int = 1, delta: float = 1e-5
) -> int:
  """The largest useful P: the cap B resolved to the row (`resolve_max_batch_size` with P = 0),
  rounded up to a power of two, the most the automatic choice tries.

  A larger P holds only padding rows of weight 0 (B is a multiple of P, so B grows to P):
  P = 2^20 on N = 1,437 examples compiled a step over a million rows and never trained.
  """
  rows = resolve_max_batch_size(sampler, 0, requested, num_steps=num_steps, delta=delta)
  return 1 << max(0, rows - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Batcher:
  """Turns the sampler's logical batches into fixed-shape physical batches."""

  sampler: samplers_lib.Sampler
  physical_batch_size: int
  max_batch_size: int

  def __post_init__(self):
    _checks.check_int('physical_batch_size', self.physical_batch_size, 1)
    _checks.check_int('max_batch_size', self.max_batch_size, 1)

  @property
  def max_physical_batches(self) -> int:
    """K_max = ceil(B/P) (B need not be a multiple of P: the last batch is then padded)."""
    return -(-self.max_batch_size // self.physical_batch_size)

  def logical_batch(self, step: int) -> LogicalBatch:
    """The padded physical batches of `step`; a pure function of (seed, step)."""
    indices = self.sampler.indices(step)
    size = len(indices)
    truncated = size > self.max_batch_size
    if truncated:
      rng = random_streams.host_generator(self.sampler.seed, random_streams.Stream.TRUNCATION, step)
      keep = rng.choice(size, size=self.max_batch_size, replace=False)
      indices = np.sort(indices[keep])
    num_rows = len(indices)
    num_batches = -(-num_rows // self.physical_batch_size)
    padded = np.zeros(num_batches * self.physical_batch_size, dtype=np.int64)
    padded[:num_rows] = indices
    weights = np.zeros(padded.shape, dtype=np.float32)
    weights[:num_rows] = 1.0
    shape = (num_batches, self.physical_batch_size)
    return LogicalBatch(
      indices=padded.reshape(shape),
      weights=weights.reshape(shape),
      size=size,
      truncated=truncated,
      step=int(step),
    )
