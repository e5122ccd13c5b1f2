"""Batch size planner: the calibrated σ and the noise on the averaged gradient over b.

  python -m dpjax.planner --num_examples 6000 --epsilon 3 --delta 1e-5 --epochs 2 \\
      --batch_sizes 128,512
  python -m dpjax.planner --num_examples 6000 --epsilon 3 --delta 1e-5 --epochs 2 \\
      --batch_sizes 1024 --json plan.json
  python -m dpjax.planner --config configs/digits_mlp.py --batch_sizes 128,256  # N, ε, δ from it
  python -m dpjax.planner --batch_sizes 256 --config configs/digits_mlp.py \\
      --config.privacy.target_epsilon=2

Each example runs in seconds (tests/e2e/test_cli_examples.py runs them all); the
default grid at N = 60000 takes minutes (see Cost below and README.md).

At a fixed privacy budget (ε, δ) and a fixed number of epochs E, each batch
size b gets the σ that training would use: the config of the run with
`sampler.batch_size = b`, `num_epochs = E`, `privacy.target_epsilon = ε` and
σ unset, given to `plan.make_accountant` exactly as `dpjax.train`
does (same sampler, accountant and automatic cap B). Steps per epoch are
ceil(N/b). Columns:

  σ·C/b       std of the noise on the averaged gradient (per coordinate);
  σ/(q·√S)    the noise of the whole run, q = b/N, S = E·ceil(N/b) steps (the
              "total amount of noise" of Sander, Stock, Sablayrolles, "TAN
              without a burn", ICML 2023): where subsampling amplifies
              linearly (Rényi DP ≈ c·S·q²·α/σ², Abadi et al. 2016), ε depends
              on σ, q and S only through it, so it is flat in b.
  iterate err²  the mean squared error per coordinate of the released SGD iterates (prefix
              sums of the S noisy means): (σ·C/b)²·(S + 1)/2 for DP-SGD, × the strategy's
              expected error with correlated noise (--config.privacy.noise=bandmf | blt): run
              the planner once per mechanism to compare them at the same ε.

Cost: one calibration per b, run one after the other. Poisson at N = 60000,
10 epochs: 0.5–53 s of CPU per b, 5 min for 12 b × 3 ε (experiments/05).
Balls-and-bins with ceil(N/b) <= 100 computes random-allocation PLDs in a
subprocess: minutes per b. Shuffle and deterministic: under a second.

docs/accounting.md §8 (seed 003, "Limits of privacy amplification by
subsampling"): amplification is nearly free only when the per-step privacy
loss is tiny, ε ≲ q. Small batches (small q, small σ) are outside that
regime and pay more noise per unit of signal; the table shows where.
"""

from __future__ import annotations

if __name__ == '__main__':  # Ctrl-C or SIGTERM from here on, imports included: one line, exit.
  from dpjax.trainer.commands import interrupts  # pylint: disable=g-import-not-at-top

  interrupts.exit_on_signals('python -m dpjax.planner')

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import logging
import os
import sys
import types
from typing import Sequence

from absl import flags
import ml_collections
from ml_collections import config_flags

from dpjax.trainer.commands import cli
from dpjax.privacy import names
from dpjax.trainer.planning import batch_size_plan
from dpjax.trainer.workdir import write_errors
from dpjax.trainer.workdir.atomic_write import write_text_atomically


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


# (definer, name, help[, choices]); each name also answers with dashes (--num-examples).
_FLAGS = (
  ('integer', 'num_examples', 'N, training examples'),
  ('float', 'epsilon', 'ε, the budget at the end of the run'),
  ('float', 'delta', 'δ'),
  ('integer', 'epochs', 'E, epochs of ceil(N/b) steps'),
  ('string', 'batch_sizes', 'comma-separated b grid (default: powers of two from 32, then N)'),
  ('enum', 'sampler', 'default poisson', names.SAMPLER_NAMES),
  ('enum', 'accountant', 'default auto', names.ACCOUNTANTS),
  ('float', 'clip_norm', 'C (default 1)'),
  (
    'integer',
    'physical_batch_size',
    f'P, sets the automatic cap B (default {batch_size_plan.DEFAULT_PHYSICAL_BATCH_SIZE})',
  ),
  ('string', 'json', 'write the plan as JSON to this file'),
)
PROG = 'python -m dpjax.planner'


_CONFIG_HELP = (
  'training config (path[:arg]): N (from its data unless --num_examples), sampler, '
  'ε, δ, epochs, C, P, accountant; --config.<field>=value overrides a field, and '
  'the flags below override it too'
)


def _flag_values(argv: list[str]) -> flags.FlagValues:
  """This command's absl flags (fresh per call), each also spelled with dashes."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file(
    'config', None, _CONFIG_HELP, flag_values=fv, lock_config=False, sys_argv=argv
  )
  for definer, name, help_text, *choices in _FLAGS:
    getattr(flags, f'DEFINE_{definer}')(name, None, *choices, help_text, flag_values=fv)
    if '_' in name:
      flags.DEFINE_alias(name.replace('_', '-'), name, flag_values=fv)
  return fv


def parse_args(argv: list[str]) -> types.SimpleNamespace:
  """argv (without the program name) -> the flag values (`dpjax.trainer.commands.cli.parse_command` conventions)."""
  argv = cli.resolve_config_argv(argv)  # A packaged config's name as its file.
  fv = _flag_values([PROG, *argv])
  cli.parse_command(PROG, __doc__, fv, argv)
  return types.SimpleNamespace(
    config=fv.config if fv['config'].present else None,
    **{name: fv[name].value for _, name, *_ in _FLAGS},
  )


def _parse_sizes(text: str) -> list[int]:
  try:
    return [int(s) for s in text.split(',') if s.strip()]
  except ValueError:
    raise ValueError(f'--batch_sizes must be comma-separated integers, got {text!r}.') from None


def _resolve(args) -> tuple[ml_collections.ConfigDict, int, float, float, int]:
  """The base config and (N, ε, δ, E) from --config and the flags (flags win)."""
  if args.config is not None:
    config = args.config  # Loaded by config_flags, --config.<field> overrides applied.
    eps = args.epsilon if args.epsilon is not None else config.privacy.get('target_epsilon')
    delta = args.delta if args.delta is not None else config.privacy.get('delta')
    epochs = args.epochs if args.epochs is not None else config.get('num_epochs')
    if args.epsilon is None and not eps:
      raise ValueError('--epsilon must be given: the config has no privacy.target_epsilon > 0.')
    if args.epochs is None and not epochs:
      raise ValueError(
        '--epochs must be given: the config sets num_steps, not num_epochs, and '
        'the planner compares batch sizes at a fixed number of epochs.'
      )
  else:
    config = batch_size_plan.base_config()
    eps, delta, epochs = args.epsilon, args.delta, args.epochs
    missing = [
      f
      for f, v in (
        ('--num_examples', args.num_examples),
        ('--epsilon', eps),
        ('--delta', delta),
        ('--epochs', epochs),
      )
      if v is None
    ]
    if missing:
      raise ValueError(f'missing {", ".join(missing)} (or give --config).')
  cli.set_fields(
    config,
    {
      'sampler.name': args.sampler,
      'sampler.physical_batch_size': args.physical_batch_size,
      'privacy.accountant': args.accountant,
      'privacy.clip_norm': args.clip_norm,
    },
  )
  n = args.num_examples
  if n is None:
    from dpjax.trainer.planning import plan as plan_lib  # pylint: disable=g-import-not-at-top

    n = len(plan_lib.make_training_sources(config)[0])  # With audit canaries, as training.
  return config, n, eps, delta, epochs


def main(argv: Sequence[str] | None = None) -> int:
  # dp_accounting's RDP logs a warning per fractional order it skips; the numbers are unaffected.
  logging.getLogger('absl').setLevel(logging.ERROR)
  args = parse_args(list(sys.argv[1:] if argv is None else argv))
  try:
    config, n, eps, delta, epochs = _resolve(args)
    sizes = None if args.batch_sizes is None else _parse_sizes(args.batch_sizes)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
      raise ValueError(f'--json {args.json!r}: its directory does not exist.')
    header_printed = []

    def progress(row):
      if not header_printed:
        print('calibrating σ for each b (seconds to minutes each) ...', file=sys.stderr)
        header_printed.append(True)
      print(
        f'  b = {row.batch_size}: σ = {row.noise_multiplier:.4f} ({row.seconds:.1f} s wall, '
        f'{row.cpu_seconds:.1f} s CPU)',
        file=sys.stderr,
        flush=True,
      )

    plan = batch_size_plan.plan_batch_sizes(
      n, eps, delta, epochs, sizes, config=config, progress=progress
    )
  except ValueError as e:
    cli.fail(PROG, e)
  print(batch_size_plan.format_table(plan))
  if args.json:  # Whole or not at all, even if interrupted; a failed write in one line.
    try:
      write_text_atomically(
        args.json,
        json.dumps(plan.to_dict(), indent=2),
        what='--json',
        then='The table above is complete; free space, or choose '
        'another --json path, and rerun to save it.',
      )
    except write_errors.WriteError as e:
      cli.fail(PROG, e, code=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
