"""The resolved plan of a run: every fact that enters ε, computed once, and its fingerprint.

  plan = make_plan(config, train_source, seed=seed)            # a fresh run
  plan = make_plan(config, train_source, previous, seed=seed)  # a resume: `previous` is the
                                                               # checkpoint's fingerprint

Resolution, in this order and nowhere else: validate the config
(`dpjax.trainer.configuration.config_fields`) → the sampler (`make_sampler`, seeded by the run's
secret seed, `dpjax.trainer.workdir.run_seed`) → the run length in steps → δ (refused at or above
1/N) → the cap B (`batching.resolve_max_batch_size`; on resume, the checkpoint's B)
→ σ (given; on resume, the checkpoint's σ, never re-calibrated; else calibrated to
`privacy.target_epsilon`) → the `privacy_plan.PrivacyPlan` that binds sampler, B,
σ, C, δ, η (the float rounding of the noised sum, from B and `config.precision` on this
platform) and the accountant → the budget check (final ε ≤ target). `dpjax.train`
builds the batcher and the DP step from that plan and reports ε from its
accountant, so what is reported is what ran. `make_accountant(config, N)` is
`make_plan(config, N).accountant`.

The **privacy fingerprint** (`RunPlan.fingerprint`) lists everything that
enters ε: the private flag, the sampler and its accounting parameters (N, b,
the resolved B, the group size), σ as used, C, δ, the resolved accountant, η and
the matmul format it comes from, the runs `init_from` starts from (their ε composes with this run's unless
`init_from_disjoint_data`, `dpjax.trainer.planning.init_source`) and the digest of its weights, the SHA-256 of the seed
(it fixes which examples each step uses, which epoch-based
accounting relies on; the seed itself is never stored in a checkpoint), the audit
canaries, and the dataset's identity (source, name, split, N, and a digest of its
content: features and labels in example order, `dpjax.data.identity`). Every
checkpoint stores it; `make_plan(..., previous)` refuses any difference, listing each
field `old → new`. Allowed on resume: fields that do not touch privacy (learning rate,
logging, evaluation, checkpointing, P when B is still a multiple of it, a precision mode
with the same matmul format) and a longer run, whose ε is recomputed for the new total
and checked against `privacy.target_epsilon` as a budget.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import ml_collections
import numpy as np

from dpjax.data import sources as data_lib
from dpjax.privacy import batching
from dpjax.privacy import privacy_plan
from dpjax.privacy import samplers as samplers_lib
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.auditing import audited_sgd
from dpjax.privacy.auditing import canaries as canaries_lib
from dpjax.trainer.configuration import config_fields
from dpjax.trainer.planning import fingerprint as fingerprint_lib
from dpjax.trainer.configuration import perf as perf_lib
from dpjax.trainer.planning import plan_blocks
from dpjax.trainer.planning import privacy_resolution
from dpjax.trainer.planning import training_set_size
from dpjax.trainer.planning.privacy_resolution import NEW_WORKDIR_HINT
from dpjax.trainer.planning.privacy_resolution import PlanError


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
    perf: the settings that cannot change ε (`dpjax.trainer.configuration.perf.Perf`: P, steps per call,
      devices, compilation cache); the fingerprint never reads them.
    max_batch_size: B, the cap on the logical batch (the accountant pays for truncation to it).
    private: False for the non-private baseline (no σ, C, δ, accountant, ε).
    privacy: the `PrivacyPlan` (sampler, B, σ, C, δ, k, accountant) of a private run, else None.
    dataset: the dataset identity (source, name, split, num_examples, content digest), or
      None when only N is known.
    seed_source: 'drawn' (OS entropy), 'workdir' (the seed a resumed run drew) or 'config'
      (given by the user: the guarantee then needs it to be secret).
    warnings: lines to print at start (e.g. δ above 1/(10·N)).
    init_source: what `init_from` names (`dpjax.trainer.planning.init_source`): the runs whose privacy
    loss the accountant composes with this run's, or weights assumed public; None without.
    schedule, recipe, finetune, audit, data: the config's other settings, typed
      (`dpjax.trainer.planning.plan_blocks`); what lies below the plan reads these, never `config`.
  """

  config: ml_collections.ConfigDict
  sampler: samplers_lib.Sampler
  num_steps: int
  perf: perf_lib.Perf
  max_batch_size: int
  private: bool
  privacy: privacy_plan.PrivacyPlan | None
  dataset: dict[str, Any] | None
  schedule: plan_blocks.Schedule
  recipe: plan_blocks.Recipe
  finetune: plan_blocks.Finetune
  audit: plan_blocks.AuditPlan
  data: plan_blocks.DataSettings
  seed_source: str = 'config'
  warnings: tuple[str, ...] = ()
  init_source: Any = None

  @property
  def seed(self) -> int:
    return self.sampler.seed

  @property
  def seed_is_secret(self) -> bool:
    """False when the seed came from the config (known to the adversary unless kept secret)."""
    return self.seed_source != 'config'

  @property
  def fingerprint(self) -> dict[str, Any]:
    """The flat dict of everything that enters ε (JSON-ready; compared on resume)."""
    return self.fingerprint_of(self.privacy)

  def fingerprint_of(self, privacy: Any) -> dict[str, Any]:
    """The fingerprint with `privacy`'s fields (a `PrivacyPlan`, the fields of one before σ
    is calibrated, `fingerprint.PendingFields`, or None for a non-private run)."""
    return fingerprint_lib.run_fingerprint(
      self.sampler,
      self.max_batch_size,
      privacy,
      self.dataset,
      self.audit,
      self.finetune,
      self.data.public_num_examples,
      getattr(self.init_source, 'weights_sha256', None),
    )

  def config_json(self) -> str:
    """The text of the run's `config.json` (the resolved config)."""
    return json.dumps(self.config.to_dict(), indent=2)

  def summary(self) -> str:
    """One line: sampler, b, B, P, σ (and whether calibrated), C, target ε, steps."""
    s = self.sampler
    text = (
      f'{s.name} sampler, {training_set_size.describe(s)}, b = {s.batch_size}, '
      f'B = {self.max_batch_size}, P = {self.perf.physical_batch_size}, {self.num_steps} steps'
    )
    p = self.privacy
    if p is None:
      return text + ', non-private (no clipping, no noise, ε = ∞)'
    source = {'given': 'given', 'calibrated': 'calibrated', 'checkpoint': "the checkpoint's"}[
      p.noise_multiplier_source
    ]
    target = f'target ε = {p.target_epsilon:g}' if p.target_epsilon else 'no target ε'
    return (
      text + f', σ = {p.noise_multiplier:.4f} ({source}), C = {p.clip_norm:g}, '
      f'δ = {p.delta:g}, {target}'
    )


def make_training_sources(config: ml_collections.ConfigDict):
  """(train, test) sources of a config: the data block's, plus the audit canaries' m rows.

  The one place that decides N for training, `dpjax.account` and `dpjax.planner` alike
  (canaries are sampled like any example: the run has N + m examples).
  """
  train, test = data_lib.make_sources(config.data, loss=plan_blocks.declared(config, 'loss'))
  num_canaries = plan_blocks.declared(config, 'audit.num_canaries')
  if num_canaries:
    train = canaries_lib.CanarySource(train, num_canaries)
  return train, test


def make_sampler(
  config: ml_collections.ConfigDict, num_examples: int, seed: int | None = None
) -> samplers_lib.Sampler:
  """The sampler named by `config.sampler.name` over the `num_examples` training rows; its
  N is `data.public_num_examples` when that public bound is set (`training_set_size`).

  seed: the run's resolved (secret) seed; None reads `config.seed` (None there gives 0,
  enough for accounting, which does not depend on the seed).
  """
  if seed is None:
    seed = plan_blocks.declared(config, 'seed') or 0
  n, rows = training_set_size.sampler_sizes(config, num_examples)
  fields = {
    name: plan_blocks.declared(config, f'sampler.{name}') for name in samplers_lib.OWN_FIELDS
  }
  own = samplers_lib.sampler_class(config.sampler.name).own_fields
  for name, value in fields.items():
    if name not in own and value != config_fields.FIELDS_BY_PATH[f'sampler.{name}'].default:
      raise config_fields.ConfigError(
        f'sampler.{name} = {value}: not a setting of sampler.name = {config.sampler.name!r} '
        f'(leave it at its default, or choose a sampler that has it).'
      )
  fields = {name: value for name, value in fields.items() if name in own}
  try:
    return samplers_lib.make(
      config.sampler.name, n, config.sampler.batch_size, seed, num_rows=rows, **fields
    )
  except ValueError as e:  # The core names its argument (b > N); the config, its field.
    if str(e).startswith('batch_size '):
      raise config_fields.ConfigError(f'sampler.{e}') from None
    raise


def make_accountant(
  config: ml_collections.ConfigDict, num_examples: int, **kwargs
) -> accountant_lib.Accountant:
  """The accountant of the run that `config` trains on `num_examples` examples:
  `make_plan(config, N).accountant`, so training and every CLI account for the same run.

  kwargs: extra `accounting.Accountant` options (monte_carlo_samples, beta, ...); they
  override the config's (monte_carlo_workers).
  """
  if not config.privacy.enabled:
    raise ValueError('privacy.enabled is False: a non-private run has no ε to account.')
  return make_plan(config, num_examples, accountant_options=kwargs).privacy.accountant


def audit_settings(config: ml_collections.ConfigDict):
  """`auditing.audited_sgd.AuditSettings` of a training config (seed None: drawn)."""
  return audited_sgd.AuditSettings(
    sampler=config.sampler.name,
    batch_size=config.sampler.batch_size,
    physical_batch_size=config.sampler.physical_batch_size,
    max_batch_size=config.sampler.max_batch_size,
    num_steps=config.num_steps,
    clip_norm=float(config.privacy.clip_norm),
    noise_multiplier=float(config.privacy.noise_multiplier or 0.0),
    delta=config.privacy.delta,
    learning_rate=config.optimizer.learning_rate,
    seed=plan_blocks.declared(config, 'seed'),
  )


def num_train_steps(config: ml_collections.ConfigDict, sampler: samplers_lib.Sampler) -> int:
  """`num_steps`, or `num_epochs` epochs of ceil(N/b) steps (exactly one is > 0)."""
  return config.num_steps or config.num_epochs * sampler.steps_per_epoch


def make_plan(
  config: ml_collections.ConfigDict,
  data: Any,
  previous: dict[str, Any] | None = None,
  *,
  seed: int | None = None,
  seed_source: str = 'config',
  resumed_step: int = 0,
  accountant_options: dict | None = None,
  perf: perf_lib.Perf | None = None,
) -> RunPlan:
  """Resolves `config` once into a RunPlan (see the module docstring).

  Args:
    config: the training config (every field declared as in configs/digits_mlp.py).
    data: the training `DataSource` (its identity enters the fingerprint), or just N.
    previous: the privacy fingerprint of the checkpoint being resumed, or None.
    seed: the run's resolved seed (`dpjax.trainer.workdir.run_seed`); None = `config.seed`, or 0 when
      that is None too (enough to account: ε does not depend on the seed).
    seed_source: where `seed` came from ('drawn', 'workdir' or 'config').
    resumed_step: the step of that checkpoint (the run may not end before it).
    accountant_options: extra `accounting.Accountant` options (Monte-Carlo samples, β, ...).
    perf: the run's `Perf`, when the caller has already read it (default: from `config`).

  Raises:
    ConfigError / PlanError (ValueErrors, one line each) for a bad field, a fingerprint
    mismatch on resume, or a run that would exceed privacy.target_epsilon.
  """
  config_fields.validate(config, accounting_only=isinstance(data, (int, np.integer)))
  if seed is None:
    seed = plan_blocks.declared(config, 'seed') or 0
  num_examples, dataset = _data_identity(config, data, seed)
  finetune = plan_blocks.Finetune.of(config)
  init = _init_source(finetune, previous)
  sampler = make_sampler(config, num_examples, seed=seed)
  num_steps = num_train_steps(config, sampler)
  _check_resumable(previous, resumed_step, num_steps)
  private = bool(config.privacy.enabled)
  notes = privacy_resolution.delta_warnings(config, sampler.num_examples) if private else []
  if init is not None and dataset is not None:
    notes += init.data_notes(dataset['content_sha256'])
  perf = perf or perf_lib.Perf.from_config(config)
  max_batch_size = _resolve_max_batch_size(
    config,
    sampler,
    previous,
    num_steps,
    float(config.privacy.delta) if private else 1e-5,
    perf.physical_batch_size,
  )
  resolved = _resolved_config(config, num_steps, max_batch_size)
  plan = RunPlan(
    config=resolved,
    sampler=sampler,
    num_steps=num_steps,
    perf=perf,
    max_batch_size=max_batch_size,
    private=private,
    privacy=None,
    dataset=dataset,
    schedule=plan_blocks.Schedule.of(config),
    recipe=plan_blocks.Recipe.of(config),
    finetune=finetune,
    audit=plan_blocks.AuditPlan.of(config),
    data=plan_blocks.DataSettings.of(config),
    seed_source=seed_source,
    warnings=tuple(notes),
    init_source=init,
  )
  if not private:
    if previous is not None:
      privacy_resolution.refuse_changes(previous, plan.fingerprint)
    return plan
  private_plan = privacy_resolution.resolve(config, plan, previous, accountant_options)
  resolved.privacy.noise_multiplier = private_plan.noise_multiplier
  return dataclasses.replace(plan, privacy=private_plan)


def _data_identity(config: ml_collections.ConfigDict, data: Any, seed: int):
  """(N, the dataset identity that enters the fingerprint; None when only N is given)."""
  if isinstance(data, (int, np.integer)):
    return int(data), None
  return len(data), fingerprint_lib.dataset_identity(
    config.data, data, fingerprint_lib.data_key(seed)
  )


def _resolved_config(
  config: ml_collections.ConfigDict, num_steps: int, max_batch_size: int
) -> ml_collections.ConfigDict:
  """A copy of `config` with the run length in steps and the cap B filled in (config.json)."""
  resolved = ml_collections.ConfigDict(config.to_dict())
  resolved.num_steps, resolved.num_epochs = num_steps, 0
  resolved.sampler.max_batch_size = max_batch_size
  return resolved


def _init_source(finetune: plan_blocks.Finetune, previous: dict[str, Any] | None):
  """What `init_from` names (`init_source.read_source`), None without; on resume, refuses
  weights other than those the run started from."""
  if not finetune.init_from:
    return None
  from dpjax.trainer.planning import init_source  # pylint: disable=import-outside-toplevel
  from dpjax.trainer.workdir import stored_params  # pylint: disable=import-outside-toplevel

  init = init_source.read_source(finetune.init_from, finetune.init_from_disjoint_data)
  if previous is not None:  # A resume continues from the weights it started from only.
    stored_params.refuse_changed(
      finetune.init_from, previous.get(fingerprint_lib.INIT_WEIGHTS_FIELD), init.weights_sha256
    )
  return init


def _check_resumable(previous: dict[str, Any] | None, resumed_step: int, num_steps: int) -> None:
  """PlanError for a checkpoint without a current fingerprint, or beyond the run's end."""
  version = fingerprint_lib.FINGERPRINT_VERSION
  if previous is not None and previous.get('fingerprint_version') != version:
    raise PlanError(
      f'the checkpoint in this workdir has no privacy fingerprint of version '
      f'{version} (written by an older dpjax), so a resume cannot be checked. ' + NEW_WORKDIR_HINT
    )
  if resumed_step > num_steps:
    raise PlanError(
      f"num_steps: the checkpoint is at step {resumed_step}, beyond this config's "
      f'{num_steps} steps. Set num_steps/num_epochs to at least that, or use a new '
      '--workdir.'
    )


def _resolve_max_batch_size(
  config: ml_collections.ConfigDict,
  sampler: samplers_lib.Sampler,
  previous: dict[str, Any] | None,
  num_steps: int,
  delta: float,
  physical: int,
) -> int:
  """The cap B (a multiple of P = `physical`): resolved from (N, b, steps, δ) on a fresh run,
  the checkpoint's on resume. PlanError for P above `batching.max_physical_batch_size`."""
  largest = batching.max_physical_batch_size(
    sampler, config.sampler.max_batch_size, num_steps=num_steps, delta=delta
  )
  if physical > largest:
    raise PlanError(
      f'sampler.physical_batch_size = {physical}: must be <= {largest} (the cap on '
      'a logical batch rounded up to a power of two), or 0 = automatic; a larger '
      'P only adds padding rows, which cost compile time and memory.'
    )
  if previous is None or config.sampler.max_batch_size:
    return batching.resolve_max_batch_size(
      sampler, physical, config.sampler.max_batch_size, num_steps=num_steps, delta=delta
    )
  max_batch_size = previous['sampler.max_batch_size']
  if physical and max_batch_size % physical:
    raise PlanError(
      f'sampler.physical_batch_size = {physical}: the run being resumed has the '
      f'cap B = {max_batch_size}, which is not a multiple of it; choose a P that '
      f'divides {max_batch_size}.'
    )
  return max_batch_size
