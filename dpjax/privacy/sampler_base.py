"""What a sampler is: its interface, the privacy facts the accountant reads, the epoch base.

`Sampler` is a frozen dataclass whose `indices(step)` is a pure function of (seed, step), and
whose class attributes state what accounting needs (which analysis, which accountants,
whether batch sizes are Binomial, whether sampling amplifies privacy): accounting asks the
sampler, never its name. `EpochSampler` partitions the data into T = ceil(N/b) batches per
epoch, one epoch's assignment cached per object. The samplers themselves, and the registry of
their names, are `dpjax.privacy.samplers`.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar

import numpy as np

from dpjax.privacy import checks as _checks
from dpjax.privacy import random_streams


def sampler_generator(seed: int, *key: int) -> np.random.Generator:
  """The sampler's stream: a numpy generator that is a pure function of (seed, *key)."""
  return random_streams.host_generator(seed, random_streams.Stream.SAMPLER, *key)


def index_dtype(num_examples: int) -> np.dtype:
  """int32 halves the memory of per-epoch permutations when N < 2^31."""
  return np.dtype(np.int32) if num_examples < 2**31 else np.dtype(np.int64)


def uniform_permutation(rng: np.random.Generator, num_examples: int) -> np.ndarray:
  """A uniform permutation of range(N), 4 bytes per example when N < 2^31.

  Shuffles an arange of the index dtype in place: the same Fisher-Yates draws,
  hence the same permutation, as `rng.permutation(N)`, without its int64
  array and the int32 copy (12 bytes per example at the peak).
  """
  order = np.arange(num_examples, dtype=index_dtype(num_examples))
  rng.shuffle(order)
  return order


@dataclasses.dataclass(frozen=True)
class Sampler(abc.ABC):
  """Base class: a logical batch of example indices for every step."""

  num_examples: int
  batch_size: int
  seed: int = 0
  # The rows actually present when N = num_examples is only a public upper bound on them
  # (`bounds_rows`); None: exactly N rows. Everything that enters ε reads N, never this.
  num_rows: int | None = dataclasses.field(default=None, repr=False)  # Private: never logged.

  name: ClassVar[str]
  # Whether N may be a public upper bound on the rows (num_rows <= N): true when each
  # example's selection and the accounting do not depend on how many other rows exist.
  bounds_rows: ClassVar[bool] = False
  # Privacy facts (docs/accounting.md); accounting asks the sampler, never its name.
  # Accountants that support the sampler; the first is what 'auto' means.
  accountants: ClassVar[tuple[str, ...]] = ('pld', 'rdp')
  # ... and those that support group privacy (privacy.group_size > 1).
  group_accountants: ClassVar[tuple[str, ...]] = ('pld',)
  # Why an accountant outside `accountants` does not apply (the error message says it).
  unsupported_accountant_reason: ClassVar[str] = (
    'the Monte-Carlo accountant exists for balls-and-bins only'
  )
  # Batch sizes are Binomial(N, p): a cap B truncates with probability > 0, and the
  # accountant pays for it. Other samplers' batches never exceed b (B >= b is required).
  binomial_batch_size: ClassVar[bool] = False
  # The analysis that turns (σ, steps) into ε for this sampler: a key of
  # `dpjax.privacy.accounting.accountant.ANALYSES` (docs/design.md, "Adding a sampler").
  analysis: ClassVar[str]
  # ε falls as b/N falls at fixed σ (privacy amplification by sampling). False: each
  # example is in exactly one batch per epoch, accounted without amplification.
  amplified_by_sampling: ClassVar[bool] = True
  # The one-step PLD at group size 1 is a Gaussian or a 2-component mixture: a 10x coarser
  # grid loses ~0.3% of ε, so σ calibration searches on it before the exact grid.
  coarse_pld_search: ClassVar[bool] = False
  # The one-step PLD is a mixture of many Gaussians (slow to build at small σ): σ
  # calibration starts from the σ of `calibration_base()`, whose ε is never larger.
  many_component_pld: ClassVar[bool] = False
  # What to try when the step PLD's grid is too large (beyond raising σ), if anything.
  grid_too_large_hint: ClassVar[str | None] = None
  # ε has a provable random-allocation bound and a max-test lower bound per epoch (Chua et
  # al. 2025), so σ calibration brackets the answer before evaluating the costly bound.
  random_allocation_bracket: ClassVar[bool] = False
  # The sampler's own fields beyond (N, b, seed, rows), settable as `sampler.<field>` in a
  # training config (cyclic Poisson's num_groups); they enter ε and the fingerprint.
  own_fields: ClassVar[tuple[str, ...]] = ()
  # A banded correlated-noise strategy (BandMF) with at most as many bands as the sampler's
  # participations are apart is amplified by this sampling (cyclic Poisson only).
  amplifies_banded_noise: ClassVar[bool] = False
  # The participation patterns a correlated-noise strategy is accounted for without
  # amplification (`accounting.matrix_mechanism.PATTERNS`); None: not analysed (refused).
  mf_patterns: ClassVar[str | None] = None

  def calibration_base(self) -> Sampler:
    """A sampler whose ε never exceeds this one's at equal σ (see many_component_pld)."""
    return self

  def __post_init__(self):
    _checks.check_int('num_examples', self.num_examples, 1)
    _checks.check_int('batch_size', self.batch_size, 1)
    if self.batch_size > self.num_examples:
      raise ValueError(
        f'batch_size = {self.batch_size} must be in [1, N = '
        f'{self.num_examples}] (the number of training examples).'
      )
    if self.num_rows is not None:
      if not self.bounds_rows:
        raise ValueError(
          f'the {self.name} sampler needs the exact N (num_rows must be None): '
          'its batches depend on how many rows there are.'
        )
      _checks.check_int('num_rows', self.num_rows, 1, self.num_examples)

  @property
  def rows(self) -> int:
    """The rows drawn from: indices are in [0, rows)."""
    return self.num_examples if self.num_rows is None else self.num_rows

  @abc.abstractmethod
  def indices(self, step: int) -> np.ndarray:
    """The example indices (int64, sorted) of the logical batch of `step`."""

  @property
  def expected_batch_size(self) -> float:
    """E[n_t]; the DP step divides the noisy sum by this, never by n_t."""
    return float(self.batch_size)

  @property
  def steps_per_epoch(self) -> int:
    """ceil(N / b): one pass over the data in expectation."""
    return math.ceil(self.num_examples / self.batch_size)

  @property
  def sampling_probability(self) -> float:
    """Probability that a given example is in a given step's batch."""
    return self.batch_size / self.num_examples

  @property
  def is_epoch_based(self) -> bool:
    """True when the privacy unit is the epoch (each example once per epoch)."""
    return False

  def own_values(self) -> dict[str, int]:
    """{'sampler.<field>': value} of `own_fields` (for fingerprints, checkpoints, cards)."""
    return {f'sampler.{name}': getattr(self, name) for name in self.own_fields}

  def participations(self, num_steps: int) -> int:
    """The steps of the first T one example can take part in (T for per-step samplers)."""
    return int(num_steps)

  def epoch_of(self, step: int) -> int:
    return step // self.steps_per_epoch

  def _check_step(self, step: int) -> int:
    step = int(step)
    if step < 0:
      raise ValueError(f'step must be >= 0, got {step}.')
    return step


@dataclasses.dataclass(frozen=True)
class EpochSampler(Sampler):
  """A sampler that partitions the data into T batches per epoch."""

  # One epoch is a post-processing of a fixed assignment: sensitivity k for a group of k,
  # so RDP covers groups too (Gaussian per epoch).
  group_accountants: ClassVar[tuple[str, ...]] = ('pld', 'rdp')

  @property
  def is_epoch_based(self) -> bool:
    return True

  @abc.abstractmethod
  def _epoch_assignment(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, offsets): batch t of the epoch is order[offsets[t]:offsets[t+1]]."""

  def indices(self, step: int) -> np.ndarray:
    step = self._check_step(step)
    epoch, t = divmod(step, self.steps_per_epoch)
    order, offsets = self._cached_assignment(epoch)
    return np.sort(order[offsets[t] : offsets[t + 1]]).astype(np.int64)

  def _cached_assignment(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    # One epoch's assignment is kept per sampler object (O(N) memory); a
    # frozen dataclass cannot hold the cache as a field, hence the dict.
    cache = self.__dict__.setdefault('_assignment_cache', {})
    if epoch not in cache:
      cache.clear()
      cache[epoch] = self._epoch_assignment(epoch)
    return cache[epoch]


def consecutive_offsets(num_examples: int, batch_size: int) -> np.ndarray:
  return np.minimum(np.arange(0, num_examples + batch_size, batch_size), num_examples)[
    : math.ceil(num_examples / batch_size) + 1
  ]
