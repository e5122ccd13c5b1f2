"""Fine-tuning from pretrained parameters: loading them (freezing and LoRA: `dpjax.privacy.lora`).

Loading (`config.init_from`, `config.init_from_rules`): a `.npz` of parameters
keyed by their '/'-joined paths (`save_npz` writes one), a dpjax export directory
(its `params.npz`), a dpjax workdir (its newest checkpoint's `params`), or one
orbax checkpoint step directory of it (`dpjax.trainer.workdir.stored_params`, which also
checks them against the digest of the weights a run started from). Whose privacy
loss comes with them: `dpjax.trainer.planning.init_source`.
Rename rules (regex, replacement) are applied in order to the file's keys
with `re.sub`; a key renamed to '' is dropped. The result must match the
model's parameters key for key and shape for shape, else ONE ValueError line
lists the missing and unexpected keys and the shape mismatches.

Freezing (`config.freeze`) and LoRA (`lora.rank`, `lora.alpha`, `lora.targets`) partition
the loaded parameters: `dpjax.privacy.lora.make_finetune` (the library tier's too), whose
frozen base the DP step takes as an argument of its programs (`dpjax.privacy.dp_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from dpjax.trainer.workdir import stored_params
from dpjax.privacy import lora

Params = Any


def save_npz(path: str, params: Params) -> None:
  """Writes params as an .npz keyed by '/'-joined paths (what `init_from` reads)."""
  stored_params.save(path, {k: np.asarray(v) for k, v in lora.flatten(params).items()})


def _listing(items: Sequence[str], limit: int = 8) -> str:
  shown = ', '.join(items[:limit])
  return shown + (f' and {len(items) - limit} more' if len(items) > limit else '')


def apply_rules(flat: dict[str, Any], rules: Sequence[Sequence[str]]) -> dict[str, Any]:
  """Renames keys by each (regex, replacement) in turn (re.sub); '' drops the key."""
  out = dict(flat)
  for rule in rules:
    if not (
      isinstance(rule, (tuple, list)) and len(rule) == 2 and all(isinstance(s, str) for s in rule)
    ):
      raise ValueError(f'init_from_rules entry {rule!r}: must be a (regex, replacement) pair.')
    try:
      pattern = re.compile(rule[0])
    except re.error as e:
      raise ValueError(f'init_from_rules regex {rule[0]!r}: invalid ({e}).') from None
    renamed = {}
    for key, value in out.items():
      new = pattern.sub(rule[1], key)
      if new in renamed:
        raise ValueError(f'init_from_rules {tuple(rule)!r}: two keys map to {new!r}.')
      if new:
        renamed[new] = value
    out = renamed
  return out


def load_pretrained(
  init_from: str, template: Params, rules: Sequence[Sequence[str]] = (), sha256: str | None = None
) -> Params:
  """Pretrained parameters with the structure, shapes and dtypes of `template`.

  sha256: the digest of the weights the run started from (`stored_params.sha256`), if
  recorded: weights read here that differ from them are refused.

  Raises ValueError (one line) listing missing keys, unexpected keys and shape
  mismatches after the rename `rules`, or naming weights that changed.
  """
  stored = stored_params.read_params(init_from)
  stored_params.refuse_changed(init_from, sha256, stored_params.sha256(stored))
  flat = apply_rules(stored, rules)
  want = lora.flatten(template)
  missing = sorted(set(want) - set(flat))
  unexpected = sorted(set(flat) - set(want))
  shapes = sorted(
    f'{k} {tuple(np.shape(flat[k]))} vs model {tuple(np.shape(want[k]))}'
    for k in set(want) & set(flat)
    if np.shape(flat[k]) != np.shape(want[k])
  )
  if missing or unexpected or shapes:
    parts = [
      f'{name} [{_listing(items)}]'
      for name, items in (
        ('missing keys', missing),
        ('unexpected keys', unexpected),
        ('shape mismatches', shapes),
      )
      if items
    ]
    raise ValueError(
      f'init_from = {init_from!r} does not match the model: '
      + '; '.join(parts)
      + '. Rename keys with init_from_rules (regex, replacement).'
    )
  return lora.unflatten({k: jnp.asarray(flat[k], jnp.asarray(v).dtype) for k, v in want.items()})
