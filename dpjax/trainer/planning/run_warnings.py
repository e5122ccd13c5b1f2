"""Warnings of a run that is allowed but probably not what was meant: one line each, once.

* the final ε is above LARGE_EPSILON (a weak guarantee; at start, before any compute);
* every example of a log window was clipped, or none was, with C more than FAR times below
  or above the mean per-example gradient norm (C = 1e-30 and C = 1e30 both train to chance
  silently; clipping every example at a C near the norms is an ordinary DP-SGD recipe);
* the training loss grew LOSS_GROWTH-fold from the first window (a diverging run that is
  still finite).

The clip fraction and the loss are statistics of the private data without noise: the
warnings say so, and they go to the console (the private workdir's log), never to an export.
"""

from __future__ import annotations

LARGE_EPSILON = 10.0
LOSS_GROWTH = 100.0
FAR = 100.0


class RunWarnings:
  """Remembers which warnings were given, so each is printed once."""

  def __init__(self):
    self._given: set[str] = set()
    self._first_loss: float | None = None

  def _once(self, kind: str, line: str) -> list[str]:
    if kind in self._given:
      return []
    self._given.add(kind)
    return [line]

  def epsilon(self, final_epsilon: float, target: float) -> list[str]:
    if final_epsilon <= LARGE_EPSILON:
      return []
    budget = (
      f'privacy.target_epsilon = {target:g}' if target else 'no privacy.target_epsilon is set'
    )
    return self._once(
      'epsilon',
      f'the final ε = {final_epsilon:.4g} is above {LARGE_EPSILON:g} '
      f'({budget}): a weak guarantee. Raise privacy.noise_multiplier, or set a '
      'target ε to calibrate σ to.',
    )

  def check(self, row: dict, first_step: int, last_step: int, clip_norm: float | None) -> list[str]:
    """Warnings from one log row's statistics (steps first_step..last_step); C None if not
    private."""
    lines = []
    fraction = row.get('nonprivate_clip_fraction')
    norm = row.get('nonprivate_mean_grad_norm')
    where = f'steps {first_step}-{last_step}'
    if clip_norm is not None and fraction is not None and norm:
      if fraction >= 1.0 and clip_norm * FAR < norm:
        lines += self._once(
          'clip_all',
          f'every example was clipped in {where}, at C = '
          f'{clip_norm:g} while their mean gradient norm is {norm:.3g} '
          '(nonprivate: not covered by ε): privacy.clip_norm is far below '
          'the gradient norms.',
        )
      elif fraction <= 0.0 and clip_norm > FAR * norm:
        lines += self._once(
          'clip_none',
          f'no example was clipped in {where}, at C = '
          f'{clip_norm:g} while their mean gradient norm is {norm:.3g} '
          '(nonprivate: not covered by ε): privacy.clip_norm is far above '
          'the gradient norms, so the noise σ·C swamps them.',
        )
    loss = row.get('nonprivate_train_loss')
    if loss is not None:
      if self._first_loss is None:
        self._first_loss = max(abs(loss), 1e-12)
      elif abs(loss) > LOSS_GROWTH * self._first_loss:
        lines += self._once(
          'loss',
          f'the training loss grew to {loss:.3g} by step {last_step}, '
          f"{LOSS_GROWTH:g}x the first window's (nonprivate: not covered by "
          'ε): the run may be diverging; try a smaller '
          'optimizer.learning_rate.',
        )
    return lines
