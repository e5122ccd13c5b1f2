"""The resolved plan of a run: every fact that enters ε, computed once, and its fingerprint.

  plan = make_plan(config, train_source, seed=seed)            # a fresh run
  plan = make_plan(config, train_source, previous, seed=seed)  # a resume: `previous` is the
                                                               # checkpoint's fingerprint

Resolution, in this order and nowhere else: validate the config
(`dpjax.trainer.config_fields`) → the sampler (`make_sampler`, seeded by the run's
secret seed, `dpjax.trainer.run_seed`) → the run length in steps → δ (refused at or above
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
`init_from_disjoint_data`, `dpjax.trainer.init_source`) and the digest of its weights, the SHA-256 of the seed
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
from typing import Any
import warnings

import ml_collections
import numpy as np

from dpjax.privacy import checks
from dpjax.trainer import accounting_refusals
from dpjax.trainer import config_fields
from dpjax.trainer import fingerprint as fingerprint_lib
from dpjax.trainer import perf as perf_lib
from dpjax.trainer import training_set_size
from dpjax.privacy import batching
from dpjax.data import sources as data_lib
from dpjax.privacy import privacy_plan
from dpjax.privacy import samplers as samplers_lib
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import composition
from dpjax.privacy.accounting import step_pld
from dpjax.privacy.auditing import audited_sgd
from dpjax.privacy.auditing import canaries as canaries_lib

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
    perf: the settings that cannot change ε (`dpjax.trainer.perf.Perf`: P, steps per call,
      devices, compilation cache); the fingerprint never reads them.
    max_batch_size: B, the cap on the logical batch (the accountant pays for truncation to it).
    private: False for the non-private baseline (no σ, C, δ, accountant, ε).
    privacy: the `PrivacyPlan` (sampler, B, σ, C, δ, k, accountant) of a private run, else None.
    dataset: the dataset identity (source, name, split, num_examples, content digest), or
      None when only N is known.
    seed_source: 'drawn' (OS entropy), 'workdir' (the seed a resumed run drew) or 'config'
      (given by the user: the guarantee then needs it to be secret).
    warnings: lines to print at start (e.g. δ above 1/(10·N)).
    init_source: what `init_from` names (`dpjax.trainer.init_source`): the runs whose privacy
      loss the accountant composes with this run's, or weights assumed public; None without.
  """

  config: ml_collections.ConfigDict
  sampler: samplers_lib.Sampler
  num_steps: int
  perf: perf_lib.Perf
  max_batch_size: int
  private: bool
  privacy: privacy_plan.PrivacyPlan | None
  dataset: dict[str, Any] | None
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

  physical_batch_size = property(lambda self: self.perf.physical_batch_size)  # P (0 = automatic)
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
    return fingerprint_lib.run_fingerprint(
      self.config,
      self.sampler,
      self.max_batch_size,
      self.privacy,
      self.dataset,
      getattr(self.init_source, 'weights_sha256', None),
    )

  def summary(self) -> str:
    """One line: sampler, b, B, P, σ (and whether calibrated), C, target ε, steps."""
    s = self.sampler
    text = (
      f'{s.name} sampler, {training_set_size.describe(s)}, b = {s.batch_size}, '
      f'B = {self.max_batch_size}, P = {self.physical_batch_size}, {self.num_steps} steps'
    )
    if not self.private:
      return text + ', non-private (no clipping, no noise, ε = ∞)'
    source = {'given': 'given', 'calibrated': 'calibrated', 'checkpoint': "the checkpoint's"}[
      self.noise_multiplier_source
    ]
    target = f'target ε = {self.target_epsilon:g}' if self.target_epsilon else 'no target ε'
    return (
      text + f', σ = {self.noise_multiplier:.4f} ({source}), C = {self.clip_norm:g}, '
      f'δ = {self.delta:g}, {target}'
    )


def _of(privacy, name):
  return None if privacy is None else getattr(privacy, name)


def precision_of(config: ml_collections.ConfigDict) -> str:
  """`config.precision` (its declared default in an accounting-only config that lacks it)."""
  return config_fields.get(config, 'precision', config_fields.FIELDS_BY_PATH['precision'].default)


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


def make_sampler(
  config: ml_collections.ConfigDict, num_examples: int, seed: int | None = None
) -> samplers_lib.Sampler:
  """The sampler named by `config.sampler.name` over the `num_examples` training rows; its
  N is `data.public_num_examples` when that public bound is set (`training_set_size`).

  seed: the run's resolved (secret) seed; None reads `config.seed` (None there gives 0,
  enough for accounting, which does not depend on the seed).
  """
  if seed is None:
    seed = config.get('seed') or 0
  n, rows = training_set_size.sampler_sizes(config, num_examples)
  return samplers_lib.make(config.sampler.name, n, config.sampler.batch_size, seed, num_rows=rows)


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
  return make_plan(config, num_examples, accountant_options=kwargs).accountant


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
    seed=config.get('seed'),
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
    seed: the run's resolved seed (`dpjax.trainer.run_seed`); None = `config.seed`, or 0 when
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
    seed = config.get('seed') or 0
  if isinstance(data, (int, np.integer)):
    num_examples, dataset = int(data), None
  else:
    num_examples = len(data)
    dataset = fingerprint_lib.dataset_identity(config.data, data, fingerprint_lib.data_key(seed))
  init = None
  if config.get('init_from'):
    from dpjax.trainer import init_source  # pylint: disable=import-outside-toplevel
    from dpjax.trainer import stored_params  # pylint: disable=import-outside-toplevel

    init = init_source.read_source(config.init_from, bool(config.get('init_from_disjoint_data')))
    if previous is not None:  # A resume continues from the weights it started from only.
      stored_params.refuse_changed(
        config.init_from, previous.get(fingerprint_lib.INIT_WEIGHTS_FIELD), init.weights_sha256
      )
  sampler = make_sampler(config, num_examples, seed=seed)
  num_steps = num_train_steps(config, sampler)
  _check_resumable(previous, resumed_step, num_steps)
  private = bool(config.privacy.enabled)
  notes = _delta_warnings(config.privacy, sampler.num_examples) if private else []
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
  resolved = ml_collections.ConfigDict(config.to_dict())
  resolved.num_steps, resolved.num_epochs = num_steps, 0
  resolved.sampler.max_batch_size = max_batch_size
  plan = RunPlan(
    config=resolved,
    sampler=sampler,
    num_steps=num_steps,
    perf=perf,
    max_batch_size=max_batch_size,
    private=private,
    privacy=None,
    dataset=dataset,
    seed_source=seed_source,
    warnings=tuple(notes),
    init_source=init,
  )
  if not private:
    if previous is not None:
      _refuse_changes(previous, plan.fingerprint)
    return plan
  private_plan = _privacy_plan(config, plan, previous, accountant_options)
  resolved.privacy.noise_multiplier = private_plan.noise_multiplier
  return dataclasses.replace(plan, privacy=private_plan)


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


def _delta_warnings(privacy: ml_collections.ConfigDict, num_examples: int) -> list[str]:
  """Refuses δ >= 1/N (unless allowed); the warning lines for a δ above 1/(10·N)."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always', checks.LargeDeltaWarning)
    checks.check_delta(
      privacy.delta,
      'privacy.delta',
      num_examples=num_examples,
      allow_large_delta=bool(privacy.get('allow_large_delta', False)),
      flag='privacy.allow_large_delta = True',
    )
  return [str(w.message) for w in caught]


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


def _privacy_plan(
  config: ml_collections.ConfigDict,
  plan: RunPlan,
  previous: dict[str, Any] | None,
  accountant_options: dict | None,
) -> privacy_plan.PrivacyPlan:
  """σ (given, the checkpoint's, never re-calibrated, or calibrated once) bound with the
  sampler, B, C, δ and the accountant; refuses a changed fingerprint before any accounting,
  and a run whose final ε exceeds the target."""
  privacy, sampler, num_steps = config.privacy, plan.sampler, plan.num_steps
  sigma, source = privacy.noise_multiplier, 'given'
  if sigma is None and previous is not None and previous.get('privacy.noise_multiplier'):
    sigma, source = float(previous['privacy.noise_multiplier']), 'checkpoint'
  options = dict(monte_carlo_workers=privacy.get('monte_carlo_workers'))
  if privacy.get('random_allocation_timeout'):  # Seconds; the Accountant's default otherwise.
    options['random_allocation_timeout'] = privacy.random_allocation_timeout
  options.update(accountant_options or {})
  pld_options = {k: v for k, v in options.items() if k == 'value_discretization_interval'}
  prior = plan.init_source.prior_runs(privacy.group_size, **pld_options) if plan.init_source else ()
  options['prior_runs'] = prior
  if previous is not None:  # Refuse before any (costly) accounting.
    _refuse_changes(
      previous,
      fingerprint_lib.run_fingerprint(
        config,
        sampler,
        plan.max_batch_size,
        fingerprint_lib.PendingFields(
          sampler, plan.max_batch_size, privacy, sigma, precision_of(config), prior
        ),
        plan.dataset,
        getattr(plan.init_source, 'weights_sha256', None),
      ),
    )
  if prior and privacy.target_epsilon:
    _check_prior_budget(prior, privacy, plan.init_source.path)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', checks.LargeDeltaWarning)  # Noted by make_plan.
    private_plan = privacy_plan.PrivacyPlan.create(
      sampler,
      noise_multiplier=sigma,
      noise_multiplier_source=source,
      check_budget=False,
      num_steps=num_steps,
      clip_norm=privacy.clip_norm,
      delta=privacy.delta,
      target_epsilon=privacy.target_epsilon,
      max_batch_size=plan.max_batch_size,
      physical_batch_size=plan.physical_batch_size,
      accountant=privacy.accountant,
      group_size=privacy.group_size,
      allow_large_delta=True,
      precision=precision_of(config),
      **options,
    )
  # The final ε now (memoised): a run whose privacy loss cannot be composed is refused here,
  # before anything is written.
  try:
    private_plan.accountant.epsilon(num_steps)
  except step_pld.GridTooLargeError as e:  # Its fixes as config fields.
    raise PlanError(
      accounting_refusals.grid_too_large(
        e, private_plan.accountant, accounting_refusals.CONFIG_NAMES
      )
    ) from None
  try:
    private_plan.check_budget()
  except privacy_plan.BudgetExceededError as e:
    what = (
      f'extending the run to {num_steps} steps'
      if previous is not None
      else f'privacy.noise_multiplier = {private_plan.noise_multiplier:g} over {num_steps} steps'
    )
    what += ', composed with the runs init_from starts from,' if prior else ''
    raise PlanError(
      f'{what} would reach ε = {e.final_epsilon:.4g} (δ = {private_plan.delta:g}), '
      f'above privacy.target_epsilon = {private_plan.target_epsilon:g}. Raise '
      'privacy.target_epsilon (the budget), raise σ, or shorten the run.'
      + (
        '' if previous is not None else ' Or unset privacy.noise_multiplier (None) to calibrate it.'
      )
    ) from None
  return private_plan


def _check_prior_budget(prior, privacy, init_from: str) -> None:
  """PlanError when the runs init_from starts from already spend privacy.target_epsilon."""
  eps = composition.prior_epsilon(prior, float(privacy.delta))
  if eps >= privacy.target_epsilon:
    raise PlanError(
      f'privacy.target_epsilon = {privacy.target_epsilon:g}: the run(s) init_from = '
      f'{init_from!r} starts from already reach ε = {eps:.4g} at δ = '
      f'{privacy.delta:g}, and this run can only add to it. Raise the target, or '
      'set init_from_disjoint_data = True if this data shares no individual with '
      'theirs.'
    )


def _refuse_changes(previous: dict[str, Any], current: dict[str, Any]) -> None:
  changes = fingerprint_lib.fingerprint_changes(previous, current)
  if changes:
    raise PlanError(
      'this workdir holds a run with other privacy settings; resuming it would '
      'make its ε wrong. Changed: ' + '; '.join(changes) + '. ' + NEW_WORKDIR_HINT
    )
