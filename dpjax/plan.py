"""The resolved plan of a run: every fact that enters ε, computed once, and its fingerprint.

  plan = make_plan(config, train_source)            # a fresh run
  plan = make_plan(config, train_source, previous)  # a resume: `previous` is the checkpoint's
                                                    # privacy fingerprint

Resolution, in this order and nowhere else: validate the config
(`dpjax._validate`) → the sampler (`samplers.make_sampler`) → the run length in
steps → the cap B (`batching.resolve_max_batch_size`; on resume, the checkpoint's
B) → σ (given; on resume, the checkpoint's σ, never re-calibrated; else
calibrated to `privacy.target_epsilon`) → the accountant (`accounting.Accountant`
on that very sampler, σ, δ and B) → the budget check (final ε ≤ target).
`dpjax.train` builds the DP step from `plan.noise_multiplier` and
`plan.clip_norm` and reports ε from `plan.accountant`, so what is reported is
what ran. `accounting.make_accountant(config, N)` is `make_plan(config, N).accountant`.

The **privacy fingerprint** (`RunPlan.fingerprint`) lists everything that
enters ε: the private flag, the sampler and its accounting parameters (N, b,
the resolved B, the group size), σ as used, C, δ, the resolved accountant, the
seed (it fixes which examples each step uses, which epoch-based accounting
relies on) and the dataset's identity (source, name, split, N, and a hash of
the labels in example order). Every checkpoint stores it; `make_plan(...,
previous)` refuses any difference, listing each field `old → new`. Allowed on
resume: fields that do not touch privacy (learning rate, logging, evaluation,
checkpointing, P when B is still a multiple of it) and a longer run, whose ε
is recomputed for the new total and checked against `privacy.target_epsilon`
as a budget.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import ml_collections
import numpy as np

from dpjax import _validate
from dpjax import batching
from dpjax import samplers as samplers_lib
from dpjax.accounting import accountant as accountant_lib

FINGERPRINT_VERSION = 1
# Labels hashed for the dataset identity: all of them up to this many, else this many evenly
# spaced ones (a cheap check that the data and its order are the ones the run started with).
IDENTITY_LABELS = 4096
NEW_WORKDIR_HINT = 'Use a new --workdir for a run with these settings, or restore the old ones.'


class PlanError(_validate.ConfigError):
  """The config cannot run as planned (or cannot resume this workdir); one line, names fields."""


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """Everything resolved about a run before any compute.

  Attributes:
    config: a copy of the config with `num_steps`, `privacy.noise_multiplier` and
      `sampler.max_batch_size` filled in (`num_epochs` = 0): the `config.json` of the run.
    sampler: the sampler that selects every logical batch.
    num_steps: the run length in steps.
    physical_batch_size: P.
    max_batch_size: B, the cap on the logical batch (the accountant pays for truncation to it).
    private: False for the non-private baseline (no σ, C, δ, accountant, ε).
    noise_multiplier: σ as the step uses it (None if not private).
    noise_multiplier_source: 'config', 'calibrated' or 'checkpoint' (σ of the run being resumed).
    clip_norm: C (None if not private).
    delta: δ (None if not private).
    accountant_name: the resolved accountant ('pld', 'rdp', 'monte_carlo'), None if not private.
    group_size: k.
    target_epsilon: the ε budget (0 = none).
    dataset: the dataset identity (source, name, split, num_examples, labels_sha256), or None
      when only N is known.
    accountant: the `accounting.Accountant` of this very sampler, σ, δ, B (None if not private).
  """

  config: ml_collections.ConfigDict
  sampler: samplers_lib.Sampler
  num_steps: int
  physical_batch_size: int
  max_batch_size: int
  private: bool
  noise_multiplier: float | None
  noise_multiplier_source: str | None
  clip_norm: float | None
  delta: float | None
  accountant_name: str | None
  group_size: int
  target_epsilon: float
  dataset: dict[str, Any] | None
  accountant: accountant_lib.Accountant | None = dataclasses.field(
      default=None, compare=False, repr=False)

  @property
  def seed(self) -> int:
    return self.sampler.seed

  @property
  def fingerprint(self) -> dict[str, Any]:
    """The flat dict of everything that enters ε (JSON-ready; compared on resume)."""
    private = self.private
    dataset = self.dataset or {}
    return {
        'fingerprint_version': FINGERPRINT_VERSION,
        'privacy.enabled': private,
        'sampler.name': self.sampler.name,
        'sampler.num_examples': self.sampler.num_examples,
        'sampler.batch_size': self.sampler.batch_size,
        'sampler.max_batch_size': self.max_batch_size,
        'privacy.group_size': self.group_size if private else None,
        'privacy.noise_multiplier': self.noise_multiplier if private else None,
        'privacy.clip_norm': self.clip_norm if private else None,
        'privacy.delta': self.delta if private else None,
        'privacy.accountant': self.accountant_name if private else None,
        'seed': self.seed,
        # Audit canaries change the data (N + m rows) and what each canary contributes.
        'audit.num_canaries': self.config.get('audit', {}).get('num_canaries', 0),
        'audit.kind': self.config.get('audit', {}).get('kind') if self.config.get(
            'audit', {}).get('num_canaries', 0) else None,
        **{f'data.{key}': dataset.get(key) for key in
           ('source', 'name', 'split', 'num_examples', 'labels_sha256')},
    }

  def summary(self) -> str:
    """One line: sampler, b, B, P, σ (and whether calibrated), C, target ε, steps."""
    s = self.sampler
    text = (f'{s.name} sampler, N = {s.num_examples}, b = {s.batch_size}, B = {self.max_batch_size}, '
            f'P = {self.physical_batch_size}, {self.num_steps} steps')
    if not self.private:
      return text + ', non-private (no clipping, no noise, ε = ∞)'
    source = {'config': 'given', 'calibrated': 'calibrated',
              'checkpoint': "the checkpoint's"}[self.noise_multiplier_source]
    target = f'target ε = {self.target_epsilon:g}' if self.target_epsilon else 'no target ε'
    return (text + f', σ = {self.noise_multiplier:.4f} ({source}), C = {self.clip_norm:g}, '
            f'δ = {self.delta:g}, {target}')


def dataset_identity(data_config: ml_collections.ConfigDict, source) -> dict[str, Any]:
  """Source, name, split, N and the SHA-256 of the labels (in example order) of a train split.

  Hashes all labels up to IDENTITY_LABELS, else that many evenly spaced ones: O(1)
  reads at any N, and any change of the data or of its order shows up with high probability.
  """
  n = len(source)
  indices = np.unique(np.linspace(0, n - 1, min(n, IDENTITY_LABELS)).round().astype(np.int64))
  labels = np.asarray(source.gather(indices)['y'])
  if labels.ndim > 1:  # One-hot.
    labels = labels.argmax(axis=-1)
  digest = hashlib.sha256()
  digest.update(np.asarray([n, *source.input_shape], np.int64).tobytes())
  digest.update(labels.astype(np.int64).tobytes())
  kind = data_config.source
  name = {'tfds': data_config.name, 'digits': 'sklearn digits'}.get(
      kind, str(data_config.get('path', '')).rstrip('/').rsplit('/', 1)[-1] or kind)
  split = data_config.train_split if kind in ('tfds', 'memmap') else 'train'
  return {'source': kind, 'name': name, 'split': split, 'num_examples': n,
          'labels_sha256': digest.hexdigest()}


def fingerprint_changes(previous: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """'field: old → new' for every fingerprint field that differs."""
  changes = []
  for key in sorted(set(previous) | set(current)):
    old, new = previous.get(key, '<absent>'), current.get(key, '<absent>')
    if old != new and not (_is_float(old) and _is_float(new) and math.isclose(old, new,
                                                                             rel_tol=1e-12)):
      changes.append(f'{key}: {old!r} → {new!r}')
  return changes


def _is_float(x) -> bool:
  return isinstance(x, float)


def num_train_steps(config: ml_collections.ConfigDict, sampler: samplers_lib.Sampler) -> int:
  """`num_steps`, or `num_epochs` epochs of ceil(N/b) steps (exactly one is > 0)."""
  return config.num_steps or config.num_epochs * sampler.steps_per_epoch


def make_plan(config: ml_collections.ConfigDict, data: Any,
              previous: dict[str, Any] | None = None, *,
              resumed_step: int = 0, accountant_options: dict | None = None) -> RunPlan:
  """Resolves `config` once into a RunPlan (see the module docstring).

  Args:
    config: the training config (every field declared as in configs/digits_mlp.py).
    data: the training `DataSource` (its identity enters the fingerprint), or just N.
    previous: the privacy fingerprint of the checkpoint being resumed, or None.
    resumed_step: the step of that checkpoint (the run may not end before it).
    accountant_options: extra `accounting.Accountant` options (Monte-Carlo samples, β, ...).

  Raises:
    ConfigError / PlanError (ValueErrors, one line each) for a bad field, a fingerprint
    mismatch on resume, or a run that would exceed privacy.target_epsilon.
  """
  _validate.validate(config, accounting_only=isinstance(data, (int, np.integer)))
  if isinstance(data, (int, np.integer)):
    num_examples, dataset = int(data), None
  else:
    num_examples, dataset = len(data), dataset_identity(config.data, data)
  sampler = samplers_lib.make_sampler(config, num_examples)
  num_steps = num_train_steps(config, sampler)
  if previous is not None and previous.get('fingerprint_version') != FINGERPRINT_VERSION:
    raise PlanError('the checkpoint in this workdir has no privacy fingerprint (written by an '
                    'older dpjax), so a resume cannot be checked. ' + NEW_WORKDIR_HINT)
  if resumed_step > num_steps:
    raise PlanError(f'num_steps: the checkpoint is at step {resumed_step}, beyond this config\'s '
                    f'{num_steps} steps. Set num_steps/num_epochs to at least that, or use a new '
                    '--workdir.')
  privacy = config.privacy
  private = bool(privacy.enabled)
  delta = float(privacy.delta) if private else None
  physical = config.sampler.physical_batch_size
  # --- the cap B: resolved from (N, b, steps, δ) on a fresh run, the checkpoint's on resume.
  if previous is not None and not config.sampler.max_batch_size:
    max_batch_size = previous['sampler.max_batch_size']
    if physical and max_batch_size % physical:
      raise PlanError(f'sampler.physical_batch_size = {physical}: the run being resumed has the '
                      f'cap B = {max_batch_size}, which is not a multiple of it; choose a P that '
                      f'divides {max_batch_size}.')
  else:
    max_batch_size = batching.resolve_max_batch_size(
        sampler, physical, config.sampler.max_batch_size, num_steps=num_steps,
        delta=delta if private else 1e-5)
  # --- σ: given, the checkpoint's (never re-calibrated), or calibrated once.
  sigma = source = acct = accountant_name = None
  group_size = privacy.group_size if private else 1
  target = float(privacy.target_epsilon) if private else 0.0
  if private:
    options = dict(accountant=privacy.accountant, max_batch_size=max_batch_size,
                   group_size=group_size, monte_carlo_workers=privacy.get('monte_carlo_workers'))
    if privacy.get('random_allocation_timeout'):  # Seconds; the Accountant's default otherwise.
      options['random_allocation_timeout'] = privacy.random_allocation_timeout
    options.update(accountant_options or {})
    accountant_name = accountant_lib.resolve_accountant(sampler.name, privacy.accountant,
                                                        group_size)
    if privacy.noise_multiplier is not None:
      sigma, source = float(privacy.noise_multiplier), 'config'
    elif previous is not None and previous.get('privacy.noise_multiplier') is not None:
      sigma, source = float(previous['privacy.noise_multiplier']), 'checkpoint'
  plan = RunPlan(
      config=config, sampler=sampler, num_steps=num_steps, physical_batch_size=physical,
      max_batch_size=max_batch_size, private=private, noise_multiplier=sigma,
      noise_multiplier_source=source, clip_norm=float(privacy.clip_norm) if private else None,
      delta=delta, accountant_name=accountant_name, group_size=group_size, target_epsilon=target,
      dataset=dataset)
  if previous is not None:  # Refuse before any (costly) accounting.
    changes = fingerprint_changes(previous, plan.fingerprint)
    if changes:
      raise PlanError('this workdir holds a run with other privacy settings; resuming it would '
                      'make its ε wrong. Changed: ' + '; '.join(changes) + '. ' + NEW_WORKDIR_HINT)
  if private:
    if sigma is None:
      from dpjax.accounting import calibration  # pylint: disable=g-import-not-at-top
      sigma, source = calibration.calibrate_noise_multiplier(
          sampler, target, delta, num_steps, **options), 'calibrated'
    options.pop('accountant')
    acct = accountant_lib.Accountant(sampler, sigma, delta, accountant=privacy.accountant,
                                     num_steps=num_steps, **options)
    if target:
      final = acct.final_report(estimates=False).epsilon
      if final > target:
        what = (f'extending the run to {num_steps} steps' if previous is not None else
                f'privacy.noise_multiplier = {sigma:g} over {num_steps} steps')
        raise PlanError(f'{what} would reach ε = {final:.4g} (δ = {delta:g}), above '
                        f'privacy.target_epsilon = {target:g}. Raise privacy.target_epsilon (the budget), '
                        'raise σ, or shorten the run.' + (
                            '' if previous is not None else
                            ' Or unset privacy.noise_multiplier (None) to calibrate it.'))
  resolved = ml_collections.ConfigDict(config.to_dict())
  resolved.num_steps, resolved.num_epochs = num_steps, 0
  resolved.sampler.max_batch_size = max_batch_size
  if private:
    resolved.privacy.noise_multiplier = sigma
  return dataclasses.replace(plan, config=resolved, noise_multiplier=sigma,
                             noise_multiplier_source=source, accountant=acct)


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
      'num_truncated': num_truncated,
      'seed': sampler.seed,
      'config': plan.config.to_dict(),
  }
