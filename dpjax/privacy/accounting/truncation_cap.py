"""A cap B too small for a target ε: refused before the σ search, with the B it needs.

Truncating a logical batch at B costs the total-variation penalty (1 + e^ε)·τ in δ, τ =
T·Pr[n_t > B] (`balls_and_bins.log_truncation_mass`; docs/accounting.md). At ε = target it
does not depend on σ, so a cap whose penalty alone reaches δ makes every σ miss the target.
"""

from __future__ import annotations

import math

from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import monotone


def truncation_penalty(sampler, delta, steps, cap, group_size, target) -> float:
  """(1 + e^ε)·τ / δ: the share of δ the TV truncation penalty takes at ε = target."""
  log_tau = balls_and_bins.log_truncation_mass(
    sampler.num_examples, sampler.sampling_probability, cap, steps, group_size=group_size
  )
  return math.exp(min(700.0, log_tau + math.log1p(math.exp(min(target, 700.0))) - math.log(delta)))


def check_truncation_cap(sampler, target: float, delta: float, steps: int, cap, group_size: int):
  """Refuses a cap B whose truncation penalty alone exceeds δ at the target; names the B needed.

  Calibration searches with the TV truncation penalty (1 + e^ε)·τ, τ = T·Pr[n_t > B]
  (`balls_and_bins.log_truncation_mass`); if it is >= δ at ε = target, no σ
  reaches the target and the failure is the cap's, not the noise's. B needed:
  the smallest B with a penalty <= δ/2 (half of δ left to the mechanism).
  """
  if cap is None or not sampler.binomial_batch_size:
    return
  if truncation_penalty(sampler, delta, steps, cap, group_size, target) < 1:
    return
  needed = monotone.smallest_integer(  # penalty(cap) >= 1 > 1/2: the cap is below the answer.
    lambda b: truncation_penalty(sampler, delta, steps, b, group_size, target),
    0.5,
    above=cap,
    first_guess=max(cap + 1, 2 * cap),
  )
  tau = math.exp(
    balls_and_bins.log_truncation_mass(
      sampler.num_examples, sampler.sampling_probability, cap, steps, group_size=group_size
    )
  )
  raise ValueError(
    f'sampler.max_batch_size B = {cap} is too small for target ε = {target}: over {steps} '
    f'steps of the {sampler.name} sampler, τ = T·Pr[batch > B] = {tau:.3g}, and the '
    f'truncation penalty (1 + e^ε)·τ alone is above δ = {delta:g} whatever σ. Needed: '
    f'B >= {needed} (penalty <= δ/2), or no max_batch_size (no truncation).'
  )
