"""What `init_from` starts from, and whose privacy loss comes with it.

`config.init_from` names one of:

* a dpjax run: a workdir (its newest checkpoint) or one checkpoint step directory, whose
  metadata records the run's accounting inputs (the privacy part of its fingerprint) and
  those of the runs it started from;
* a dpjax export: a directory, or an .npz, whose privacy card records the same. The card is
  read from inside the .npz (`stored_params.EMBEDDED_CARD`, written by `dpjax.export`), so a
  copy of the file or a link to it anywhere still composes, else from `privacy_card.json`
  beside the file (links resolved: beside the file they point to); a card beside it that
  differs from the one inside is refused;
* other weights: an .npz with no card inside or beside it and no dpjax checkpoint. They are
  assumed public (trained on data that shares no individual with this run's) and do not enter
  ε: stripping an export's card from its weights is the user's declaration that they are.

The digest of the weights as read (`stored_params.sha256`) is recorded with the source: a
resume, the model's build and an export that merges frozen weights refuse weights that differ.

A dpjax source's release depends on its private training data. By default this run's ε is
the composition of every run of the chain (the source, the runs it started from, and so on)
with this run (`dpjax.privacy.accounting.composition`): each run's accountant is rebuilt from
its recorded inputs by the same `Accountant` that reported its ε. `init_from_disjoint_data =
True` declares that this run's data shares no individual with any run of the chain: ε is then
this run's alone. No identity heuristic decides: a source that trained on content identical to
this run's data is only named on the start line, and refused with the declaration it
contradicts. A source whose inputs cannot be rebuilt (an older dpjax, a non-private run,
inputs this dpjax does not know) is refused unless the data is declared disjoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from dpjax.privacy import samplers as samplers_lib
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import composition
from dpjax.trainer.workdir import checkpoints
from dpjax.trainer.workdir import stored_params

# The accounting inputs a record may hold (the privacy plan's fingerprint without the seed);
# one this dpjax cannot rebuild is refused, never ignored.
ACCOUNTING_FIELDS = (
  'privacy.enabled',
  'sampler.name',
  'sampler.num_examples',
  'sampler.batch_size',
  'sampler.max_batch_size',
  'privacy.group_size',
  'privacy.noise_multiplier',
  'privacy.clip_norm',
  'privacy.delta',
  'privacy.accountant',
  'privacy.matmul_format',
  'privacy.rounding_eta',
  'data.public_num_examples',
)
DISJOINT_HINT = (
  "Set init_from_disjoint_data = True only if this run's data shares no "
  'individual with it, or start from other weights.'
)


@dataclasses.dataclass(frozen=True)
class InitSource:
  """The source of the starting weights.

  Attributes:
    path: `config.init_from` as given.
    kind: 'run' (a dpjax workdir or checkpoint), 'export' (a privacy card beside the weights)
      or 'public' (neither: assumed public).
    chain: the records of the source's run first, then of the runs it started from (each
      {'name', 'steps', 'epsilon', 'delta', 'bound', 'accounting'}).
    disjoint: `config.init_from_disjoint_data`.
    content_sha256: the digest of the source's training data, when its checkpoint records it.
    params_path: where the weights are read (for a workdir, the checkpoint step whose metadata
      was read, so a run still writing there cannot change them after accounting; for a file,
      its real path).
    weights_sha256: the digest of the weights as read (`stored_params.sha256`).
  """

  path: str
  kind: str
  chain: tuple[dict[str, Any], ...] = ()
  disjoint: bool = False
  content_sha256: str | None = None
  params_path: str = ''
  weights_sha256: str | None = None

  @property
  def weights(self) -> str:
    """The path `stored_params.read_params` loads."""
    return self.params_path or self.path

  @property
  def composes(self) -> bool:
    return bool(self.chain) and not self.disjoint

  def prior_runs(self, group_size: int, **pld_options) -> tuple[composition.PriorRun, ...]:
    """The chain's runs as `composition.PriorRun`s for a run of group size k (none when the
    data is declared disjoint); `pld_options`: the run's PLD discretisation, if it sets one."""
    if not self.composes:
      return ()
    return tuple(_prior_run(self.path, record, group_size, pld_options) for record in self.chain)

  def describe(self) -> str:
    """One line for the start of the run."""
    if self.kind == 'public':
      return (
        f'Init: {self.path}: weights with no privacy card inside or beside them and no '
        'dpjax checkpoint, assumed public (trained on data sharing no individual with this '
        "run's); they do not enter ε."
      )
    own = self.chain[0]
    what = (
      f'a dpjax {"run" if self.kind == "run" else "export"} ({own["steps"]} steps, '
      f'ε = {_number(own.get("epsilon"))}'
    )
    what += f', started from {len(self.chain) - 1} more run(s))' if len(self.chain) > 1 else ')'
    if self.disjoint:
      return (
        f'Init: {self.path}: {what}; init_from_disjoint_data = True declares that this '
        "run's data shares no individual with it or the runs it started from: ε is this "
        "run's alone."
      )
    return (
      f'Init: {self.path}: {what}; every ε of this run is that of its composition with '
      f'{", ".join(r["name"] for r in self.chain)}.'
    )

  def metadata(self) -> dict[str, Any]:
    """What a checkpoint records of it (the chain, for runs that start from this one)."""
    return {
      'path': self.path,
      'kind': self.kind,
      'disjoint_data': self.disjoint,
      'params_path': self.weights,
      'weights_sha256': self.weights_sha256,
      'chain': list(self.chain),
    }

  def data_notes(self, content_sha256: str) -> list[str]:
    """Lines about a source that trained on this very content; refused if declared disjoint."""
    if self.content_sha256 is None or self.content_sha256 != content_sha256:
      return []
    if self.disjoint:
      raise ValueError(
        f'init_from_disjoint_data = True: but init_from = {self.path!r} trained '
        "on content identical to this run's training data. " + DISJOINT_HINT
      )
    return [
      f"init_from = {self.path!r} trained on content identical to this run's data: the "
      'released model depends on it through both runs (composed in ε).'
    ]


def _number(value) -> str:
  return 'n/a' if value is None else f'{value:.4g}'


def read_source(init_from: str, disjoint: bool = False) -> InitSource:
  """The InitSource `init_from` names, with the digest of its weights; ValueError (one line) if
  it names nothing readable."""
  path = init_from
  weights = _weights_file(path)
  if weights is not None:
    card, real = _card(path, weights), os.path.realpath(weights)
    source = (
      InitSource(path, 'public', disjoint=disjoint, params_path=real)
      if card is None
      else _from_card(path, card, disjoint, real)
    )
  else:
    meta, step_dir = _checkpoint_metadata(path)
    record = record_of_checkpoint(meta, os.path.abspath(path))
    chain = (record, *(meta.get('init_from') or {}).get('chain', ()))
    source = InitSource(
      path,
      'run',
      tuple(chain),
      disjoint,
      (meta.get('fingerprint') or {}).get('data.content_sha256'),
      step_dir,
    )
  digest = stored_params.sha256(stored_params.read_params(source.weights))
  return dataclasses.replace(source, weights_sha256=digest)


def _weights_file(path: str) -> str | None:
  """The .npz `path` names (itself, or an export directory's params.npz), or None for a dpjax
  workdir or checkpoint."""
  if os.path.isfile(path):
    return os.path.abspath(path)
  if os.path.isfile(os.path.join(path, stored_params.CARD_FILE)):
    return os.path.abspath(os.path.join(path, stored_params.PARAMS_FILE))
  return None


def _card(path: str, weights: str) -> dict[str, Any] | None:
  """The privacy card of the weights: the one inside the .npz (links resolved), or beside it
  or beside a link to it; ValueError when two of them differ."""
  real = os.path.realpath(weights)
  cards = {}
  if os.path.isfile(real) and (inside := stored_params.embedded_card(real)) is not None:
    cards[f'inside {real}'] = inside
  for beside in dict.fromkeys(
    os.path.join(os.path.dirname(p), stored_params.CARD_FILE) for p in (real, weights)
  ):
    if os.path.isfile(beside):
      try:
        with open(beside) as f:
          cards[beside] = json.load(f)
      except (OSError, ValueError) as e:
        raise ValueError(
          f'init_from = {path!r}: {beside} is unreadable ({type(e).__name__}: '
          f'{e}), so its privacy loss cannot be composed.'
        ) from None
  if any(card != next(iter(cards.values())) for card in cards.values()):
    raise ValueError(
      f'init_from = {path!r}: the privacy cards of these weights differ '
      f'({", ".join(cards)}), so which run trained them is unclear. Start from an '
      'export as dpjax.export wrote it, or remove the card that does not belong '
      'to these weights.'
    )
  return next(iter(cards.values()), None)


def _checkpoint_metadata(path: str) -> tuple[dict[str, Any], str]:
  """(metadata, step directory) of the newest checkpoint of a workdir, or of a step directory."""
  step_dir = path
  if os.path.isdir(os.path.join(path, checkpoints.CHECKPOINT_DIR)):
    rows = checkpoints.read_metadata(path)
    if not rows:
      raise ValueError(f'init_from = {path!r}: the workdir has no checkpoint.')
    meta = rows[-1]
    step_dir = os.path.join(checkpoints.checkpoint_dir(path), str(meta['step']))
  elif os.path.isdir(os.path.join(path, 'state')):
    try:
      with open(os.path.join(path, 'metadata', 'metadata')) as f:
        meta = json.load(f)
    except (OSError, ValueError) as e:
      meta = {'error': f'unreadable metadata: {e}'}
  else:
    raise ValueError(
      f'init_from = {path!r}: not found, or not an .npz, a dpjax export, a dpjax '
      'workdir or a checkpoint step directory.'
    )
  if 'error' in meta:
    raise ValueError(
      f"init_from = {path!r}: the checkpoint's metadata is unreadable "
      f'({meta["error"]}), so its privacy loss cannot be composed.'
    )
  return meta, step_dir


def record_of_checkpoint(meta: dict[str, Any], name: str) -> dict[str, Any]:
  """A chain record of a checkpoint's metadata: its ε and its accounting inputs."""
  fingerprint = meta.get('fingerprint') or {}
  accounting = {
    k: v
    for k, v in fingerprint.items()
    if (k.startswith(('sampler.', 'privacy.')) or k == 'data.public_num_examples')
    and k != composition.FINGERPRINT_FIELD
  } or None
  privacy = meta.get('privacy') or {}
  return {
    'name': name,
    'steps': meta.get('step'),
    'epsilon': privacy.get('epsilon'),
    'delta': privacy.get('delta'),
    'bound': privacy.get('bound'),
    'accounting': accounting,
  }


def _from_card(path: str, card: dict[str, Any], disjoint: bool, weights: str) -> InitSource:
  try:
    own = {
      'name': os.path.abspath(path),
      'steps': card['steps'],
      'epsilon': card.get('epsilon'),
      'delta': card.get('delta'),
      'bound': card.get('bound'),
      'accounting': card.get('accounting') or _card_inputs(card),
    }
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(
      f'init_from = {path!r}: its privacy card is unreadable ({type(e).__name__}: '
      f'{e}), so its privacy loss cannot be composed.'
    ) from None
  ancestors = [
    dict(r, name=f'{r.get("name")} (before {own["name"]})')
    for r in (card.get('init_from') or {}).get('chain', ())
  ]
  return InitSource(path, 'export', (own, *ancestors), disjoint, params_path=weights)


def _card_inputs(card: dict[str, Any]) -> dict[str, Any]:
  """The accounting inputs of a card written before cards recorded them."""
  sampler = card['sampler']
  return {
    'privacy.enabled': card['epsilon'] is not None,
    'sampler.name': sampler['name'],
    'sampler.num_examples': card['num_examples'],
    'sampler.batch_size': sampler['batch_size'],
    'sampler.max_batch_size': sampler['max_batch_size'],
    'privacy.group_size': card.get('group_size') or 1,
    'privacy.noise_multiplier': card['noise_multiplier'],
    'privacy.clip_norm': card['clip_norm'],
    'privacy.delta': card['delta'],
    'privacy.accountant': card['accountant'],
  }


def _prior_run(
  path: str, record: dict[str, Any], group_size: int, pld_options: dict[str, Any]
) -> composition.PriorRun:
  """The run of a chain record, its accountant rebuilt from the recorded inputs."""
  inputs, name = record.get('accounting'), record.get('name')
  where = f'init_from = {path!r}: ' + ('' if name == os.path.abspath(path) else f'{name}: ')
  if not inputs:
    raise ValueError(
      where + 'records no accounting inputs (written by an older dpjax), so its '
      "privacy loss cannot be composed with this run's. " + DISJOINT_HINT
    )
  if not inputs.get('privacy.enabled', True):
    raise ValueError(
      where + 'a non-private run (ε = ∞) trained it: its release is not private, '
      'and composed with this run neither is this one. ' + DISJOINT_HINT
    )
  unknown = sorted(set(inputs) - set(ACCOUNTING_FIELDS))
  if unknown:
    raise ValueError(
      where + f'records accounting inputs this dpjax cannot rebuild ({unknown}), '
      'so its privacy loss cannot be composed. Use the dpjax that wrote it.'
    )
  sampler = samplers_lib.make(
    inputs['sampler.name'], inputs['sampler.num_examples'], inputs['sampler.batch_size']
  )
  # Composition uses the PLD of each run's mechanism whatever it reported (RDP, Monte Carlo):
  # at this run's group size k > 1, where those do not apply, its accountant is the PLD.
  accountant = inputs['privacy.accountant']
  if group_size > 1 and accountant not in type(sampler).group_accountants:
    accountant = 'pld'
  acct = accountant_lib.Accountant(
    sampler,
    inputs['privacy.noise_multiplier'],
    inputs['privacy.delta'],
    accountant=accountant,
    max_batch_size=inputs['sampler.max_batch_size'],
    group_size=group_size,
    allow_large_delta=True,
    # Float rounding (η) as that run paid for it; with a public bound N̄ on its rows, the TV
    # penalty (dp_accounting's exact truncated event is for exactly N rows).
    sensitivity=1.0 + float(inputs.get('privacy.rounding_eta', 0.0)),
    exact_truncation=not inputs.get('data.public_num_examples'),
    **pld_options,
  )
  return composition.PriorRun(acct, int(record['steps']), name)


def card_fields(meta: dict[str, Any]) -> dict[str, Any]:
  """What an export's card records for composition: its accounting inputs, and the chain of
  runs it started from (named by their ε, without paths)."""
  own = record_of_checkpoint(meta, '')
  init = meta.get('init_from') or {}
  chain = [
    dict(r, name=f'a dpjax run ({r.get("steps")} steps, ε = {_number(r.get("epsilon"))})')
    for r in init.get('chain', ())
  ]
  return {
    'accounting': own['accounting'],
    'init_from': None
    if not init
    else {
      'kind': init.get('kind'),
      'disjoint_data': bool(init.get('disjoint_data')),
      'chain': chain,
    },
  }
