"""The inputs of `PrivacyPlan.create`, checked and resolved: T, C, δ, the target ε and k,
σ (given, or calibrated to the target), and the σ and B of a state being resumed.

Every check is `dpjax.privacy.checks`' (one line naming the argument); σ is calibrated by
`accounting.calibration` with the accountant options the plan's accountant is built with.
"""

from __future__ import annotations

from typing import Any

from dpjax.privacy import batching
from dpjax.privacy import checks
from dpjax.privacy import noise_state
from dpjax.privacy import precision as precision_lib
from dpjax.privacy import rounding as rounding_lib
from dpjax.privacy import samplers as samplers_lib
from dpjax.privacy.accounting import calibration
from dpjax.privacy.accounting.options import AccountingOptions


def checked(
  sampler: samplers_lib.Sampler,
  num_steps: int,
  clip_norm: float,
  delta: float,
  target_epsilon: float,
  options: AccountingOptions,
) -> tuple[int, float, float, float, AccountingOptions]:
  """(T, C, δ, target ε, `options` with T and k checked), each checked (`checks`: one line
  naming the argument)."""
  num_steps = checks.check_int('num_steps', num_steps, 1)
  clip_norm = checks.check_clip_norm(clip_norm)
  delta = checks.check_delta(
    delta, num_examples=sampler.num_examples, allow_large_delta=options.allow_large_delta
  )
  target = (
    0.0 if not target_epsilon else checks.check_number('target_epsilon', target_epsilon, low=0.0)
  )
  group_size = checks.check_int('group_size', options.group_size, 1)
  return (
    num_steps,
    clip_norm,
    delta,
    target,
    options.replace(num_steps=num_steps, group_size=group_size),
  )


def cap_and_rounding(
  sampler: samplers_lib.Sampler,
  max_batch_size: int,
  physical_batch_size: int,
  precision: str,
  platform: str | None,
  delta: float,
  options: AccountingOptions,
) -> tuple[rounding_lib.Rounding, AccountingOptions]:
  """(η of the resolved cap B, `options` with B and 1 + η): B given or automatic
  (`batching.resolve_max_batch_size`, a multiple of P), η of B, the precision, the platform."""
  max_batch_size = batching.resolve_max_batch_size(
    sampler, physical_batch_size, max_batch_size, num_steps=options.num_steps, delta=delta
  )
  rounding = rounding_lib.Rounding.of(
    max_batch_size, precision_lib.check_precision(precision), platform
  )
  return rounding, options.replace(max_batch_size=max_batch_size, sensitivity=rounding.sensitivity)


def resolve_sigma(
  sampler: samplers_lib.Sampler,
  noise_multiplier: float | None,
  target_epsilon: float,
  delta: float,
  options: AccountingOptions,
) -> tuple[float, str]:
  """(σ, 'given') checked, or (the smallest σ meeting `target_epsilon`, 'calibrated')."""
  if noise_multiplier is not None:
    return checks.check_noise_multiplier(noise_multiplier), 'given'
  if not target_epsilon:
    raise ValueError(
      'noise_multiplier or target_epsilon must be given (σ, or an ε to calibrate σ to).'
    )
  given = {k: v for k, v in options.given().items() if k != 'num_steps'}
  return calibration.calibrate_noise_multiplier(
    sampler, target_epsilon, delta, options.num_steps, **given
  ), 'calibrated'


def resumed_settings(
  opt_state: Any, noise_multiplier: float | None, max_batch_size: int
) -> tuple[float, int]:
  """(σ, B) of the privatizer state in `opt_state`, what ran; ValueError (one line) if the
  caller gives another σ or B (0: none given). B is kept too: the automatic cap depends on
  T, and the batches that ran were truncated at the state's."""
  ran = noise_state.describe(noise_state.find(opt_state))
  for name, given in (
    ('noise_multiplier', noise_multiplier),
    ('max_batch_size', max_batch_size or None),
  ):
    if given is not None and given != ran[name]:
      raise ValueError(
        f'{name} = {given!r} differs from the {ran[name]!r} of the state to '
        f'resume (what ran): a resumed loop keeps it; leave {name} unset.'
      )
  return ran['noise_multiplier'], ran['max_batch_size']
