"""The privacy claim stored with each checkpoint: what ε holds for exactly that state.

σ and C are read from the DP step that ran, the sampler and B from the batcher that fed it,
η and its cost from the plan's `PrivacyPlan`; the fingerprint is compared on resume
(`dpjax.trainer.planning.plan`) and `dpjax.export` makes the privacy card from it.
"""

from __future__ import annotations

from dpjax.privacy import mechanisms
from dpjax.trainer.planning import plan as plan_lib


def privacy_metadata(
  step: int, report, plan: plan_lib.RunPlan, step_fns, batcher, num_truncated: int
) -> dict:
  """The claim stored with a checkpoint: what ε holds for exactly this state.

  σ and C are read from the DP step that ran, the sampler and B from the batcher
  that fed it; the fingerprint is compared on resume.
  """
  sampler = batcher.sampler
  return {
    'step': step,
    'privacy': report.to_dict()
    if report is not None
    else {'epsilon': None, 'bound': 'none (non-private run)', 'accountant': None, 'delta': None},
    'fingerprint': plan.fingerprint,
    'noise_multiplier': step_fns.noise_multiplier if plan.private else None,
    'noise_multiplier_source': plan.privacy.noise_multiplier_source if plan.private else None,
    'clip_norm': step_fns.clip_norm if plan.private else None,
    # The noise mechanism that ran (read from the step's privatizer).
    'noise': mechanisms.record(step_fns.privatizer) if plan.private else None,
    # η, the float rounding ε pays for, and its cost Δε at this step.
    'rounding': plan.privacy.rounding_record(step) if plan.private else None,
    'num_examples': sampler.num_examples,
    'sampler': {
      'name': sampler.name,
      'batch_size': sampler.batch_size,
      'expected_batch_size': sampler.expected_batch_size,
      'sampling_probability': sampler.sampling_probability,
      'steps_per_epoch': sampler.steps_per_epoch,
      'max_batch_size': batcher.max_batch_size,
      'physical_batch_size': batcher.physical_batch_size,
      **{name: getattr(sampler, name) for name in sampler.own_fields},
    },
    'group_size': plan.privacy.group_size if plan.private else None,
    'num_truncated': num_truncated,  # Not covered by ε (a count of the private batch sizes).
    'seed_source': plan.seed_source,  # The seed itself is in private/seed.json only.
    'dataset': plan.dataset,
    'init_from': plan.init_source.metadata() if plan.init_source else None,
    'config': plan.config.to_dict(),
  }
