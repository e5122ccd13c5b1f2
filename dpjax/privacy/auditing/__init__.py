"""Empirical privacy auditing: an ε lower bound measured from a run, beside the proven upper bound.

Modules: `one_run` (the tail bound of Steinke, Nasr & Jagielski 2023),
`canaries` (gradient canaries: coins, directions, the data source with canary
rows), `gradient_canary` (their injection into the clipped sum, projections),
`white_box` (per-step effective-σ test), `audited_sgd` (a minimal audited loop),
`record` (audit.json in a workdir, and the audit of a finished run).
"""

from dpjax.privacy.auditing.canaries import CanarySet, CanarySource, check_audit, make_canaries
from dpjax.privacy.auditing.gradient_canary import project, with_gradient_canaries
from dpjax.privacy.auditing.one_run import (
  OneRunAudit,
  audit,
  epsilon_lower_bound,
  max_epsilon_lower,
  p_value,
)
from dpjax.privacy.auditing.white_box import EffectiveSigma, effective_sigma
