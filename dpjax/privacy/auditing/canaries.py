"""Gradient canaries: their coins, their directions, and how they enter the data.

A gradient canary j (Steinke et al. 2023, Sec. 6, "Dirac canaries" in
gradient space) is a training example whose per-example gradient is
λ · s_j · e_{c_j}: all zero but one parameter coordinate c_j, with a random
sign s_j and a norm λ ≥ C, so that clipping makes it exactly C · u_j with
u_j = s_j · e_{c_j}. The coordinates are distinct, so the directions are
orthonormal: a canary never masks another, and the projections of isotropic
noise on them are independent N(0, σ²C²) (what `white_box` tests).

Membership: canary j is in the training data iff its coin S_j (fair, independent)
came up heads. Every canary keeps a row of the data source (N + m rows), and the
row of an excluded canary contributes exactly zero, so sampler, batcher and
accountant see N + m examples whatever the coins: under add/remove
("zeroing-out") adjacency a zero row is an absent example (docs/accounting.md).
The run's ε claim covers the canaries as ordinary examples of that N + m.

Randomness: coins, coordinates and signs are a pure function of
(the run's seed, Stream.AUDIT) (`dpjax.privacy.random_streams`), disjoint from the
sampler, truncation, noise and init streams.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dpjax.privacy import random_streams

CANARY_KINDS = ('gradient',)
# λ/C: a canary's raw gradient norm. Anything above 1 is clipped to exactly C by correct code;
# code that skips clipping releases λ = 10·C instead (what the planted-bug tests detect).
DEFAULT_GRADIENT_SCALE = 10.0


@dataclasses.dataclass(frozen=True)
class CanarySet:
  """m gradient canaries over a model with `num_params` parameters.

  Attributes:
    membership: bool [m], the coins (True = in the training data).
    coordinates: int64 [m], distinct indices into the flattened parameters
      (`jax.flatten_util.ravel_pytree` order).
    signs: float32 [m] in {−1, +1}.
    seed: the seed they were drawn from; `make_canaries(seed, m, d)` redraws them.
  """

  membership: np.ndarray
  coordinates: np.ndarray
  signs: np.ndarray
  num_params: int
  seed: int
  gradient_scale: float = DEFAULT_GRADIENT_SCALE

  @property
  def num_canaries(self) -> int:
    return len(self.membership)

  def to_dict(self) -> dict:
    """What audit.json stores: enough to redraw and check the canaries."""
    return {
      'kind': 'gradient',
      'num_canaries': self.num_canaries,
      'seed': self.seed,
      'num_params': self.num_params,
      'gradient_scale': self.gradient_scale,
      'membership': self.membership.astype(int).tolist(),
    }

  @classmethod
  def from_dict(cls, d: dict) -> 'CanarySet':
    canaries = make_canaries(
      d['seed'],
      d['num_canaries'],
      d['num_params'],
      gradient_scale=d.get('gradient_scale', DEFAULT_GRADIENT_SCALE),
    )
    if 'membership' in d and not np.array_equal(
      np.asarray(d['membership'], bool), canaries.membership
    ):
      raise ValueError(
        'audit.json: the recorded membership differs from the one redrawn from '
        f'seed {d["seed"]}; the record is damaged or from other code.'
      )
    return canaries


def make_canaries(
  seed: int, num_canaries: int, num_params: int, *, gradient_scale: float = DEFAULT_GRADIENT_SCALE
) -> CanarySet:
  """Draws the coins, the distinct coordinates and the signs from (seed, Stream.AUDIT)."""
  if (
    isinstance(num_canaries, bool)
    or not isinstance(num_canaries, (int, np.integer))
    or not (1 <= num_canaries <= num_params)
  ):
    raise ValueError(
      f'audit.num_canaries must be an integer in [1, #parameters = {num_params}] '
      f'(one coordinate each), got {num_canaries!r}.'
    )
  if not gradient_scale >= 1:
    raise ValueError(
      f'gradient_scale must be >= 1 (the raw canary gradient is λ = scale·C), got {gradient_scale}.'
    )
  rng = random_streams.host_generator(seed, random_streams.Stream.AUDIT)
  membership = rng.random(num_canaries) < 0.5
  coordinates = np.sort(rng.choice(num_params, size=num_canaries, replace=False)).astype(np.int64)
  signs = np.where(rng.random(num_canaries) < 0.5, -1.0, 1.0).astype(np.float32)
  return CanarySet(
    membership, coordinates, signs, int(num_params), int(seed), float(gradient_scale)
  )


class CanarySource:
  """A data source with m canary rows appended: N + m examples, one `canary_id` column.

  `gather` returns the base source's columns (canary rows copy example 0's x
  and y: the DP step replaces their gradient) plus 'canary_id': int32, −1 for
  ordinary rows and j for canary j. Whether canary j counts is decided by its
  coin inside `gradient_canary.with_gradient_canaries`, not here, so the
  sampler is the same object whatever the coins.
  """

  def __init__(self, base, num_canaries: int):
    self.base = base
    self.num_canaries = int(num_canaries)
    self.num_base = len(base)

  def __len__(self) -> int:
    return self.num_base + self.num_canaries

  def __getattr__(self, name):  # num_classes, input_shape, ... of the base source
    return getattr(self.base, name)

  def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    indices = np.asarray(indices, np.int64)
    is_canary = indices >= self.num_base
    batch = self.base.gather(np.where(is_canary, 0, indices))
    batch['canary_id'] = np.where(is_canary, indices - self.num_base, -1).astype(np.int32)
    return batch


def check_audit(num_canaries, kind, confidence, every_checkpoint, *, prefix: str = '') -> int:
  """Validates an audit's settings before any compute (ValueError naming the argument, with
  `prefix`, e.g. 'audit.'); returns m = num_canaries."""
  m = num_canaries
  if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
    raise ValueError(f'{prefix}num_canaries must be an integer >= 0 (0 = off), got {m!r}.')
  if kind not in CANARY_KINDS:
    raise ValueError(f'{prefix}kind = {kind!r}; valid: {", ".join(CANARY_KINDS)}.')
  if not isinstance(confidence, float) or not 0 < confidence < 1:
    raise ValueError(f'{prefix}confidence must be in (0, 1), got {confidence!r}.')
  if not isinstance(every_checkpoint, bool):
    raise ValueError(f'{prefix}every_checkpoint must be True or False, got {every_checkpoint!r}.')
  return int(m)
