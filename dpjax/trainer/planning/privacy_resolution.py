"""The private half of `make_plan`: σ resolved once and bound with the sampler, B, C, δ and
the accountant in a `PrivacyPlan`, and the refusals that protect ε.

σ is the config's, else the checkpoint's on resume (never re-calibrated: the steps that ran
had it), else calibrated to `privacy.target_epsilon`. Refused, one line naming the fields:
δ ≥ 1/N (unless allowed), a resume whose fingerprint differs (before any accounting), a
run whose final ε exceeds the target, and runs `init_from` starts from that already spend it.
"""

from __future__ import annotations

from typing import Any
import warnings

import ml_collections

from dpjax.privacy import checks
from dpjax.privacy import mechanisms
from dpjax.privacy import privacy_plan
from dpjax.privacy.accounting import composition
from dpjax.privacy.accounting import matrix_mechanism
from dpjax.privacy.accounting import step_pld
from dpjax.privacy.accounting.options import AccountingOptions
from dpjax.trainer.configuration import accounting_refusals
from dpjax.trainer.configuration import config_fields
from dpjax.trainer.planning import fingerprint as fingerprint_lib
from dpjax.trainer.planning import plan_blocks

NEW_WORKDIR_HINT = 'Use a new --workdir for a run with these settings, or restore the old ones.'


class PlanError(config_fields.ConfigError):
  """The config cannot run as planned (or cannot resume this workdir); one line, names fields."""


def delta_warnings(config: ml_collections.ConfigDict, num_examples: int) -> list[str]:
  """Refuses δ >= 1/N (unless allowed); the warning lines for a δ above 1/(10·N)."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always', checks.LargeDeltaWarning)
    checks.check_delta(
      config.privacy.delta,
      'privacy.delta',
      num_examples=num_examples,
      allow_large_delta=bool(plan_blocks.declared(config, 'privacy.allow_large_delta')),
      flag='privacy.allow_large_delta = True',
    )
  return [str(w.message) for w in caught]


def noise_options(config: ml_collections.ConfigDict, plan: Any) -> dict[str, Any]:
  """The `AccountingOptions` of the run's noise: its name, BandMF's bands, and the strategy
  made once for the run's T steps (`mechanisms.strategy`), which the step runs and the
  accountant reads. A sampler that cannot account the mechanism is refused first, before any
  strategy is optimised."""
  noise = plan_blocks.declared(config, 'privacy.noise') or 'gaussian'
  bands = plan_blocks.declared(config, 'privacy.num_bands') or 1
  if noise == 'gaussian':
    return {'noise': noise, 'num_bands': bands}
  try:
    matrix_mechanism.check_combination(plan.sampler, noise, bands if noise == 'bandmf' else 1)
    run_strategy = mechanisms.strategy(
      noise, plan.num_steps, bands, plan_blocks.declared(config, 'privacy.num_buffers')
    )
  except ValueError as e:
    raise PlanError(f'privacy.noise = {noise!r}: {e}') from None
  return {
    'noise': noise,
    'num_bands': bands if noise == 'bandmf' else 1,
    'strategy': run_strategy,
  }


def resolve(
  config: ml_collections.ConfigDict,
  plan: Any,
  previous: dict[str, Any] | None,
  accountant_options: dict | None,
) -> privacy_plan.PrivacyPlan:
  """The `PrivacyPlan` of `plan` (a `RunPlan` without one): σ given, the checkpoint's or
  calibrated once, bound with the sampler, B, C, δ and the accountant; refuses a changed
  fingerprint before any accounting, and a run whose final ε exceeds the target."""
  privacy = config.privacy
  extra = dict(accountant_options or {})
  platform = extra.pop('platform', None)  # Where η is paid (a `PrivacyPlan.create` argument).
  sigma, source = privacy.noise_multiplier, 'given'
  if sigma is None and previous is not None and previous.get('privacy.noise_multiplier'):
    sigma, source = float(previous['privacy.noise_multiplier']), 'checkpoint'
  options = AccountingOptions(
    accountant=privacy.accountant,
    group_size=privacy.group_size,
    allow_large_delta=True,  # δ ≥ 1/N refused (unless allowed) by `delta_warnings`.
    monte_carlo_workers=plan_blocks.declared(config, 'privacy.monte_carlo_workers'),
    random_allocation_timeout=plan_blocks.declared(config, 'privacy.random_allocation_timeout'),
    **noise_options(config, plan),
  ).replace(**extra)
  grid = options.value_discretization_interval
  pld_options = {} if grid is None else {'value_discretization_interval': grid}
  prior = plan.init_source.prior_runs(privacy.group_size, **pld_options) if plan.init_source else ()
  precision = plan.recipe.precision
  if previous is not None:  # Refuse before any (costly) accounting.
    pending = fingerprint_lib.PendingFields(
      plan.sampler, plan.max_batch_size, privacy, sigma, precision, options, prior
    )
    refuse_changes(previous, plan.fingerprint_of(pending))
  if prior and privacy.target_epsilon:
    _check_prior_budget(prior, privacy, plan.init_source.path)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', checks.LargeDeltaWarning)  # Noted by make_plan.
    private_plan = privacy_plan.PrivacyPlan.create(
      plan.sampler,
      noise_multiplier=sigma,
      noise_multiplier_source=source,
      check_budget=False,
      num_steps=plan.num_steps,
      clip_norm=privacy.clip_norm,
      delta=privacy.delta,
      target_epsilon=privacy.target_epsilon,
      max_batch_size=plan.max_batch_size,
      physical_batch_size=plan.perf.physical_batch_size,
      precision=precision,
      platform=platform,
      accounting=options.replace(prior_runs=prior),
    )
  _check_final_epsilon(private_plan, resumed=previous is not None)
  return private_plan


def _check_final_epsilon(private_plan: privacy_plan.PrivacyPlan, resumed: bool) -> None:
  """The final ε now (memoised): a run whose privacy loss cannot be composed, or whose ε
  exceeds the target, is refused here, before anything is written."""
  num_steps, prior = private_plan.num_steps, private_plan.accountant.prior_runs
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
      if resumed
      else f'privacy.noise_multiplier = {private_plan.noise_multiplier:g} over {num_steps} steps'
    )
    what += ', composed with the runs init_from starts from,' if prior else ''
    raise PlanError(
      f'{what} would reach ε = {e.final_epsilon:.4g} (δ = {private_plan.delta:g}), '
      f'above privacy.target_epsilon = {private_plan.target_epsilon:g}. Raise '
      'privacy.target_epsilon (the budget), raise σ, or shorten the run.'
      + ('' if resumed else ' Or unset privacy.noise_multiplier (None) to calibrate it.')
    ) from None


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


def refuse_changes(previous: dict[str, Any], current: dict[str, Any]) -> None:
  changes = fingerprint_lib.fingerprint_changes(previous, current)
  if changes:
    raise PlanError(
      'this workdir holds a run with other privacy settings; resuming it would '
      'make its ε wrong. Changed: ' + '; '.join(changes) + '. ' + NEW_WORKDIR_HINT
    )
