"""Publish a run: its parameters and a privacy card, and nothing else.

  python -m dpjax.export --workdir <workdir> --out <model_dir> [--step S]

Writes, into a new directory `<model_dir>` (atomically: it appears complete or
not at all):

* `params.npz`: every parameter of the model ('/'-joined keys, the format
  `init_from` reads; fine-tuned runs are merged: frozen weights and W + (α/r)·A·B);
* `ema_params.npz`: the EMA of the parameters, when the run kept one;
* `privacy_card.json`: ε, δ, the kind of bound, the accountant, the sampler, N, b, B, σ,
  C, η (the float rounding ε pays for) and its cost Δε, the steps, the neighbouring
  relation, whether the seed was drawn in secret, the model and the public preprocessing
  needed to use the parameters, and the dpjax version.

Nothing else: no seed, no config or data paths, no metrics, no statistics of
the private data. Everything in the workdir stays private (the seed, the
checkpoints' optimiser state, metrics.jsonl with its nonprivate_* values;
docs/threat_model.md).

Two runs that share a seed share their noise, so releasing both reveals the
noise-free difference of their gradients. Each export is recorded (the seed's
SHA-256, the workdir, the output) in a private registry on this machine
(`$DPJAX_STATE_DIR/exports.jsonl`, default `~/.local/state/dpjax`), and an
export into a directory tree that already holds another run's export with the
same seed is refused (`--allow_shared_seed` overrides). Runs with drawn seeds
(the default) never share one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from importlib import metadata as importlib_metadata
from typing import Any

from absl import flags
import ml_collections
import numpy as np

from dpjax.trainer import checkpoints
from dpjax.trainer import cli
from dpjax.trainer import finetune
from dpjax.trainer import run_seed

PROG = 'python -m dpjax.export'
CARD = 'privacy_card.json'
PARAMS, EMA_PARAMS = 'params.npz', 'ema_params.npz'
REGISTRY = 'exports.jsonl'
CARD_FORMAT = 'dpjax privacy card 1'


def state_dir() -> str:
  """Where this machine's private dpjax state lives (the export registry)."""
  return os.environ.get('DPJAX_STATE_DIR') or os.path.join(
      os.environ.get('XDG_STATE_HOME') or os.path.join(os.path.expanduser('~'), '.local',
                                                       'state'), 'dpjax')


def dpjax_version() -> str:
  try:
    return importlib_metadata.version('dpjax')
  except importlib_metadata.PackageNotFoundError:
    return 'unknown'


def _checkpoint(workdir: str, step: int | None) -> dict:
  rows = [row for row in checkpoints.read_metadata(workdir) if 'error' not in row]
  if step is not None:
    rows = [row for row in rows if row['step'] == step]
  if not rows:
    where = f'at step {step} ' if step is not None else ''
    raise ValueError(f'--workdir {workdir!r}: no readable checkpoint {where}(train first, or see '
                     f'python -m dpjax.checkpoints {workdir}).')
  return rows[-1]


def privacy_card(meta: dict) -> dict[str, Any]:
  """The card of a checkpoint's metadata: the claim, the mechanism's public parameters, the model."""
  privacy, sampler, config = meta['privacy'], meta['sampler'], meta['config']
  k = meta.get('group_size') or 1
  drawn = meta.get('seed_source') in ('drawn', 'workdir')
  card = {
      'format': CARD_FORMAT,
      'dpjax_version': dpjax_version(),
      'epsilon': privacy.get('epsilon'),
      'delta': privacy.get('delta'),
      'bound': privacy.get('bound'),
      'accountant': privacy.get('accountant'),
      'steps': meta['step'],
      'neighbouring_relation': ('add or remove one training example' if k == 1 else
                                f'add or remove up to {k} training examples (group privacy)'),
      'guarantee': None,
      'sampler': {key: sampler.get(key) for key in ('name', 'batch_size', 'expected_batch_size',
                                                    'max_batch_size', 'steps_per_epoch')},
      'num_examples': meta['num_examples'],
      'noise_multiplier': meta.get('noise_multiplier'),
      'clip_norm': meta.get('clip_norm'),
      'float_rounding': meta.get('rounding'),
      'group_size': k if privacy.get('epsilon') is not None else None,
      'seed_drawn_in_secret': drawn,
      'model': config['model'],
      'num_classes': meta.get('model_io', {}).get('num_classes'),
      'input_shape': meta.get('model_io', {}).get('input_shape'),
      'preprocessing': {key: config['data'][key] for key in ('scale', 'mean', 'std',
                                                             'label_format')},
  }
  if privacy.get('epsilon') is None:
    card['guarantee'] = 'none: a non-private run (ε = ∞).'
  else:
    card['guarantee'] = (
        f"({privacy['epsilon']:.6g}, {privacy['delta']:g})-DP ({privacy['bound']} bound, "
        f"{privacy['accountant']}) of these parameters with respect to the training set, for "
        f"{card['neighbouring_relation']}; it assumes the randomness of the run was secret "
        + ('(its seed was drawn from OS entropy)' if drawn else
           '(its seed was given in the config: the claim holds only if that seed was kept '
           'secret)') + '.')
  return card


def _full_params(trainable: dict, meta: dict, workdir: str) -> dict:
  """The model's parameters: trainable ones, merged with frozen weights and LoRA adapters."""
  config = meta['config']
  if not (config.get('freeze') or config.get('lora', {}).get('rank')):
    return trainable
  from dpjax.models import factory as models  # pylint: disable=import-outside-toplevel
  from dpjax.privacy import prng  # pylint: disable=import-outside-toplevel
  io, seed = meta.get('model_io'), run_seed.stored_seed(workdir)
  if io is None or seed is None:
    raise ValueError(f'--workdir {workdir!r}: a fine-tuned run needs its model_io metadata and '
                     'private/seed.json to merge the frozen weights; neither may be missing.')
  model = models.make_model(ml_collections.ConfigDict(config['model']), io['num_classes'],
                            tuple(io['input_shape']))
  params = prng.init_params(model, seed.value, tuple(io['input_shape']))
  if config.get('init_from'):
    params = finetune.load_pretrained(config['init_from'], params,
                                      config.get('init_from_rules', ()))
  lora = config.get('lora', {})
  wrapped, _ = finetune.make_finetune(
      model, params, freeze=tuple(config.get('freeze', ())), lora_rank=lora.get('rank', 0),
      lora_alpha=lora.get('alpha', 1.0), lora_targets=tuple(lora.get('targets', ())),
      seed=seed.value)
  return wrapped.full_params(trainable)


def _flat_numpy(params) -> dict[str, np.ndarray]:
  return {k: np.asarray(v) for k, v in finetune.flatten(params).items()}


def _registry_conflict(digest: str, workdir: str, out: str) -> dict | None:
  """An earlier export of another run with the same seed into the same directory tree."""
  path = os.path.join(state_dir(), REGISTRY)
  if not os.path.exists(path):
    return None
  tree = os.path.dirname(out)
  with open(path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:
        continue
      other_tree = os.path.dirname(row.get('out', ''))
      same_tree = os.path.commonpath([tree, other_tree]) in (tree, other_tree)
      if (row.get('seed_sha256') == digest and row.get('workdir') != workdir and same_tree
          and os.path.exists(row.get('out', ''))):
        return row
  return None


def _record(digest: str, workdir: str, out: str) -> None:
  directory = state_dir()
  os.makedirs(directory, mode=0o700, exist_ok=True)
  fd = os.open(os.path.join(directory, REGISTRY), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
  with os.fdopen(fd, 'a') as f:
    f.write(json.dumps({'seed_sha256': digest, 'workdir': workdir, 'out': out,
                        'time': time.time()}) + '\n')


def export(workdir: str, out: str, *, step: int | None = None,
           allow_shared_seed: bool = False) -> dict[str, Any]:
  """Writes the release of `workdir` (newest checkpoint, or `step`) into the new directory `out`.

  Returns the privacy card. Raises ValueError (one line) before writing anything if the
  workdir has no readable checkpoint, `out` exists and is not empty, or another run's export
  with the same seed is in the same directory tree.
  """
  workdir, out = os.path.realpath(workdir), os.path.realpath(out)
  if not os.path.isdir(workdir):
    raise ValueError(f'--workdir {workdir!r}: not a directory.')
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ValueError(f'--out {out!r}: exists and is not an empty directory; an export goes into '
                     'a new directory.')
  if os.path.commonpath([workdir, out]) == workdir:
    raise ValueError(f'--out {out!r}: is inside the workdir, which must stay private.')
  meta = _checkpoint(workdir, step)
  digest = meta.get('fingerprint', {}).get('seed_sha256')
  if digest is None:
    raise ValueError(f'--workdir {workdir!r}: its checkpoints were written by an older dpjax '
                     '(no seed digest); retrain to export.')
  conflict = None if allow_shared_seed else _registry_conflict(digest, workdir, out)
  if conflict is not None:
    raise ValueError(
        f'--workdir {workdir!r} used the same seed as {conflict["workdir"]!r}, already exported to '
        f'{conflict["out"]!r} in the same directory tree: two releases that share their noise '
        'reveal the noise-free difference of their gradients. Retrain one run with another seed '
        '(leave seed unset to draw one), or pass --allow_shared_seed if you know why.')
  state = checkpoints.read_state(workdir, meta['step'])  # Verified against the manifest.
  card = privacy_card(meta)
  files = {PARAMS: _flat_numpy(_full_params(state['params'], meta, workdir))}
  if meta['config'].get('ema_decay'):
    files[EMA_PARAMS] = _flat_numpy(_full_params(state['ema']['params'], meta, workdir))
  card['files'] = sorted(files) + [CARD]
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix='.dpjax-export-', dir=parent)
  try:
    for name, arrays in files.items():
      np.savez(os.path.join(staging, name), **arrays)
    with open(os.path.join(staging, CARD), 'w') as f:
      json.dump(card, f, indent=2)
      f.write('\n')
    if os.path.isdir(out):
      os.rmdir(out)  # Empty (checked above).
    os.rename(staging, out)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  _record(digest, workdir, out)
  return card


def main(argv: list[str] | None = None) -> int:
  logging.getLogger('absl').setLevel(logging.ERROR)  # Orbax's INFO/WARNING lines on reads.
  fv = flags.FlagValues()
  flags.DEFINE_string('workdir', None, 'the run to publish (stays private)', flag_values=fv)
  flags.DEFINE_string('out', None, 'a new directory for the release', flag_values=fv)
  flags.DEFINE_integer('step', None, 'the checkpoint to export (default: the newest)',
                       flag_values=fv)
  flags.DEFINE_boolean('allow_shared_seed', False, 'export even if another run with the same '
                       'seed was exported into the same directory tree', flag_values=fv)
  cli.parse_command(PROG, __doc__, fv, sys.argv[1:] if argv is None else argv)
  if not fv.workdir or not fv.out:
    cli.fail(PROG, '--workdir and --out are required. See --help.')
  try:
    card = export(fv.workdir, fv.out, step=fv.step, allow_shared_seed=fv.allow_shared_seed)
  except ValueError as e:
    cli.fail(PROG, e)
  eps = ('non-private (ε = ∞)' if card['epsilon'] is None else
         f"ε = {card['epsilon']:.4f} ({card['bound']} bound, {card['accountant']}), "
         f"δ = {card['delta']:g}")
  print(f'Exported step {card["steps"]} to {os.path.realpath(fv.out)}: {", ".join(card["files"])}; '
        f'{eps}.')
  return 0


if __name__ == '__main__':
  sys.exit(main())
