"""N as a run releases it: the exact number of training examples, treated as public, or a
declared public upper bound N̄ (`data.public_num_examples`) that keeps the exact N private.

Under add/remove neighbours N alone decides membership: a card saying N = 1437 tells D
(1437 rows) from D minus one record. DP-SGD libraries take N as public (σ is calibrated
from q = b/N); dpjax does so by default and says so on the card and in
docs/threat_model.md. With a bound N̄ >= N (e.g. N rounded up) the sampler's N is N̄: q =
b/N̄, the epochs (ceil(N̄/b) steps), the cap B, the δ < 1/N̄ check, σ, ε and the card are
functions of N̄ alone, and each row present joins a batch with probability q.

Why that is sound, for Poisson sampling only (Mironov, Talwar & Zhang 2019, "Rényi
Differential Privacy of the Sampled Gaussian Mechanism": its privacy loss is a function of
q and σ): each row's selection is independent of the others, so the privacy loss does not
depend on the number of rows; the divisor is
E[n_t] = q·N̄ = b, public; the truncation penalty's mass T·Pr[Binomial(rows + k, q) > B]
grows with the rows, so the accountant takes it at N̄ + k (and skips dp_accounting's exact
truncated event, made for exactly N rows). Samplers whose batches depend on N (epochs of
ceil(N/b) steps, fixed-size subsets) are refused with a bound. So is a training set of
more than N̄ rows, before anything runs: the guarantee covers datasets of at most N̄ rows.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from dpjax.privacy import samplers as samplers_lib

FIELD = 'data.public_num_examples'


class SizeError(ValueError):
  """The declared bound does not fit the data or the sampler (one line naming the field)."""


def declared_bound(config: ml_collections.ConfigDict | dict) -> int:
  """N̄, or 0 when the exact N is treated as public (also for configs without the field)."""
  return int((config.get('data') or {}).get('public_num_examples', 0) or 0)


def sampler_sizes(config: ml_collections.ConfigDict, num_rows: int) -> tuple[int, int | None]:
  """(the sampler's N, its `num_rows`): (num_rows, None) when N is public, else (N̄, num_rows).

  SizeError when the bound is below the rows or the sampler needs the exact N.
  """
  bound = declared_bound(config)
  if not bound:
    return num_rows, None
  name = config.sampler.name
  if not samplers_lib.sampler_class(name).bounds_rows:
    raise SizeError(
      f"{FIELD} = {bound} needs sampler.name = 'poisson': the {name} sampler's "
      'batches depend on the exact N, so ε cannot be accounted from a bound. Use '
      f'poisson, or set {FIELD} = 0 (N treated as public).'
    )
  if num_rows > bound:
    raise SizeError(
      f'{FIELD} = {bound}: the training set has more examples (with audit '
      'canaries, N + m); it must be a public upper bound on them, e.g. N rounded '
      'up.'
    )
  return bound, num_rows


def describe(sampler: samplers_lib.Sampler) -> str:
  """N as the start lines state it: exact, or the bound (the exact N is never printed)."""
  if sampler.num_rows is None:
    return f'N = {sampler.num_examples}'
  return f'N ≤ {sampler.num_examples} ({FIELD}; the exact N stays private)'


def card_fields(num_examples: int, bound: int) -> dict[str, Any]:
  """The card's N, whether it is the exact N (then treated as public) and why."""
  if bound:
    note = (
      f'num_examples is {FIELD}, a declared public upper bound on the number of '
      'training examples; σ, q = b/N, B and ε were computed from it, and the exact number '
      'is not released.'
    )
  else:
    note = (
      'num_examples is the exact number of training examples and is treated as public: '
      'under add/remove neighbours it tells whether a record was in the training set. Set '
      f'{FIELD} to release a public upper bound instead.'
    )
  return {
    'num_examples': num_examples,
    'exact_num_examples_is_public': not bound,
    'num_examples_note': note,
  }
