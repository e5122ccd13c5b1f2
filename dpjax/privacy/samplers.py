"""Batch samplers: which examples form the logical batch of step t.

Every sampler is a frozen dataclass whose `indices(step)` is a pure function
of (seed, step): resuming at step t costs O(b) (Poisson, fixed size) or one
O(N) epoch assignment (balls-and-bins, shuffle), never a replay of earlier
steps. The accountant (`dpjax.privacy.accounting`) builds its privacy analysis from
the same object, so what is sampled is what is accounted.

| name | batch of step t | accounting |
|---|---|---|
| `poisson` | each example independently with prob. q = b/N | Poisson-subsampled Gaussian |
| `cyclic_poisson` | group t mod k of k random groups, each member with prob. bk/N | ⌈T/k⌉ Poisson steps at rate bk/N |
| `balls_and_bins` | each epoch, every example in one uniform of T = ceil(N/b) batches | Chua et al. 2025 (seed 000) |
| `shuffle` | one permutation per epoch, consecutive batches of b | deterministic upper bound |
| `deterministic` | dataset order, consecutive batches of b | Gaussian, once per epoch |
| `fixed_size` | an independent uniform b-subset | MoG (Ganesh, seed 004), FS-RDP (Birrell et al., seed 001) |
| `fixed_size_with_replacement` | b independent uniform draws | see `dpjax.privacy.accounting` |

Epoch-based samplers (`balls_and_bins`, `shuffle`, `deterministic`) have
T = ceil(N/b) steps per epoch. For `shuffle` and `deterministic` the last
batch of an epoch holds the remainder N - (T-1)·b (smaller than b when b does
not divide N); every example is used exactly once per epoch.

Randomness: step t of a per-step sampler uses a generator seeded by
(seed, SAMPLER, t); epoch e of a per-epoch sampler by (seed, SAMPLER, tag, e)
(`dpjax.privacy.random_streams`, distinct from truncation, audit, noise and init).

Memory: `poisson`, `fixed_size`, `fixed_size_with_replacement` and
`deterministic` keep no per-example state (O(b) per step). `shuffle` and
`balls_and_bins` keep the current epoch's permutation, 4 bytes per example
while N < 2^31 (8 above), plus 8 bytes per batch for the offsets; one epoch is
cached per sampler object. Building it is an in-place Fisher-Yates shuffle,
O(N) time once per epoch.

  >>> sampler = PoissonSampler(num_examples=1000, batch_size=100, seed=0)
  >>> sampler.sampling_probability, sampler.expected_batch_size, sampler.steps_per_epoch
  (0.1, 100.0, 10)
  >>> bool((sampler.indices(3) == sampler.indices(3)).all())   # a function of (seed, step)
  True
  >>> shuffle = ShuffleSampler(num_examples=10, batch_size=4, seed=0)
  >>> sorted(int(i) for t in range(3) for i in shuffle.indices(t))   # one epoch: each once
  [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from dpjax.privacy import checks as _checks
from dpjax.privacy import sampler_base
from dpjax.privacy.sampler_base import Sampler  # The type every caller names: samplers.Sampler.


@dataclasses.dataclass(frozen=True)
class PoissonSampler(Sampler):
  """Each example joins each batch independently with probability q = b/N.

  Sampled in O(n_t): n_t ~ Binomial(rows, q), then n_t distinct indices
  uniformly at random. Conditionally on its size a Poisson batch is a uniform
  subset of that size, so this is exactly Poisson sampling.

  N may be a public upper bound on the rows (`num_rows` <= N): each row still joins
  with probability q = b/N, independently of the others, so the subsampled Gaussian's
  privacy loss is the same whatever the rows, and E[n_t] for the divisor is q·N = b.

  Memory: no per-example state. numpy draws the subset with Floyd's algorithm
  (O(n_t)) while n_t <= N/50; above that (q > ~1/50) it shuffles the tail of
  a transient int64 arange, 8 bytes per example for that step only.
  """

  name: ClassVar[str] = 'poisson'
  bounds_rows: ClassVar[bool] = True
  binomial_batch_size: ClassVar[bool] = True
  analysis: ClassVar[str] = 'poisson_subsampling'
  coarse_pld_search: ClassVar[bool] = True

  @property
  def expected_batch_size(self) -> float:
    return self.sampling_probability * self.num_examples

  def indices(self, step: int) -> np.ndarray:
    rng = sampler_base.sampler_generator(self.seed, self._check_step(step))
    size = rng.binomial(self.rows, self.sampling_probability)
    return np.sort(rng.choice(self.rows, size=size, replace=False)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class CyclicPoissonSampler(Sampler):
  """Cyclic Poisson: k groups, step t draws from group t mod k, each member with prob. p = bk/N.

  Choquette-Choo, Ganesh, McMahan, Rush, Thakurta, Xu 2023, "(Amplified) Banded Matrix
  Factorization: A unified approach to private training" (their sampling for amplified
  BandMF): each example's group is drawn once, i.i.d. uniform over k from the secret seed, so
  removing an example changes no other's group; step t takes each member of group t mod k
  independently with probability p = b·k/N. An example can take part only in the steps of its
  group, k apart: T steps are at most ⌈T/k⌉ Poisson-subsampled participations at rate p (what
  the accountant composes), and with k ≥ the bands of a banded strategy its participations'
  columns never overlap. Marginally over the groups an example is in step t's batch with
  probability b/N (`sampling_probability`), so n_t ~ Binomial(N, b/N), E[n_t] = b; k = 1 is
  Poisson sampling.

  Memory: the groups, 1 byte per example (k < 256; 2 or 4 above), drawn once per object.
  """

  num_groups: int = 1  # k.

  name: ClassVar[str] = 'cyclic_poisson'
  own_fields: ClassVar[tuple[str, ...]] = ('num_groups',)
  binomial_batch_size: ClassVar[bool] = True
  analysis: ClassVar[str] = 'cyclic_poisson_subsampling'
  coarse_pld_search: ClassVar[bool] = True
  group_accountants: ClassVar[tuple[str, ...]] = ()
  amplifies_banded_noise: ClassVar[bool] = True
  mf_patterns: ClassVar[str | None] = 'every_group_step'

  def __post_init__(self):
    super().__post_init__()
    _checks.check_int('num_groups', self.num_groups, 1)
    if self.batch_size * self.num_groups > self.num_examples:
      raise ValueError(
        f'batch_size * num_groups = {self.batch_size} * {self.num_groups} must be <= N = '
        f'{self.num_examples} (each group of ~N/k examples is sampled at rate b*k/N <= 1).'
      )

  @property
  def participation_probability(self) -> float:
    """p = b·k/N: the rate at which a member of step t's group joins its batch."""
    return self.batch_size * self.num_groups / self.num_examples

  def participations(self, num_steps: int) -> int:
    """⌈T/k⌉: the most steps of the first T one example can take part in."""
    return -(-int(num_steps) // self.num_groups)

  def groups(self) -> np.ndarray:
    """Each example's group, i.i.d. uniform over k (cached per object)."""
    cache = self.__dict__.setdefault('_groups_cache', {})
    if 'groups' not in cache:
      rng = sampler_base.sampler_generator(self.seed, 1 << 42, 0)
      dtype = np.min_scalar_type(max(self.num_groups - 1, 0))
      cache['groups'] = rng.integers(0, self.num_groups, size=self.num_examples, dtype=dtype)
      cache['members'] = {}
    return cache['groups']

  def indices(self, step: int) -> np.ndarray:
    step = self._check_step(step)
    groups = self.groups()
    members_of = self.__dict__['_groups_cache']['members']
    group = step % self.num_groups
    if group not in members_of:
      members_of.clear()  # One group's members at a time: O(N/k) int64.
      members_of[group] = np.flatnonzero(groups == group)
    members = members_of[group]
    rng = sampler_base.sampler_generator(self.seed, step)
    size = rng.binomial(len(members), self.participation_probability)
    return np.sort(members[rng.choice(len(members), size=size, replace=False)]).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class FixedSizeSampler(Sampler):
  """Each step an independent uniformly random b-subset (without replacement).

  Memory as for Poisson: O(b) while b <= N/50, else a transient 8 bytes per example.
  """

  name: ClassVar[str] = 'fixed_size'
  analysis: ClassVar[str] = 'fixed_size_subsampling'
  coarse_pld_search: ClassVar[bool] = True

  def indices(self, step: int) -> np.ndarray:
    rng = sampler_base.sampler_generator(self.seed, self._check_step(step))
    return np.sort(rng.choice(self.num_examples, size=self.batch_size, replace=False)).astype(
      np.int64
    )


@dataclasses.dataclass(frozen=True)
class FixedSizeWithReplacementSampler(Sampler):
  """Each step b independent uniform draws; an example may appear twice. O(b) memory."""

  name: ClassVar[str] = 'fixed_size_with_replacement'
  accountants: ClassVar[tuple[str, ...]] = ('pld',)
  unsupported_accountant_reason: ClassVar[str] = (
    'dp_accounting has no RDP for sampling with replacement'
  )
  analysis: ClassVar[str] = 'subsampling_with_replacement'
  many_component_pld: ClassVar[bool] = True
  grid_too_large_hint: ClassVar[str | None] = (
    'use sampler fixed_size (without replacement: a 2-component mixture)'
  )

  def calibration_base(self) -> Sampler:
    """Fixed size without replacement: ε of its 2-component mixture is never larger."""
    return FixedSizeSampler(
      num_examples=self.num_examples, batch_size=self.batch_size, seed=self.seed
    )

  def indices(self, step: int) -> np.ndarray:
    rng = sampler_base.sampler_generator(self.seed, self._check_step(step))
    return np.sort(rng.integers(0, self.num_examples, size=self.batch_size, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class BallsAndBinsSampler(sampler_base.EpochSampler):
  """Each epoch, every example goes to one of T = ceil(N/b) batches uniformly.

  Chua et al. 2025, "Balls-and-Bins Sampling for DP-SGD" (seed 000). Drawn
  exactly as: bin sizes ~ Multinomial(N, (1/T, ..., 1/T)), then a uniform
  permutation cut into consecutive runs of those sizes (given the sizes, the
  assignment of i.i.d. uniform bins is a uniform arrangement). Each batch size
  is Binomial(N, 1/T) marginally.

  Memory: the epoch's permutation, 4 bytes per example (N < 2^31; 8 above),
  and T + 1 int64 offsets (8/b bytes per example; 32/b transiently while the
  multinomial is drawn). At N = 1e8, b = 256: 400 MB + 3.1 MB.
  """

  name: ClassVar[str] = 'balls_and_bins'
  analysis: ClassVar[str] = 'random_allocation'
  random_allocation_bracket: ClassVar[bool] = True
  accountants: ClassVar[tuple[str, ...]] = ('pld', 'monte_carlo')
  group_accountants: ClassVar[tuple[str, ...]] = ('pld',)
  unsupported_accountant_reason: ClassVar[str] = (
    'no RDP analysis of balls-and-bins is implemented; use pld (provable) or monte_carlo'
  )
  binomial_batch_size: ClassVar[bool] = True

  @property
  def sampling_probability(self) -> float:
    return 1.0 / self.steps_per_epoch

  @property
  def expected_batch_size(self) -> float:
    return self.num_examples / self.steps_per_epoch

  def _epoch_assignment(self, epoch):
    rng = sampler_base.sampler_generator(self.seed, 1 << 40, epoch)
    num_bins = self.steps_per_epoch
    sizes = rng.multinomial(self.num_examples, np.full(num_bins, 1.0 / num_bins))
    order = sampler_base.uniform_permutation(rng, self.num_examples)
    return order, np.concatenate([[0], np.cumsum(sizes)])


@dataclasses.dataclass(frozen=True)
class ShuffleSampler(sampler_base.EpochSampler):
  """One uniform permutation per epoch, cut into consecutive batches of b.

  The last batch of each epoch holds the remainder N - (T-1)·b.

  Memory: the epoch's permutation, 4 bytes per example (N < 2^31; 8 above),
  plus T + 1 int64 offsets. At N = 1e8, b = 256: 400 MB + 3.1 MB.
  """

  name: ClassVar[str] = 'shuffle'
  analysis: ClassVar[str] = 'shuffled_epochs'
  mf_patterns: ClassVar[str | None] = 'one_per_epoch'
  amplified_by_sampling: ClassVar[bool] = False

  def _epoch_assignment(self, epoch):
    rng = sampler_base.sampler_generator(self.seed, 1 << 41, epoch)
    order = sampler_base.uniform_permutation(rng, self.num_examples)
    return order, sampler_base.consecutive_offsets(self.num_examples, self.batch_size)


@dataclasses.dataclass(frozen=True)
class DeterministicSampler(sampler_base.EpochSampler):
  """The dataset order, consecutive batches of b (the last one holds the rest).

  Memory: none per example; a step is an arange of its b indices.
  """

  name: ClassVar[str] = 'deterministic'
  analysis: ClassVar[str] = 'gaussian_per_epoch'
  mf_patterns: ClassVar[str | None] = 'every_epoch'
  amplified_by_sampling: ClassVar[bool] = False

  def indices(self, step: int) -> np.ndarray:
    step = self._check_step(step)
    t = step % self.steps_per_epoch
    stop = min((t + 1) * self.batch_size, self.num_examples)
    return np.arange(t * self.batch_size, stop, dtype=np.int64)

  def _epoch_assignment(self, epoch):
    return (
      np.arange(self.num_examples, dtype=sampler_base.index_dtype(self.num_examples)),
      sampler_base.consecutive_offsets(self.num_examples, self.batch_size),
    )


# Every sampler class, by config name (a new sampler is added here, once).
_SAMPLERS = {
  cls.name: cls
  for cls in (
    PoissonSampler,
    CyclicPoissonSampler,
    BallsAndBinsSampler,
    ShuffleSampler,
    DeterministicSampler,
    FixedSizeSampler,
    FixedSizeWithReplacementSampler,
  )
}
SAMPLER_NAMES = tuple(_SAMPLERS)
# Every sampler's own fields (`Sampler.own_fields`), settable as `sampler.<field>` in a config.
OWN_FIELDS = tuple(sorted({name for cls in _SAMPLERS.values() for name in cls.own_fields}))


def make(
  name: str,
  num_examples: int,
  batch_size: int,
  seed: int = 0,
  num_rows: int | None = None,
  **fields,
) -> Sampler:
  """The sampler called `name` over N = num_examples with batch size b, seeded by `seed`.

  The seed must be secret for the privacy guarantee (it decides which examples each step
  uses, and `dpjax.privacy.prng` derives the noise from it). `num_rows`: the rows present
  when N is a public upper bound on them (samplers with `bounds_rows` only). `fields`: the
  sampler's own (`num_groups` of cyclic_poisson).
  """
  return sampler_class(name)(
    num_examples=num_examples, batch_size=batch_size, seed=seed, num_rows=num_rows, **fields
  )


def sampler_class(name: str) -> type[Sampler]:
  if name not in _SAMPLERS:
    raise ValueError(f'sampler.name = {name!r} is unknown; valid: {", ".join(SAMPLER_NAMES)}.')
  return _SAMPLERS[name]
