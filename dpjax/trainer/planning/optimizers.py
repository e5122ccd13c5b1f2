"""The optax optimiser of a run (`OptimizerSettings`), with its learning-rate schedule.

Schedules (`optimizer.schedule`), with η = `optimizer.learning_rate` and t the
optimiser step (one per logical DP-SGD step, counting from 0):

  'constant': η_t = η.
  'cosine':   linear warm-up then cosine decay to 0 (Loshchilov & Hutter 2017,
              "SGDR"; Goyal et al. 2017 for the warm-up), W = `warmup_steps`, T =
              the run's number of steps:
                η_t = η · t / W                                   for t < W,
                η_t = η · ½ (1 + cos(π (t − W) / (T − W)))        for W ≤ t ≤ T.
  'step':     piecewise constant, η_t = η · f^{#{s in decay_steps : s ≤ t}} with
              f = `decay_factor` (De et al. 2022 use step decay for WRNs on CIFAR-10).

The schedule changes only what the optimiser does with the released noisy
gradient (post-processing), so it has no privacy cost.
"""

from __future__ import annotations

import dataclasses

import ml_collections
import optax

from dpjax.trainer.configuration import config_fields

SCHEDULES = ('constant', 'cosine', 'step')
OPTIMIZERS = ('sgd', 'adam')


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
  """The `optimizer` block of a config, typed (`of` fills a missing field with its declared
  default, `dpjax.trainer.configuration.config_fields.FIELDS`)."""

  name: str
  learning_rate: float
  momentum: float
  schedule: str
  warmup_steps: int
  decay_steps: tuple[int, ...]
  decay_factor: float

  @classmethod
  def of(cls, block: ml_collections.ConfigDict) -> OptimizerSettings:
    values = {
      f.name: config_fields.get(
        block, f.name, config_fields.FIELDS_BY_PATH[f'optimizer.{f.name}'].default
      )
      for f in dataclasses.fields(cls)
    }
    values['decay_steps'] = tuple(int(s) for s in values['decay_steps'])
    return cls(**values)


def make_schedule(settings: OptimizerSettings, num_steps: int) -> optax.Schedule:
  """The learning-rate schedule t -> η_t of `settings` over num_steps."""
  lr = float(settings.learning_rate)
  name = settings.schedule
  if name not in SCHEDULES:
    raise ValueError(f'optimizer.schedule = {name!r}: must be one of {SCHEDULES}.')
  if name == 'constant':
    return optax.constant_schedule(lr)
  if name == 'cosine':
    warmup = int(settings.warmup_steps)
    if not 0 <= warmup < num_steps:
      raise ValueError(
        f'optimizer.warmup_steps = {warmup}: must be an integer in '
        f'[0, {num_steps}) (the run has {num_steps} steps).'
      )
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, num_steps, end_value=0.0)
  boundaries = tuple(int(s) for s in settings.decay_steps)
  factor = float(settings.decay_factor)
  if any(s <= 0 for s in boundaries) or list(boundaries) != sorted(set(boundaries)):
    raise ValueError(
      f'optimizer.decay_steps = {boundaries}: must be strictly increasing steps > 0.'
    )
  if not 0 < factor <= 1:
    raise ValueError(f'optimizer.decay_factor = {factor}: must be a number in (0, 1].')
  return optax.piecewise_constant_schedule(lr, {s: factor for s in boundaries})


def make_optimizer(
  settings: OptimizerSettings | ml_collections.ConfigDict, num_steps: int
) -> optax.GradientTransformation:
  """sgd (with optional momentum) or adam of `settings`, scheduled.

  Args:
    settings: `OptimizerSettings`, or a config's `optimizer` block (read by
      `OptimizerSettings.of`): name, learning_rate, momentum (sgd; 0 = none), schedule,
      warmup_steps (cosine), decay_steps and decay_factor (step); see
      configs/digits_mlp.py. Ranges are validated by `dpjax.trainer.configuration.config_fields`.
    num_steps: T, the number of optimiser steps of the run (the cosine horizon).
  """
  if not isinstance(settings, OptimizerSettings):
    settings = OptimizerSettings.of(settings)
  if settings.name not in OPTIMIZERS:
    raise ValueError(f'optimizer.name = {settings.name!r}: must be one of {OPTIMIZERS}.')
  if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
    raise ValueError(f'num_steps = {num_steps!r}: must be an integer >= 1.')
  schedule = make_schedule(settings, num_steps)
  if settings.name == 'sgd':
    return optax.sgd(schedule, momentum=settings.momentum or None)
  return optax.adam(schedule)
