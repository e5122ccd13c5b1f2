"""The Gaussian privatizer's state: the logical step it noises next, and what made it.

  GaussianNoiseState(step, noise_multiplier, clip_norm, expected_batch_size,
                     max_batch_size, fingerprint)

`step` is the one step counter of a loop written with the library: the privatizer noises
step t only when told `step=t` (the logical batch's own t, `LogicalBatch.step`) and then
expects t + 1, and a plan's batcher starts at the state's t (`PrivacyPlan.batcher`). σ, C
and b are kept exactly (the 64 bits of each float as two uint32 words: JAX computes in
float32 by default), B as an integer and the plan's fingerprint as its SHA-256 (eight
uint32 words). A restored state is compared field by field with the plan that is to
continue it, on the host (`check`, one line naming what differs) and inside every update
(`accepts`); an update it does not accept releases NaN and leaves `step = REFUSED`, so the
state refuses every later step too.

Inputs: the state holds no secret (the fingerprint holds the seed only through a hash).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# `step` after a refused update: no logical step has this number (steps are < 2**32 − 1).
REFUSED = 2**32 - 1
FLOAT_FIELDS = ('noise_multiplier', 'clip_norm', 'expected_batch_size')


class GaussianNoiseState(NamedTuple):
  """The next logical step to noise and the privatizer's σ, C, b, B and plan fingerprint."""

  step: jax.Array  # uint32 scalar: the t the next update must be told (REFUSED: none).
  noise_multiplier: jax.Array  # σ as its float64 bits, uint32[2] (`float_of`).
  clip_norm: jax.Array  # C, likewise.
  expected_batch_size: jax.Array  # b, likewise.
  max_batch_size: jax.Array  # B, uint32 (0: not given).
  fingerprint: jax.Array  # uint32[8]: SHA-256 of the plan's fingerprint (`digest_words`).


def float_words(value: float) -> np.ndarray:
  """The 64 bits of float(value) as two uint32 words (exact, whatever JAX's precision)."""
  return np.frombuffer(np.float64(value).tobytes(), np.uint32).copy()


def float_of(words) -> float:
  """The float whose bits `float_words` stored."""
  return float(np.frombuffer(np.asarray(words, np.uint32).tobytes(), np.float64)[0])


def digest_words(fingerprint: Mapping[str, Any]) -> np.ndarray:
  """SHA-256 of a fingerprint (JSON, sorted keys) as eight uint32 words."""
  text = json.dumps(dict(fingerprint), sort_keys=True, default=str)
  return np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint32).copy()


def made_with(
  noise_multiplier: float,
  clip_norm: float,
  expected_batch_size: float,
  max_batch_size: int,
  fingerprint: Mapping[str, Any],
) -> GaussianNoiseState:
  """The state of a privatizer with these σ, C, b, B and fingerprint at step 0."""
  return GaussianNoiseState(
    step=np.zeros((), np.uint32),
    noise_multiplier=float_words(noise_multiplier),
    clip_norm=float_words(clip_norm),
    expected_batch_size=float_words(expected_batch_size),
    max_batch_size=np.asarray(max_batch_size, np.uint32),
    fingerprint=digest_words(fingerprint),
  )


def accepts(state: GaussianNoiseState, made: GaussianNoiseState, step) -> jax.Array:
  """(Traceable) whether `state` is at `step` and was made as `made` (every field but step)."""
  ok = jnp.asarray(state.step, jnp.uint32) == jnp.asarray(step, jnp.uint32)
  for name in GaussianNoiseState._fields[1:]:
    ok &= jnp.all(jnp.asarray(getattr(state, name), jnp.uint32) == getattr(made, name))
  return ok


def find(opt_state: Any, kinds: tuple[type, ...] = (GaussianNoiseState,), what: str = 'Gaussian'):
  """The one privatizer state of `kinds` inside an optax state (e.g. a chain's); one-line
  ValueError otherwise (`what` names the kind in it)."""
  found = [
    s
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds))
    if isinstance(s, kinds)
  ]
  if len(found) != 1:
    raise ValueError(
      f'the optimiser state holds {len(found)} {what} privatizer states, not 1: pass the '
      "state of `tx.init(params)` with the plan's privatizer in `tx` (restore a checkpoint "
      'into that structure, e.g. orbax with `tx.init(params)` as its target).'
    )
  return found[0]


def describe(state: GaussianNoiseState) -> dict[str, Any]:
  """The state's fields as Python numbers (σ, C, b as floats; the fingerprint as hex)."""
  out = {name: float_of(getattr(state, name)) for name in FLOAT_FIELDS}
  out['step'] = int(np.asarray(state.step))
  out['max_batch_size'] = int(np.asarray(state.max_batch_size))
  out['fingerprint'] = np.asarray(state.fingerprint, np.uint32).tobytes().hex()
  return out


def check(opt_state: Any, made: GaussianNoiseState, who: str = 'the plan') -> int:
  """The step of the privatizer state in `opt_state`, after checking it was made as `made`.

  Raises:
    ValueError, one line: the state refused a step, or a field differs (each named, the
      state's value, what ran, beside the one `who` has).
  """
  state, want = describe(find(opt_state)), describe(made)
  if state['step'] == REFUSED:
    raise ValueError(
      'this privatizer state refused an update (a step other than the one it expected, or '
      'a state made by another plan): the parameters after it are NaN. Resume from the '
      'last state it accepted.'
    )
  differ = [
    f"{name}: the state's {state[name]!r} (what ran) vs {who}'s {want[name]!r}"
    for name in (*FLOAT_FIELDS, 'max_batch_size')
    if state[name] != want[name]
  ]
  if state['fingerprint'] != want['fingerprint'] and not differ:
    differ.append(
      'the fingerprint (sampler, N, b, δ, accountant, group size, the matmul '
      'format and η of the precision and platform, the prior runs, or seed)'
    )
  if differ:
    raise ValueError(
      f'the privatizer state was not made by {who}: {"; ".join(differ)}. A '
      'resumed loop keeps what it ran with: PrivacyPlan.create(..., '
      'resume_from=opt_state) takes σ from the state.'
    )
  return state['step']


def check_after(step, last: int | None, who: str = 'DPStep.apply') -> int:
  """int(step) if it is after `last` (the last step noised; None: none yet), else ValueError.

  Step t's noise is a function of (seed, t): two sums released under the same noise reveal
  their difference without any, so a step is noised once, and steps only move forward.
  """
  t = int(step)
  if last is not None and t <= last:
    raise ValueError(
      f'{who}: step {t} is not after step {last}, the last one noised: the noise of a step '
      'is that of (seed, t), and two sums released under one noise reveal their difference. '
      'Each logical step is applied once, in order.'
    )
  return t
