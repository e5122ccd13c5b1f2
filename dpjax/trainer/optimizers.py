"""The optax optimiser of `config.optimizer`, with its learning-rate schedule.

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

import ml_collections
import optax

SCHEDULES = ('constant', 'cosine', 'step')
OPTIMIZERS = ('sgd', 'adam')


def make_schedule(config: ml_collections.ConfigDict, num_steps: int) -> optax.Schedule:
  """The learning-rate schedule t -> η_t of `config` (an `optimizer` block) over num_steps."""
  lr = float(config.learning_rate)
  name = config.get('schedule', 'constant')
  if name not in SCHEDULES:
    raise ValueError(f'optimizer.schedule = {name!r}: must be one of {SCHEDULES}.')
  if name == 'constant':
    return optax.constant_schedule(lr)
  if name == 'cosine':
    warmup = int(config.get('warmup_steps', 0))
    if not 0 <= warmup < num_steps:
      raise ValueError(
        f'optimizer.warmup_steps = {warmup}: must be an integer in '
        f'[0, {num_steps}) (the run has {num_steps} steps).'
      )
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, num_steps, end_value=0.0)
  boundaries = tuple(int(s) for s in config.get('decay_steps', ()))
  factor = float(config.get('decay_factor', 0.1))
  if any(s <= 0 for s in boundaries) or list(boundaries) != sorted(set(boundaries)):
    raise ValueError(
      f'optimizer.decay_steps = {boundaries}: must be strictly increasing steps > 0.'
    )
  if not 0 < factor <= 1:
    raise ValueError(f'optimizer.decay_factor = {factor}: must be a number in (0, 1].')
  return optax.piecewise_constant_schedule(lr, {s: factor for s in boundaries})


def make_optimizer(
  config: ml_collections.ConfigDict, num_steps: int
) -> optax.GradientTransformation:
  """sgd (with optional momentum) or adam of `config` (an `optimizer` block), scheduled.

  Args:
    config: fields name, learning_rate, momentum (sgd; 0 = none), schedule,
      warmup_steps (cosine), decay_steps and decay_factor (step); see
      configs/digits_mlp.py. Ranges are validated by `dpjax.trainer.config_fields`.
    num_steps: T, the number of optimiser steps of the run (the cosine horizon).
  """
  if config.name not in OPTIMIZERS:
    raise ValueError(f'optimizer.name = {config.name!r}: must be one of {OPTIMIZERS}.')
  if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
    raise ValueError(f'num_steps = {num_steps!r}: must be an integer >= 1.')
  schedule = make_schedule(config, num_steps)
  if config.name == 'sgd':
    return optax.sgd(schedule, momentum=config.get('momentum', 0.0) or None)
  return optax.adam(schedule)
