"""Publish a run: its parameters and a privacy card, and nothing else.

  python -m dpjax.export --workdir <workdir> --out <model_dir> [--step S]

Writes, into a new directory `<model_dir>` (atomically: it appears complete or
not at all):

* `params.npz`: every parameter of the model ('/'-joined keys, the format
  `init_from` reads; fine-tuned runs are merged: frozen weights and W + (α/r)·A·B,
  the frozen ones re-read from `init_from` and refused unless they are those the run
  started from, by their recorded digest);
* `ema_params.npz`: the EMA of the parameters, when the run kept one;
  both also carry the privacy card, as the reserved entry `__dpjax_privacy_card__`
  (`dpjax.trainer.workdir.stored_params`, whose readers skip it), so a copy of either file
  still composes its privacy loss when a run starts from it;
* `privacy_card.json`: ε, δ, the kind of bound, the accountant, the sampler, N
  (exact and treated as public, or the declared public bound
  `data.public_num_examples`: `dpjax.trainer.planning.training_set_size`), b, B, σ, C,
  η (the float rounding ε pays for) and its cost Δε, the steps, the neighbouring
  relation, whether the seed was drawn in secret,
  the model and the public preprocessing needed to use the parameters (the
  resolved scale), and the dpjax version; the accounting inputs and the runs it
  started from (`init_from`: their ε, steps and inputs, without paths), so that a
  run starting from this export composes their privacy loss with its own.

Nothing else: no seed, no config or data paths, no metrics, no statistics of
the private data beyond N when N is treated as public. Everything in the workdir stays private (the seed, the
checkpoints' optimiser state, metrics.jsonl with its nonprivate_* values;
docs/threat_model.md).

Two runs that share a seed share their noise, so releasing both reveals the
noise-free difference of their gradients. Each export is recorded (the seed's
SHA-256, the run id, the workdir, the output) in this user's seed record
(`dpjax.trainer.workdir.seed_record`: `$DPJAX_STATE_DIR/seeds.jsonl`, default
`~/.local/state/dpjax`), and the export of a run whose seed another run already
exported, anywhere, is refused (`--allow_shared_seed` overrides). Runs are told
apart by their run id (`dpjax.trainer.workdir.run_identity`), not their path: a workdir
deleted and trained again in the same path is another run. Runs with drawn
seeds (the default) never share one.
"""

from __future__ import annotations

if __name__ == '__main__':  # Ctrl-C or SIGTERM from here on, imports included: one line, exit.
  from dpjax.trainer.commands import interrupts  # pylint: disable=g-import-not-at-top

  interrupts.exit_on_signals(
    'python -m dpjax.export', ': --out holds the whole export or nothing, never a part'
  )

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import logging
import os
import sys
import tempfile
from importlib import metadata as importlib_metadata
from typing import TYPE_CHECKING, Any

from absl import flags
import ml_collections

from dpjax.trainer.commands import cli
from dpjax.trainer.commands import interrupts
from dpjax.trainer.workdir import seed_record
from dpjax.trainer.workdir import write_errors

# The checkpoints and the model (jax, orbax, flax) are imported by the functions that read
# them: --help and a bad flag answer at once (tests/e2e/test_cli_start.py).
# pylint: disable=import-outside-toplevel
if TYPE_CHECKING:
  import numpy as np

PROG = 'python -m dpjax.export'
EMA_PARAMS = 'ema_params.npz'
CARD_FORMAT = 'dpjax privacy card 1'


def dpjax_version() -> str:
  try:
    return importlib_metadata.version('dpjax')
  except importlib_metadata.PackageNotFoundError:
    return 'unknown'


def _checkpoint(workdir: str, step: int | None) -> dict:
  from dpjax.trainer.workdir import checkpoints

  rows = [row for row in checkpoints.read_metadata(workdir) if 'error' not in row]
  if step is not None:
    rows = [row for row in rows if row['step'] == step]
  if not rows:
    where = f'at step {step} ' if step is not None else ''
    raise ValueError(
      f'--workdir {workdir!r}: no readable checkpoint {where}(train first, or see '
      f'python -m dpjax.checkpoints {workdir}).'
    )
  return rows[-1]


def privacy_card(meta: dict) -> dict[str, Any]:
  """The card of a checkpoint's metadata: the claim, the mechanism's public parameters, the model."""
  from dpjax.trainer.planning import init_source, training_set_size

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
    'neighbouring_relation': (
      'add or remove one training example'
      if k == 1
      else f'add or remove up to {k} training examples (group privacy)'
    ),
    'guarantee': None,
    'sampler': {
      key: sampler.get(key)
      for key in ('name', 'batch_size', 'expected_batch_size', 'max_batch_size', 'steps_per_epoch')
    }
    | ({'num_groups': sampler['num_groups']} if 'num_groups' in sampler else {}),
    **training_set_size.card_fields(meta['num_examples'], training_set_size.declared_bound(config)),
    'noise_multiplier': meta.get('noise_multiplier'),
    # The mechanism (checkpoints before correlated noise ran DP-SGD's Gaussian).
    'noise': meta.get('noise') or ({'name': 'gaussian'} if privacy.get('epsilon') else None),
    'clip_norm': meta.get('clip_norm'),
    'float_rounding': meta.get('rounding'),
    'group_size': k if privacy.get('epsilon') is not None else None,
    'seed_drawn_in_secret': drawn,
    'model': config['model'],
    'num_classes': meta.get('model_io', {}).get('num_classes'),
    'input_shape': meta.get('model_io', {}).get('input_shape'),
    # As it ran (the resolved scale); older checkpoints kept only the config's values.
    'preprocessing': meta.get('model_io', {}).get('preprocessing')
    or {key: config['data'][key] for key in ('scale', 'mean', 'std', 'label_format')},
    **init_source.card_fields(meta),
  }
  composed = (
    (card['init_from'] or {}).get('chain')
    if not (card['init_from'] or {}).get('disjoint_data')
    else None
  )
  if privacy.get('epsilon') is None:
    card['guarantee'] = 'none: a non-private run (ε = ∞).'
  else:
    card['guarantee'] = (
      f'({privacy["epsilon"]:.6g}, {privacy["delta"]:g})-DP ({privacy["bound"]} bound, '
      f'{privacy["accountant"]}) of these parameters with respect to the training set'
      + (
        f' of this run and of the {len(composed)} run(s) it started from (init_from), their '
        'privacy losses composed,'
        if composed
        else ''
      )
      + f' for {card["neighbouring_relation"]}; it assumes the randomness of the run was secret '
      + (
        '(its seed was drawn from OS entropy)'
        if drawn
        else '(its seed was given in the config: the claim holds only if that seed was kept secret)'
      )
      + '.'
    )
  return card


def _full_params(trainable: dict, meta: dict, workdir: str) -> dict:
  """The model's parameters: trainable ones, merged with frozen weights and LoRA adapters."""
  config = meta['config']
  if not (config.get('freeze') or config.get('lora', {}).get('rank')):
    return trainable
  from dpjax.models import factory as models
  from dpjax.privacy import prng
  from dpjax.privacy import lora as lora_lib
  from dpjax.trainer.planning import finetune
  from dpjax.trainer.workdir import run_seed

  io, seed = meta.get('model_io'), run_seed.stored_seed(workdir)
  if io is None or seed is None:
    raise ValueError(
      f'--workdir {workdir!r}: a fine-tuned run needs its model_io metadata and '
      'private/seed.json to merge the frozen weights; neither may be missing.'
    )
  model = models.make_model(
    ml_collections.ConfigDict(config['model']), io['num_classes'], tuple(io['input_shape'])
  )
  params = prng.init_params(model, seed.value, tuple(io['input_shape']))
  if config.get('init_from'):  # The weights the run started from (the step it accounted for).
    init = meta.get('init_from') or {}
    if not init.get('weights_sha256'):
      raise ValueError(
        f'--workdir {workdir!r}: its checkpoint records no digest of the weights '
        f'it started from (init_from = {config["init_from"]!r}; an older dpjax), '
        'so the frozen weights re-read from there cannot be checked against those '
        'it trained with. Retrain to export.'
      )
    params = finetune.load_pretrained(
      init.get('params_path') or config['init_from'],
      params,
      config.get('init_from_rules', ()),
      init['weights_sha256'],
    )
  lora = config.get('lora', {})
  wrapped, _ = lora_lib.make_finetune(
    model,
    params,
    freeze=tuple(config.get('freeze', ())),
    lora_rank=lora.get('rank', 0),
    lora_alpha=lora.get('alpha', 1.0),
    lora_targets=tuple(lora.get('targets', ())),
    seed=seed.value,
  )
  return wrapped.full_params(trainable)


def _flat_numpy(params) -> dict[str, np.ndarray]:
  import numpy as np
  from dpjax.privacy import lora

  return {k: np.asarray(v) for k, v in lora.flatten(params).items()}


def _checked_paths(workdir: str, out: str) -> tuple[str, str]:
  """(workdir, out) resolved; ValueError unless the workdir exists and `out` is a new or empty
  directory outside it (the workdir stays private)."""
  workdir, out = os.path.realpath(workdir), os.path.realpath(out)
  if not os.path.isdir(workdir):
    raise ValueError(f'--workdir {workdir!r}: not a directory.')
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ValueError(
      f'--out {out!r}: exists and is not an empty directory; an export goes into a new directory.'
    )
  if os.path.commonpath([workdir, out]) == workdir:
    raise ValueError(f'--out {out!r}: is inside the workdir, which must stay private.')
  return workdir, out


def export(
  workdir: str, out: str, *, step: int | None = None, allow_shared_seed: bool = False
) -> dict[str, Any]:
  """Writes the release of `workdir` (newest checkpoint, or `step`) into the new directory `out`.

  Returns the privacy card. Raises ValueError (one line) before writing anything if the
  workdir has no readable checkpoint, `out` exists and is not empty, or another run with the
  same seed was exported (`seed_record`; a record that cannot be read or written costs one
  warning line on stderr).
  """
  from dpjax.trainer.workdir import checkpoints, run_identity, stored_params

  workdir, out = _checked_paths(workdir, out)
  meta = _checkpoint(workdir, step)
  digest = meta.get('fingerprint', {}).get('seed_sha256')
  if digest is None:
    raise ValueError(
      f'--workdir {workdir!r}: its checkpoints were written by an older dpjax '
      '(no seed digest); retrain to export.'
    )
  warnings, conflict, run = [], None, run_identity.stored(workdir)  # None: older than run ids.
  try:
    conflict = (
      None if allow_shared_seed else seed_record.exported_by_another_run(digest, run and run.run_id)
    )
  except OSError as e:
    warnings.append(seed_record.unusable(e))
  if conflict is not None:
    raise ValueError(
      f'--workdir {workdir!r} used the same seed as {seed_record.run_named(conflict, workdir)}, '
      f'already exported to {conflict.get("out")!r}: two releases that share their noise '
      'reveal the noise-free difference of their gradients. Retrain one run with another seed '
      '(leave seed unset to draw one), or pass --allow_shared_seed if you know why.'
    )
  state = checkpoints.read_state(workdir, meta['step'])  # Verified against the manifest.
  card = privacy_card(meta)
  files = {stored_params.PARAMS_FILE: _flat_numpy(_full_params(state['params'], meta, workdir))}
  if meta['config'].get('ema_decay'):
    files[EMA_PARAMS] = _flat_numpy(_full_params(state['ema']['params'], meta, workdir))
  card['files'] = sorted(files) + [stored_params.CARD_FILE]
  parent = os.path.dirname(out)
  # Staged: removed if anything (an error, a full disk, Ctrl-C, SIGTERM) stops the export
  # before the rename, so nothing partial is left.
  with write_errors.writing(
    'the export', out, then='Nothing was exported; free space, then export again.'
  ):
    os.makedirs(parent, exist_ok=True)
    with interrupts.partial_output(
      tempfile.mkdtemp(prefix='.dpjax-export-', dir=parent)
    ) as staging:
      for name, arrays in files.items():
        stored_params.save(os.path.join(staging, name), arrays, card)
      with open(os.path.join(staging, stored_params.CARD_FILE), 'w') as f:
        json.dump(card, f, indent=2)
        f.write('\n')
      try:  # A workdir older than run ids gets one; recorded without it if that fails.
        run = run or run_identity.kept(workdir)
      except write_errors.WriteError as e:
        warnings.append(
          f'the run id cannot be kept in {run_identity.run_path(workdir)} '
          f'({write_errors.reason(e.__cause__)}): this export is recorded without '
          'it, so exporting this run again will need --allow_shared_seed.'
        )
      try:  # Before the rename: no release is ever missing from the record.
        seed_record.append(digest, seed_record.EXPORT, workdir, run and run.run_id, out)
      except OSError as e:
        warnings.append(seed_record.unusable(e))
      if os.path.isdir(out):
        os.rmdir(out)  # Empty (checked above).
      os.rename(staging, out)
  for line in warnings[:1]:
    print(f'{PROG}: warning: {line}', file=sys.stderr, flush=True)
  return card


def main(argv: list[str] | None = None) -> int:
  logging.getLogger('absl').setLevel(logging.ERROR)  # Orbax's INFO/WARNING lines on reads.
  fv = flags.FlagValues()
  flags.DEFINE_string('workdir', None, 'the run to publish (stays private)', flag_values=fv)
  flags.DEFINE_string('out', None, 'a new directory for the release', flag_values=fv)
  flags.DEFINE_integer(
    'step', None, 'the checkpoint to export (default: the newest)', flag_values=fv
  )
  flags.DEFINE_boolean(
    'allow_shared_seed',
    False,
    'export even if another run with the same seed was already exported',
    flag_values=fv,
  )
  cli.parse_command(PROG, __doc__, fv, sys.argv[1:] if argv is None else argv)
  if not fv.workdir or not fv.out:
    cli.fail(PROG, '--workdir and --out are required. See --help.')
  try:
    card = export(fv.workdir, fv.out, step=fv.step, allow_shared_seed=fv.allow_shared_seed)
  except ValueError as e:
    cli.fail(PROG, e)
  except write_errors.WriteError as e:
    cli.fail(PROG, e, code=1)
  eps = (
    'non-private (ε = ∞)'
    if card['epsilon'] is None
    else f'ε = {card["epsilon"]:.4f} ({card["bound"]} bound, {card["accountant"]}), '
    f'δ = {card["delta"]:g}'
  )
  print(
    f'Exported step {card["steps"]} to {os.path.realpath(fv.out)}: {", ".join(card["files"])}; '
    f'{eps}.'
  )
  return 0


if __name__ == '__main__':
  sys.exit(main())
