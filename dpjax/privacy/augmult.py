"""Augmentation multiplicity: K augmented views per example, gradient averaged before clipping.

De et al. 2022 ("Unlocking High-Accuracy Differentially Private Image
Classification through Scale", §3.1; Fort et al. 2021 for the non-private
version) replace example i's loss by the mean over K random views v_{i,1..K}:

  ℓ̄_i(θ) = (1/K) Σ_k ℓ(θ, v_{i,k}, y_i),   so   ∇ℓ̄_i = (1/K) Σ_k ∇ℓ(θ, v_{i,k}, y_i)

(the gradient is linear). DP-SGD then clips ḡ_i = ∇ℓ̄_i ONCE: clip_C(ḡ_i).

Why the accounting is unchanged: the views are a function of example i alone
(and of public randomness), so ḡ_i is a function of example i alone, and the
example still contributes exactly one vector w_i · clip_C(ḡ_i) of norm ≤ C to
one step's sum. Adding or removing example i changes the sum by at most C,
the same sensitivity as without augmult, so the same σ gives the same ε
(docs/accounting.md). Clipping each view separately and summing would instead
give norm up to K·C — that is NOT what this module does.

Views are generated on the device with jax.random: reflect-padding by
`crop_padding` pixels then a random crop back to H × W, and a random
horizontal flip, for images [H, W, C]; with crop_padding = 0 and flip = False
the views are identical copies (any input shape). The key of view k of
example i at step t is a pure function of (seed, t, i, k), so a resumed run
redraws exactly the same views.

Use: `Augmult.of(K, crop_padding, flip)` is what `dpjax.privacy.dp_step.DPStep`
takes (`augmult=`): its `views(x, indices, step, seed=)` = `make_views` turns a
physical batch x [P, ...] into [P, K, ...] inside the compiled step, and
`losses.make_loss_fn(..., views=True)` runs the model once on an example's K
views and averages the loss, so both vmap and ghost clipping clip the
view-averaged gradient (ghost sees the K view rows as positions of one
example). `mean_over_views(loss_fn)` does the same for any single-example loss
by a vmap over views (vmap clipping only; the independent reference of the
tests).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.privacy import prng
from dpjax.privacy.random_streams import Stream

LossFn = Callable[[Any, Any], tuple[jax.Array, Any]]  # (params, example) -> (loss, aux).


def check_config(num_views: int, crop_padding: int, flip: bool, input_shape=None) -> None:
  """ValueError naming the `augmult.*` field and its valid range, before any compute."""

  def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)

  if not _int(num_views) or num_views < 0:
    raise ValueError(
      f'augmult.num_views = {num_views!r}: must be an integer >= 0 '
      '(0 or 1 = off, K > 1 = K views per example).'
    )
  if not _int(crop_padding) or crop_padding < 0:
    raise ValueError(f'augmult.crop_padding = {crop_padding!r}: must be an integer >= 0.')
  if not isinstance(flip, bool):
    raise ValueError(f'augmult.flip = {flip!r}: must be True or False.')
  if input_shape is not None and (crop_padding or flip):
    if len(input_shape) != 3:
      raise ValueError(
        f'augmult.crop_padding = {crop_padding}, augmult.flip = {flip}: crops and '
        f'flips need images [H, W, C], got per-example shape {tuple(input_shape)}; '
        'set crop_padding = 0 and flip = False for identity views.'
      )
    if crop_padding >= min(input_shape[:2]):
      raise ValueError(
        f'augmult.crop_padding = {crop_padding}: must be < min(H, W) = '
        f'{min(input_shape[:2])} (reflect padding).'
      )


@dataclasses.dataclass(frozen=True)
class Augmult:
  """K views per example (K <= 1: off), reflect-pad-and-crop by crop_padding, random flip."""

  num_views: int
  crop_padding: int = 0
  flip: bool = False

  def __post_init__(self):
    check_config(self.num_views, self.crop_padding, self.flip)

  @classmethod
  def of(cls, num_views: int, crop_padding: int = 0, flip: bool = False) -> Augmult | None:
    """Augmult(K, crop_padding, flip), or None when K <= 1 (off)."""
    if num_views <= 1:
      return None
    return cls(int(num_views), int(crop_padding), bool(flip))

  def views(self, x: jax.Array, indices: jax.Array, step, *, seed) -> jax.Array:
    """x [P, ...] -> views [P, K, ...] (see `make_views`)."""
    return make_views(
      x,
      indices,
      step,
      seed=seed,
      num_views=self.num_views,
      crop_padding=self.crop_padding,
      flip=self.flip,
    )


def stream_data(seed: int):
  """The view stream's key data (`prng.key_data`), an argument of compiled programs."""
  return prng.key_data(prng.stream_key(seed, Stream.VIEWS))


def view_keys(seed, step, indices: jax.Array, num_views: int) -> jax.Array:
  """Keys [P, K]: key(seed) → fold_in Stream.VIEWS → fold_in step → fold_in index → split K.

  `seed` is an int, or the stream's key data (`stream_data`, possibly traced).
  """
  stream = (
    prng.stream_key(seed, Stream.VIEWS)
    if isinstance(seed, (int, np.integer))
    else prng.from_data(seed)
  )
  root = jax.random.fold_in(stream, step)
  per_example = jax.vmap(lambda i: jax.random.fold_in(root, i))(jnp.asarray(indices, jnp.uint32))
  return jax.vmap(lambda k: jax.random.split(k, num_views))(per_example)


def augment(key: jax.Array, image: jax.Array, crop_padding: int, flip: bool) -> jax.Array:
  """One view of image [H, W, C]: reflect-pad, random crop to [H, W], random horizontal flip."""
  crop_key, flip_key = jax.random.split(key)
  if crop_padding:
    p = crop_padding
    padded = jnp.pad(image, ((p, p), (p, p), (0, 0)), mode='reflect')
    dy, dx = jax.random.randint(crop_key, (2,), 0, 2 * p + 1)
    image = jax.lax.dynamic_slice(padded, (dy, dx, 0), image.shape)
  if flip:
    image = jnp.where(jax.random.bernoulli(flip_key), image[:, ::-1], image)
  return image


def make_views(
  x: jax.Array, indices: jax.Array, step, *, seed, num_views: int, crop_padding: int, flip: bool
) -> jax.Array:
  """x [P, ...] → views [P, K, ...] (`_make_views`); `seed` an int or the view stream's key data
  (`stream_data`: what the DP step passes, so its program does not depend on the seed)."""
  data = stream_data(seed) if isinstance(seed, (int, np.integer)) else seed
  return _make_views(
    x, indices, step, data, num_views=num_views, crop_padding=crop_padding, flip=flip
  )


@functools.partial(jax.jit, static_argnames=('num_views', 'crop_padding', 'flip'))
def _make_views(
  x: jax.Array, indices: jax.Array, step, seed, *, num_views: int, crop_padding: int, flip: bool
) -> jax.Array:
  """x [P, ...] → views [P, K, ...] of each row (row i's views depend on (seed, step, index_i)).

  Args:
    x: a physical batch of examples (padding rows included; their views are
      harmless since their weight is 0).
    indices: [P] the rows' example indices in the training set (the
      `dpjax.privacy.batching.LogicalBatch.indices` row).
    step: the logical step t (an int or a traced int32).
    seed: the view stream's key data (`stream_data`); num_views: K ≥ 1; crop_padding, flip:
      see `augment`.
  """
  keys = view_keys(seed, step, indices, num_views)
  if not (crop_padding or flip):
    return jnp.broadcast_to(x[:, None], (x.shape[0], num_views) + x.shape[1:])
  one = functools.partial(augment, crop_padding=crop_padding, flip=flip)
  return jax.vmap(jax.vmap(one, in_axes=(0, None)), in_axes=(0, 0))(keys, x)


def mean_over_views(loss_fn: LossFn) -> LossFn:
  """`(params, {'x': views [K, ...], ...}) -> (mean_k loss_k, mean_k aux_k)` of a single-example
  loss `(params, example) -> (loss, aux)`.

  Its gradient is (1/K) Σ_k ∇loss_k, the view-averaged gradient that DP-SGD
  clips once (module docstring). With K = 1 it equals loss_fn on views[0].
  """

  def loss(params, example):
    views = example['x']
    per_view = jax.vmap(lambda v: loss_fn(params, {**example, 'x': v}))(views)
    return jax.tree.map(lambda a: jnp.mean(a, axis=0), per_view)

  return loss
