"""What an accountant reports: ε at δ after some steps, and what kind of bound it is."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

# 'upper': provable; 'high_probability_upper': holds with probability >= confidence over
# Monte-Carlo sampling; 'lower': no valid ε is smaller (docs/accounting.md).
BOUNDS = ('upper', 'high_probability_upper', 'lower')


@dataclasses.dataclass(frozen=True)
class PrivacyReport:
  """ε of a run after `steps` steps, and what kind of bound it is.

  Attributes:
    epsilon: the attached ε at `delta`.
    delta: δ (the total, any truncation penalty included).
    bound: 'upper' (provable), 'high_probability_upper' (holds with
      probability ≥ `confidence` over the Monte-Carlo sampling) or 'lower'.
    accountant: 'pld', 'rdp' or 'monte_carlo' (resolved from 'auto').
    sampler: the sampler's name.
    noise_multiplier: σ.
    steps: steps completed.
    steps_per_epoch: ceil(N/b).
    epsilon_lower: a provable lower bound on the true ε at `delta`, if known.
    confidence: 1 − β of a Monte-Carlo number (attached or in details), if any.
    num_samples: Monte-Carlo samples per direction, if any.
    details: method names and the numbers reported beside ε, with labels.
  """

  epsilon: float
  delta: float
  bound: str
  accountant: str
  sampler: str
  noise_multiplier: float
  steps: int
  steps_per_epoch: int
  epsilon_lower: float | None = None
  confidence: float | None = None
  num_samples: int | None = None
  details: dict[str, Any] = dataclasses.field(default_factory=dict)

  def to_dict(self) -> dict[str, Any]:
    return _plain(dataclasses.asdict(self))

  @classmethod
  def from_dict(cls, values: dict[str, Any]) -> PrivacyReport:
    """The report `to_dict` wrote (e.g. a checkpoint's metadata)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})

  def to_json(self, **kwargs) -> str:
    """One JSON object (non-finite ε is written as Infinity, as Python's json does)."""
    return json.dumps(self.to_dict(), **kwargs)


def _plain(value):
  """numpy scalars and tuples to plain Python, for JSON."""
  if isinstance(value, dict):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  return value
