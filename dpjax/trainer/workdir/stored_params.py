"""Parameters as stored: the .npz a run starts from, the privacy card it carries, its digest.

A parameters file is an .npz keyed by '/'-joined parameter paths. A dpjax export's
`params.npz` (and `ema_params.npz`) also holds its privacy card, as the reserved entry
`EMBEDDED_CARD` (the card's UTF-8 JSON as uint8), so the weights carry their provenance: a
copy of the file, or a link to it, anywhere, is still known to be a private run's release
(`dpjax.trainer.planning.init_source` composes its privacy loss). Every reader here drops the entry: the
parameters read are the model's, unchanged. Removing the entry (re-saving the arrays without
it) is the user's declaration that the weights are public.

`read_params` loads the weights `init_from` names: an .npz, a dpjax export directory (its
`params.npz`), a dpjax workdir (its newest checkpoint's params) or one checkpoint step
directory; links are resolved (`os.path.realpath`) wherever a source is located.

`sha256` is the digest of the weights as read (each array's key, dtype, shape and bytes, in key
order): recorded when a run is planned, it is checked wherever the weights are read again
(building the model, a resume, an export merging frozen weights), so a run never releases or
continues from other weights than those it started from.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from flax import traverse_util
import numpy as np

from dpjax.trainer.workdir import checkpoints

CARD_FILE = 'privacy_card.json'
PARAMS_FILE = 'params.npz'
EMBEDDED_CARD = '__dpjax_privacy_card__'  # The reserved .npz entry holding the privacy card.


def save(path: str, arrays: dict[str, np.ndarray], card: dict[str, Any] | None = None) -> None:
  """Writes `arrays` ('/'-joined keys) as an .npz, with `card` as its reserved entry if given."""
  if EMBEDDED_CARD in arrays:
    raise ValueError(f'a parameter is named {EMBEDDED_CARD!r}, the entry reserved for the card.')
  extra = (
    {}
    if card is None
    else {EMBEDDED_CARD: np.frombuffer(json.dumps(card).encode('utf-8'), np.uint8)}
  )
  np.savez(path, **arrays, **extra)


def embedded_card(path: str) -> dict[str, Any] | None:
  """The privacy card an .npz carries, or None (not an .npz, or no card in it)."""
  if not path.endswith('.npz'):
    return None
  try:
    with np.load(path) as f:
      if EMBEDDED_CARD not in f.files:
        return None
      card = json.loads(f[EMBEDDED_CARD].tobytes().decode('utf-8'))
    if not isinstance(card, dict):
      raise ValueError(f'a {type(card).__name__}, not a card')
  except (OSError, ValueError, EOFError) as e:
    raise ValueError(
      f'init_from = {path!r}: the privacy card inside it is unreadable '
      f'({type(e).__name__}: {e}), so its privacy loss cannot be composed.'
    ) from None
  return card


def read_params(init_from: str) -> dict[str, np.ndarray]:
  """The flat parameters stored at `init_from` (.npz, dpjax export, workdir or step dir)."""
  if not isinstance(init_from, str) or not init_from:
    raise ValueError(
      f'init_from = {init_from!r}: must name an .npz file, a dpjax workdir or an '
      'orbax checkpoint directory.'
    )
  if os.path.isfile(init_from):
    if not init_from.endswith('.npz'):
      raise ValueError(
        f'init_from = {init_from!r}: a file must be an .npz of parameters keyed by '
        "'/'-joined paths."
      )
    with np.load(init_from) as f:
      return {k: f[k] for k in f.files if k != EMBEDDED_CARD}
  export = os.path.join(init_from, PARAMS_FILE)
  if os.path.isfile(os.path.join(init_from, CARD_FILE)) and os.path.isfile(export):
    return read_params(export)  # A dpjax export.
  if os.path.isdir(os.path.join(init_from, checkpoints.CHECKPOINT_DIR)):  # A dpjax workdir.
    directory = checkpoints.checkpoint_dir(init_from)
    steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
    if not steps:
      raise ValueError(f'init_from = {init_from!r}: the workdir has no checkpoint.')
    state = checkpoints.read_state(init_from, steps[-1])
  elif os.path.isdir(os.path.join(init_from, 'state')):  # One checkpoint step directory.
    step_dir = os.path.realpath(init_from)
    workdir = os.path.dirname(os.path.dirname(step_dir))
    state = checkpoints.read_state(workdir, int(os.path.basename(step_dir)))
  else:
    raise ValueError(
      f'init_from = {init_from!r}: not found, or not an .npz, a dpjax workdir or '
      'a checkpoint step directory.'
    )
  if 'params' not in state:
    raise ValueError(
      f'init_from = {init_from!r}: the checkpoint holds no params (keys {sorted(state)}).'
    )
  flat = traverse_util.flatten_dict(state['params'], sep='/')
  return {k: np.asarray(v) for k, v in flat.items()}


def sha256(flat: dict[str, Any]) -> str:
  """SHA-256 of flat parameters: each array's key, dtype, shape and bytes, in key order."""
  digest = hashlib.sha256()
  for key in sorted(flat):
    array = np.ascontiguousarray(flat[key])
    digest.update(json.dumps([key, array.dtype.str, list(array.shape)]).encode('utf-8'))
    digest.update(array.tobytes())
  return digest.hexdigest()


def refuse_changed(init_from: str, recorded: str | None, current: str) -> None:
  """ValueError (one line) when the weights at `init_from` are not those a run started from."""
  if recorded is not None and recorded != current:
    raise ValueError(
      f'init_from = {init_from!r}: these weights are not those this run started from (SHA-256 '
      f'{recorded[:12]}… recorded, {current[:12]}… now: changed or replaced since), nor those '
      'it trained with and its ε accounted for. Restore the weights it started from, or train '
      'from these in a new --workdir.'
    )
