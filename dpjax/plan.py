"""The resolved plan of a run: every fact that enters ε, computed once, and its fingerprint.

  plan = make_plan(config, train_source, seed=seed)            # a fresh run
  plan = make_plan(config, train_source, previous, seed=seed)  # a resume: `previous` is the
                                                               # checkpoint's fingerprint

Resolution, in this order and nowhere else: validate the config
(`dpjax.config_fields`) → the sampler (`make_sampler`, seeded by the run's
secret seed, `dpjax.run_seed`) → the run length in steps → δ (refused at or above
1/N) → the cap B (`batching.resolve_max_batch_size`; on resume, the checkpoint's B)
→ σ (given; on resume, the checkpoint's σ, never re-calibrated; else calibrated to
`privacy.target_epsilon`) → the `privacy_plan.PrivacyPlan` that binds sampler, B,
σ, C, δ and the accountant → the budget check (final ε ≤ target). `dpjax.train`
builds the batcher and the DP step from that plan and reports ε from its
accountant, so what is reported is what ran. `make_accountant(config, N)` is
`make_plan(config, N).accountant`.

The **privacy fingerprint** (`RunPlan.fingerprint`) lists everything that
enters ε: the private flag, the sampler and its accounting parameters (N, b,
the resolved B, the group size), σ as used, C, δ, the resolved accountant, the
SHA-256 of the seed (it fixes which examples each step uses, which epoch-based
accounting relies on; the seed itself is never stored in a checkpoint), the audit
canaries, and the dataset's identity (source, name, split, N, and a digest of its
content: features and labels in example order, `dpjax.data_identity`). Every
checkpoint stores it; `make_plan(..., previous)` refuses any difference, listing
each field `old → new`. Allowed on resume: fields that do not touch privacy
(learning rate, logging, evaluation, checkpointing, P when B is still a multiple
of it) and a longer run, whose ε is recomputed for the new total and checked
against `privacy.target_epsilon` as a budget.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from typing import Any
import warnings

import ml_collections
import numpy as np

from dpjax import config_fields
from dpjax import batching
from dpjax import data as data_lib
from dpjax import data_identity
from dpjax import privacy_plan
from dpjax import samplers as samplers_lib
from dpjax.accounting import accountant as accountant_lib
from dpjax.auditing import audited_sgd
from dpjax.auditing import canaries as canaries_lib

FINGERPRINT_VERSION = 2  # 2: the seed as its SHA-256, the data by its content.
# The dataset's part of the fingerprint: its content, not where it lives (a copy resumes).
DATASET_FIELDS = ('source', 'split', 'num_examples', 'content_sha256')
NEW_WORKDIR_HINT = 'Use a new --workdir for a run with these settings, or restore the old ones.'


class PlanError(config_fields.ConfigError):
  """The config cannot run as planned (or cannot resume this workdir); one line, names fields."""


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """Everything resolved about a run before any compute.

  Attributes:
    config: a copy of the config with `num_steps`, `privacy.noise_multiplier` and
      `sampler.max_batch_size` filled in (`num_epochs` = 0): the `config.json` of the run.
      Its `seed` is the config's (None when the seed was drawn: the resolved seed is
      `seed`, kept in the workdir's private/ directory, never in config.json).
    sampler: the sampler that selects every logical batch, seeded by the resolved seed.
    num_steps: the run length in steps.
    physical_batch_size: P (0 = chosen by the trainer from the device's memory).
    max_batch_size: B, the cap on the logical batch (the accountant pays for truncation to it).
    private: False for the non-private baseline (no σ, C, δ, accountant, ε).
    privacy: the `PrivacyPlan` (sampler, B, σ, C, δ, k, accountant) of a private run, else None.
    dataset: the dataset identity (source, name, split, num_examples, content digest), or
      None when only N is known.
    seed_source: 'drawn' (OS entropy), 'workdir' (the seed a resumed run drew) or 'config'
      (given by the user: the guarantee then needs it to be secret).
    warnings: lines to print at start (e.g. δ above 1/(10·N)).
  """

  config: ml_collections.ConfigDict
  sampler: samplers_lib.Sampler
  num_steps: int
  physical_batch_size: int
  max_batch_size: int
  private: bool
  privacy: privacy_plan.PrivacyPlan | None
  dataset: dict[str, Any] | None
  seed_source: str = 'config'
  warnings: tuple[str, ...] = ()

  @property
  def seed(self) -> int:
    return self.sampler.seed

  @property
  def seed_is_secret(self) -> bool:
    """False when the seed came from the config (known to the adversary unless kept secret)."""
    return self.seed_source != 'config'

  # The privacy plan's values (None for a non-private run).
  noise_multiplier = property(lambda self: _of(self.privacy, 'noise_multiplier'))
  noise_multiplier_source = property(lambda self: _of(self.privacy, 'noise_multiplier_source'))
  clip_norm = property(lambda self: _of(self.privacy, 'clip_norm'))
  delta = property(lambda self: _of(self.privacy, 'delta'))
  accountant = property(lambda self: _of(self.privacy, 'accountant'))
  accountant_name = property(lambda self: _of(self.privacy, 'accountant_name'))
  group_size = property(lambda self: _of(self.privacy, 'group_size') or 1)
  target_epsilon = property(lambda self: _of(self.privacy, 'target_epsilon') or 0.0)

  @property
  def fingerprint(self) -> dict[str, Any]:
    """The flat dict of everything that enters ε (JSON-ready; compared on resume)."""
    return run_fingerprint(self.config, self.sampler, self.max_batch_size, self.privacy,
                           self.dataset)

  def summary(self) -> str:
    """One line: sampler, b, B, P, σ (and whether calibrated), C, target ε, steps."""
    s = self.sampler
    text = (f'{s.name} sampler, N = {s.num_examples}, b = {s.batch_size}, B = {self.max_batch_size}, '
            f'P = {self.physical_batch_size}, {self.num_steps} steps')
    if not self.private:
      return text + ', non-private (no clipping, no noise, ε = ∞)'
    source = {'given': 'given', 'calibrated': 'calibrated',
              'checkpoint': "the checkpoint's"}[self.noise_multiplier_source]
    target = f'target ε = {self.target_epsilon:g}' if self.target_epsilon else 'no target ε'
    return (text + f', σ = {self.noise_multiplier:.4f} ({source}), C = {self.clip_norm:g}, '
            f'δ = {self.delta:g}, {target}')


def _of(privacy, name):
  return None if privacy is None else getattr(privacy, name)


def run_fingerprint(config, sampler, max_batch_size: int, privacy, dataset) -> dict[str, Any]:
  """The privacy fingerprint: the privacy plan's fields, the private flag, audit and data."""
  dataset = dataset or {}
  audit = config.get('audit', {})
  canaries = audit.get('num_canaries', 0)
  if privacy is not None:
    fields = privacy.fingerprint
  else:
    fields = {'sampler.name': sampler.name, 'sampler.num_examples': sampler.num_examples,
              'sampler.batch_size': sampler.batch_size, 'sampler.max_batch_size': max_batch_size,
              'privacy.group_size': None, 'privacy.noise_multiplier': None,
              'privacy.clip_norm': None, 'privacy.delta': None, 'privacy.accountant': None,
              'seed_sha256': privacy_plan.seed_digest(sampler.seed)}
  return {
      'fingerprint_version': FINGERPRINT_VERSION,
      'privacy.enabled': privacy is not None,
      **fields,
      # Audit canaries change the data (N + m rows) and what each canary contributes.
      'audit.num_canaries': canaries,
      'audit.kind': audit.get('kind') if canaries else None,
      **{f'data.{key}': dataset.get(key) for key in DATASET_FIELDS},
  }


def dataset_identity(data_config: ml_collections.ConfigDict, source,
                     key: bytes = b'') -> dict[str, Any]:
  """Source, name, location, split, N and a digest of a train split's content (features, labels).

  The digest is `data_identity.content_identity(source, key=key)`: a SHA-256 over every
  example for in-memory data (and for files up to its full-read limit), else file sizes,
  modification times and a keyed sample of rows (`key` is derived from the run's secret seed).
  `location` (the TFDS name and data_dir, the file's real path) is kept in the checkpoint's
  metadata, not in the fingerprint: the same content elsewhere resumes.
  """
  identity = data_identity.content_identity(source, key=key)
  kind = data_config.source
  path = str(data_config.get('path', '') or '')
  name = {'tfds': data_config.name, 'digits': 'sklearn digits'}.get(
      kind, path.rstrip('/').rsplit('/', 1)[-1] or kind)
  location = {'tfds': f'{data_config.name}@{os.path.realpath(data_config.data_dir or ".")}',
              'npz': os.path.realpath(path) if path else '', 'memmap': os.path.realpath(path)
              if path else ''}.get(kind, kind)
  split = data_config.train_split if kind in ('tfds', 'memmap') else 'train'
  return {'source': kind, 'name': name, 'location': location, 'split': split,
          'num_examples': len(source), 'content_sha256': identity['sha256'],
          'content_method': identity['method']}


def data_key(seed: int) -> bytes:
  """The key of the dataset identity's row sample: a function of the secret seed."""
  return hashlib.sha256(f'dpjax-data-key:{int(seed)}'.encode()).digest()


def fingerprint_changes(previous: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """'field: old → new' for every fingerprint field that differs (the seed by name only)."""
  changes = []
  for key in sorted(set(previous) | set(current)):
    old, new = previous.get(key, '<absent>'), current.get(key, '<absent>')
    if old != new and not (_is_float(old) and _is_float(new) and math.isclose(old, new,
                                                                             rel_tol=1e-12)):
      if key == 'seed_sha256':
        changes.append('seed: another seed than the run being resumed (a given seed differs, '
                       "or the workdir's private/seed.json is missing or was changed)")
      else:
        changes.append(f'{key}: {old!r} → {new!r}')
  return changes


def _is_float(x) -> bool:
  return isinstance(x, float)


def make_training_sources(config: ml_collections.ConfigDict):
  """(train, test) sources of a config: the data block's, plus the audit canaries' m rows.

  The one place that decides N for training, `dpjax.account` and `dpjax.planner` alike
  (canaries are sampled like any example: the run has N + m examples).
  """
  train, test = data_lib.make_sources(config.data, loss=config.get('loss', 'softmax_cross_entropy'))
  num_canaries = config.get('audit', {}).get('num_canaries', 0)
  if num_canaries:
    train = canaries_lib.CanarySource(train, num_canaries)
  return train, test


def make_sampler(config: ml_collections.ConfigDict, num_examples: int,
                 seed: int | None = None) -> samplers_lib.Sampler:
  """The sampler named by `config.sampler.name` over N = num_examples.

  seed: the run's resolved (secret) seed; None reads `config.seed` (None there gives 0,
  enough for accounting, which does not depend on the seed).
  """
  if seed is None:
    seed = config.get('seed') or 0
  return samplers_lib.make(config.sampler.name, num_examples, config.sampler.batch_size, seed)


def make_accountant(config: ml_collections.ConfigDict, num_examples: int,
                    **kwargs) -> accountant_lib.Accountant:
  """The accountant of the run that `config` trains on `num_examples` examples:
  `make_plan(config, N).accountant`, so training and every CLI account for the same run.

  kwargs: extra `accounting.Accountant` options (monte_carlo_samples, beta, ...); they
  override the config's (monte_carlo_workers).
  """
  if not config.privacy.enabled:
    raise ValueError('privacy.enabled is False: a non-private run has no ε to account.')
  return make_plan(config, num_examples, accountant_options=kwargs).accountant


def audit_settings(config: ml_collections.ConfigDict):
  """`auditing.audited_sgd.AuditSettings` of a training config (seed None: drawn)."""
  return audited_sgd.AuditSettings(
      sampler=config.sampler.name, batch_size=config.sampler.batch_size,
      physical_batch_size=config.sampler.physical_batch_size,
      max_batch_size=config.sampler.max_batch_size, num_steps=config.num_steps,
      clip_norm=float(config.privacy.clip_norm),
      noise_multiplier=float(config.privacy.noise_multiplier or 0.0),
      delta=config.privacy.delta, learning_rate=config.optimizer.learning_rate,
      seed=config.get('seed'))


def num_train_steps(config: ml_collections.ConfigDict, sampler: samplers_lib.Sampler) -> int:
  """`num_steps`, or `num_epochs` epochs of ceil(N/b) steps (exactly one is > 0)."""
  return config.num_steps or config.num_epochs * sampler.steps_per_epoch


def make_plan(config: ml_collections.ConfigDict, data: Any,
              previous: dict[str, Any] | None = None, *, seed: int | None = None,
              seed_source: str = 'config', resumed_step: int = 0,
              accountant_options: dict | None = None) -> RunPlan:
  """Resolves `config` once into a RunPlan (see the module docstring).

  Args:
    config: the training config (every field declared as in configs/digits_mlp.py).
    data: the training `DataSource` (its identity enters the fingerprint), or just N.
    previous: the privacy fingerprint of the checkpoint being resumed, or None.
    seed: the run's resolved seed (`dpjax.run_seed`); None = `config.seed`, or 0 when that is
      None too (enough to account: ε does not depend on the seed).
    seed_source: where `seed` came from ('drawn', 'workdir' or 'config').
    resumed_step: the step of that checkpoint (the run may not end before it).
    accountant_options: extra `accounting.Accountant` options (Monte-Carlo samples, β, ...).

  Raises:
    ConfigError / PlanError (ValueErrors, one line each) for a bad field, a fingerprint
    mismatch on resume, or a run that would exceed privacy.target_epsilon.
  """
  config_fields.validate(config, accounting_only=isinstance(data, (int, np.integer)))
  if seed is None:
    seed = config.get('seed') or 0
  if isinstance(data, (int, np.integer)):
    num_examples, dataset = int(data), None
  else:
    num_examples, dataset = len(data), dataset_identity(config.data, data, data_key(seed))
  if dataset is not None and config.get('init_from'):
    _check_init_from(config.init_from, dataset)
  sampler = make_sampler(config, num_examples, seed=seed)
  num_steps = num_train_steps(config, sampler)
  if previous is not None and previous.get('fingerprint_version') != FINGERPRINT_VERSION:
    raise PlanError(f'the checkpoint in this workdir has no privacy fingerprint of version '
                    f'{FINGERPRINT_VERSION} (written by an older dpjax), so a resume cannot be '
                    'checked. ' + NEW_WORKDIR_HINT)
  if resumed_step > num_steps:
    raise PlanError(f'num_steps: the checkpoint is at step {resumed_step}, beyond this config\'s '
                    f'{num_steps} steps. Set num_steps/num_epochs to at least that, or use a new '
                    '--workdir.')
  privacy = config.privacy
  private = bool(privacy.enabled)
  physical = config.sampler.physical_batch_size
  notes = []
  if private:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always', privacy_plan.LargeDeltaWarning)
      privacy_plan.check_delta(privacy.delta, num_examples, name='privacy.delta',
                               allow_large_delta=bool(privacy.get('allow_large_delta', False)),
                               flag='privacy.allow_large_delta = True')
    notes += [str(w.message) for w in caught]
  delta = float(privacy.delta) if private else 1e-5
  # --- the cap B: resolved from (N, b, steps, δ) on a fresh run, the checkpoint's on resume.
  if previous is not None and not config.sampler.max_batch_size:
    max_batch_size = previous['sampler.max_batch_size']
    if physical and max_batch_size % physical:
      raise PlanError(f'sampler.physical_batch_size = {physical}: the run being resumed has the '
                      f'cap B = {max_batch_size}, which is not a multiple of it; choose a P that '
                      f'divides {max_batch_size}.')
  else:
    max_batch_size = batching.resolve_max_batch_size(
        sampler, physical, config.sampler.max_batch_size, num_steps=num_steps, delta=delta)
  resolved = ml_collections.ConfigDict(config.to_dict())
  resolved.num_steps, resolved.num_epochs = num_steps, 0
  resolved.sampler.max_batch_size = max_batch_size
  plan = RunPlan(config=resolved, sampler=sampler, num_steps=num_steps,
                 physical_batch_size=physical, max_batch_size=max_batch_size, private=private,
                 privacy=None, dataset=dataset, seed_source=seed_source, warnings=tuple(notes))
  if not private:
    if previous is not None:
      _refuse_changes(previous, plan.fingerprint)
    return plan
  # --- σ: given, the checkpoint's (never re-calibrated), or calibrated once.
  sigma, source = privacy.noise_multiplier, 'given'
  if sigma is None and previous is not None and previous.get('privacy.noise_multiplier'):
    sigma, source = float(previous['privacy.noise_multiplier']), 'checkpoint'
  options = dict(monte_carlo_workers=privacy.get('monte_carlo_workers'))
  if privacy.get('random_allocation_timeout'):  # Seconds; the Accountant's default otherwise.
    options['random_allocation_timeout'] = privacy.random_allocation_timeout
  options.update(accountant_options or {})
  kwargs = dict(num_steps=num_steps, clip_norm=privacy.clip_norm, delta=privacy.delta,
                target_epsilon=privacy.target_epsilon, max_batch_size=max_batch_size,
                physical_batch_size=physical, accountant=privacy.accountant,
                group_size=privacy.group_size, allow_large_delta=True, **options)
  if previous is not None:  # Refuse before any (costly) accounting.
    _refuse_changes(previous, run_fingerprint(
        config, sampler, max_batch_size, _Fields(sampler, max_batch_size, privacy, sigma),
        dataset))
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', privacy_plan.LargeDeltaWarning)  # Noted above.
    private_plan = privacy_plan.PrivacyPlan.create(
        sampler, noise_multiplier=sigma, noise_multiplier_source=source, check_budget=False,
        **kwargs)
  # The final ε now (memoised): a run whose privacy loss cannot be composed is refused here,
  # before anything is written.
  private_plan.accountant.epsilon(num_steps)
  try:
    private_plan.check_budget()
  except privacy_plan.BudgetExceededError as e:
    what = (f'extending the run to {num_steps} steps' if previous is not None else
            f'privacy.noise_multiplier = {private_plan.noise_multiplier:g} over {num_steps} steps')
    raise PlanError(f'{what} would reach ε = {e.final_epsilon:.4g} (δ = {private_plan.delta:g}), '
                    f'above privacy.target_epsilon = {private_plan.target_epsilon:g}. Raise '
                    'privacy.target_epsilon (the budget), raise σ, or shorten the run.' + (
                        '' if previous is not None else
                        ' Or unset privacy.noise_multiplier (None) to calibrate it.')) from None
  resolved.privacy.noise_multiplier = private_plan.noise_multiplier
  return dataclasses.replace(plan, privacy=private_plan)


class _Fields:
  """The fingerprint fields of a privacy plan before σ is calibrated (for the resume check)."""

  def __init__(self, sampler, max_batch_size, privacy, sigma):
    self.fingerprint = {
        'sampler.name': sampler.name, 'sampler.num_examples': sampler.num_examples,
        'sampler.batch_size': sampler.batch_size, 'sampler.max_batch_size': max_batch_size,
        'privacy.group_size': privacy.group_size,
        'privacy.noise_multiplier': None if sigma is None else float(sigma),
        'privacy.clip_norm': float(privacy.clip_norm), 'privacy.delta': float(privacy.delta),
        'privacy.accountant': accountant_lib.resolve_accountant(
            sampler.name, privacy.accountant, privacy.group_size),
        'seed_sha256': privacy_plan.seed_digest(sampler.seed)}


def _check_init_from(init_from: str, dataset: dict[str, Any]) -> None:
  """Refuses starting from a dpjax run that trained on this same dataset (its ε would add up)."""
  from dpjax import finetune  # pylint: disable=import-outside-toplevel
  previous = finetune.source_metadata(init_from)
  if not previous:
    return
  fingerprint, earlier = previous.get('fingerprint', {}), previous.get('dataset') or {}
  same_content = fingerprint.get('data.content_sha256') == dataset['content_sha256']
  same_place = (earlier.get('location') == dataset['location'] and
                earlier.get('split') == dataset['split'])
  if same_content or same_place:
    what = 'the same content' if same_content else (
        f"the same dataset ({dataset['source']} {dataset['name']!r}, split {dataset['split']!r})")
    raise PlanError(
        f'init_from = {init_from!r}: a dpjax run trained on {what}, so the released model would '
        "depend on this data through both runs, and dpjax does not compose two runs' ε. Extend "
        'that run instead (raise num_steps or num_epochs and rerun it in its workdir: one ε '
        'covers it all), or start from weights that never saw this data.')


def _refuse_changes(previous: dict[str, Any], current: dict[str, Any]) -> None:
  changes = fingerprint_changes(previous, current)
  if changes:
    raise PlanError('this workdir holds a run with other privacy settings; resuming it would '
                    'make its ε wrong. Changed: ' + '; '.join(changes) + '. ' + NEW_WORKDIR_HINT)


def privacy_metadata(step: int, report, plan: RunPlan, step_fns,
                     batcher, num_truncated: int) -> dict:
  """The claim stored with a checkpoint: what ε holds for exactly this state.

  σ and C are read from the DP step that ran, the sampler and B from the batcher
  that fed it; the fingerprint is compared on resume.
  """
  sampler = batcher.sampler
  return {
      'step': step,
      'privacy': report.to_dict() if report is not None else {
          'epsilon': None, 'bound': 'none (non-private run)', 'accountant': None,
          'delta': None},
      'fingerprint': plan.fingerprint,
      'noise_multiplier': step_fns.noise_multiplier if plan.private else None,
      'noise_multiplier_source': plan.noise_multiplier_source,
      'clip_norm': step_fns.clip_norm if plan.private else None,
      'num_examples': sampler.num_examples,
      'sampler': {'name': sampler.name, 'batch_size': sampler.batch_size,
                  'expected_batch_size': sampler.expected_batch_size,
                  'sampling_probability': sampler.sampling_probability,
                  'steps_per_epoch': sampler.steps_per_epoch,
                  'max_batch_size': batcher.max_batch_size,
                  'physical_batch_size': batcher.physical_batch_size},
      'group_size': plan.group_size if plan.private else None,
      'num_truncated': num_truncated,  # Not covered by ε (a count of the private batch sizes).
      'seed_source': plan.seed_source,  # The seed itself is in private/seed.json only.
      'dataset': plan.dataset,
      'config': plan.config.to_dict(),
  }
