"""What a run shows while it trains: a progress bar on a terminal, else one line per log.

The bar's postfix and the plain line carry the window's training loss and accuracy, the
latest evaluation and ε with its kind of bound; the line adds the examples per second and
an ETA that counts the ε each coming checkpoint waits for. Process 0 only.
"""

from __future__ import annotations

import os
import sys

import tqdm

SHOWN = ('nonprivate_train_loss', 'nonprivate_train_accuracy', 'eval_accuracy', 'epsilon')


class Progress:
  """A tqdm bar over the run's steps (`DPJAX_PROGRESS=1` forces it without a terminal)."""

  def __init__(self, num_steps: int, start: int, primary: bool):
    self.num_steps, self.primary = num_steps, primary
    self.bar = tqdm.tqdm(
      total=num_steps,
      initial=start,
      desc='train',
      dynamic_ncols=True,
      disable=not primary or (not sys.stderr.isatty() and os.environ.get('DPJAX_PROGRESS') != '1'),
    )

  def update(self, steps: int) -> None:
    self.bar.update(steps)

  def show(self, done: int, row: dict, checkpoint_every: int, query_seconds: float) -> None:
    """The bar's postfix; without a terminal, one plain progress line (`query_seconds`: the
    mean time of an ε query, which each coming checkpoint and the last step wait for)."""
    shown = {k: f'{v:.4g}' for k, v in row.items() if k in SHOWN}
    if 'epsilon' in shown:  # The kind of bound beside the number.
      shown['epsilon'] += f' ({row["epsilon_bound"]})'
    self.bar.set_postfix(shown)
    if not (self.bar.disable and self.primary):
      return
    rate, left = row['nonprivate_steps_per_second'], self.num_steps - done
    saves_left = left // checkpoint_every + 1
    eta = left / rate + saves_left * query_seconds if rate else float('nan')
    speed = f'{row["nonprivate_examples_per_second"]:.0f} ex/s' if rate else 'compiling'
    print(
      f'step {done}/{self.num_steps}, {speed}, ETA {eta:.0f} s, '
      + ' '.join(f'{k}={v}' for k, v in shown.items()),
      flush=True,
    )

  def close(self) -> None:
    self.bar.close()
