"""Why a run stops before its last step, and the rule that decides it.

A run's course (stop or go on, which checkpoint is released) may depend only on what ε covers
or what is public (docs/threat_model.md, "What may change a run's course"):

* `TrainingDiverged`: `parameters_diverged`, a function of the parameters alone. DP-SGD's
  guarantee covers every iterate (Abadi et al. 2016, "Deep Learning with Differential
  Privacy"), so a stop on them is post-processing. Never a statistic of the training data
  without noise (the loss, a count of examples with a non-finite loss or gradient): that
  made whether any model was released a function of one record.
* `RunInterrupted`: SIGTERM or SIGINT (`dpjax.trainer.commands.interrupts`), public.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class TrainingDiverged(RuntimeError):
  """Non-finite (or overflowing) parameters: the run stops, the last good checkpoint is kept."""


class RunInterrupted(Exception):
  """SIGTERM / SIGINT: the run stops; `exit_code` = 128 + signal. `abandoned`: a compilation
  still runs on a daemon thread (end the process with os._exit, not under XLA's feet)."""

  def __init__(self, message: str, exit_code: int, abandoned: bool = False):
    super().__init__(message)
    self.exit_code, self.abandoned = exit_code, abandoned


@jax.jit
def parameters_diverged(params) -> jax.Array:
  """Whether a parameter is not finite, or ‖θ‖² overflows float32 (‖θ‖ > 1.8e19, where any
  product with the parameters overflows): a function of the released parameters alone."""
  leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(params)]
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
  return ~(finite & jnp.isfinite(sum(jnp.sum(jnp.square(x)) for x in leaves)))
