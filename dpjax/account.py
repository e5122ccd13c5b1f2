"""ε of a DP-SGD run, from flags or from a training config.

  python -m dpjax.account --sampler poisson --num-examples 60000 --batch-size 256 \\
      --epochs 10 --noise-multiplier 1.0 --delta 1e-5
  python -m dpjax.account --sampler fixed_size --num-examples 10000 --batch-size 250 \\
      --epochs 1 --target-epsilon 2.0 --delta 1e-5 --json
  python -m dpjax.account --sampler balls_and_bins --num-examples 6000 --batch-size 600 \\
      --epochs 1 --noise-multiplier 1.5 --delta 1e-5 --json
  python -m dpjax.account --sampler deterministic --num-examples 1000 --batch-size 100 \\
      --steps 40 --noise blt --num-buffers 3 --noise-multiplier 2.0 --delta 1e-5
  python -m dpjax.account --config configs/digits_mlp.py --json
  python -m dpjax.account --config configs/digits_mlp.py --config.sampler.batch_size=512 --json
  python -m dpjax.account --workdir <workdir>   # the ε of a run's newest checkpoint
  python -m dpjax.account --sampler balls_and_bins --num-examples 500 --batch-size 5 \\
      --epochs 1 --noise-multiplier 0.7 --delta 1e-3 --accountant monte_carlo \\
      --monte-carlo-samples 20000 --workers 2

Each example runs in seconds (tests/e2e/test_cli_examples.py runs them all);
larger runs, e.g. N = 10^6 with Monte Carlo, are in README.md.

Conventions (docs/accounting.md): q = b/N for Poisson; T = ceil(N/b) steps per
epoch (balls-and-bins bins; shuffle and deterministic batches); --accountant
defaults to the tightest provable one for the sampler; for fixed_size, rdp
means the FS-RDP bound of Birrell et al. Without --max-batch-size the batch
is never truncated (and none is accounted); with it, the truncation is
accounted. With --config everything comes from the training config (the cap
B as training resolves it, and the float rounding η of the noised sum that
training pays for on this machine's backend, dpjax/privacy/rounding.py);
--config.<field>=value overrides a field as in `python -m dpjax.train`, and
explicit flags override config fields too. Without --config the mechanism is
the idealised one (sensitivity C). --workdir reads the run's own numbers and
takes no other flag but --json.
Flags are absl flags: --name=value or --name value; --json / --nojson. --workers
sets the processes drawing the Monte-Carlo samples (privacy.monte_carlo_workers
of the config, else the available cores, as many as the samples pay to start); the
estimate does not depend on it.

Correlated noise (--noise bandmf / blt): with cyclic_poisson and --num-groups >= --num-bands
BandMF is amplified (⌈T/k⌉ Poisson-subsampled Gaussians); otherwise (BLT, deterministic,
shuffle, or more bands than groups) the strategy is optimised for --steps
(`correlated.strategy.make`, single participation, unit max column norm) and the run is one
Gaussian of its sensitivity over the sampler's participation patterns; the details show the
sensitivity and the strategy's expected error relative to DP-SGD's.

Balls-and-bins: the attached ε is the provable random-allocation PLD bound
(built once per (σ, T, grid) within --random-allocation-timeout seconds, then
cached in ~/.cache/dpjax or $DPJAX_CACHE_DIR), else the deterministic bound,
labelled as a fallback. The Monte-Carlo estimate (high-probability, not a
proof) is opt-in with --monte-carlo.

--json prints one JSON object: epsilon, delta, bound (upper |
high_probability_upper | lower), accountant, sampler, noise_multiplier,
steps, steps_per_epoch, epsilon_lower, confidence, num_samples, details.
"""

from __future__ import annotations

if __name__ == '__main__':  # Ctrl-C or SIGTERM from here on, imports included: one line, exit.
  from dpjax.trainer.commands import interrupts  # pylint: disable=g-import-not-at-top

  interrupts.exit_on_signals('python -m dpjax.account')

import logging  # pylint: disable=g-import-not-at-top,wrong-import-position
import math
import os
import sys
import types
from typing import TYPE_CHECKING

from ml_collections import config_flags

from dpjax import account_flags
from dpjax.trainer.commands import cli

# The accountants (numpy, dp_accounting) are imported by the answers that need them, so that
# --help and a bad flag answer at once (tests/e2e/test_cli_start.py).
if TYPE_CHECKING:
  from dpjax.privacy.accounting import accountant as accountant_lib


# The accountant's arguments that fix an oversized privacy-loss grid, as flags.
FLAG_NAMES = {
  'noise_multiplier': '--noise-multiplier',
  'group_size': '--group-size',
  'sampler': '--sampler',
}
PROG = 'python -m dpjax.account'


def parse_args(argv: list[str]) -> types.SimpleNamespace:
  """argv (without the program name) -> the flag values as attributes (dashes -> underscores).

  `dpjax.trainer.commands.cli.parse_command` conventions: --help exits 0, a bad flag, config
  file or `--config.<field>` is one line and exit 2.
  """
  argv = cli.resolve_config_argv(argv)  # A packaged config's name as its file.
  fv = account_flags.flag_values([PROG, *argv])
  cli.parse_command(PROG, __doc__, fv, argv)
  for a, b in account_flags.EXCLUSIVE:
    if fv[a].present and fv[b].present:
      cli.fail(PROG, f'--{a} and --{b}: give one of them, not both.')
  ignored = [f'--{name}' for name in fv if name not in ('workdir', 'json') and fv[name].present]
  if fv['workdir'].present and ignored:  # The checkpoint's own numbers would silently win.
    cli.fail(
      PROG,
      f"--workdir reports the ε that the run's checkpoints carry, so "
      f'{", ".join(ignored)} would be ignored: give --workdir alone (with --json at most), '
      'or leave it out to compute ε from the flags or the config.',
    )
  args = types.SimpleNamespace(
    **{name.replace('-', '_'): fv[name].value for name in [f[1] for f in account_flags.FLAGS]}
  )
  args.config = fv['config'].value if fv['config'].present else None
  args.config_file = config_flags.get_config_filename(fv['config']) if args.config else None
  return args


def _check_flag_ranges(args) -> None:
  """σ, the target ε and δ, refused in the flags' names (the core's checks name its arguments,
  the config's its fields): `--delta must be a finite number > 0 and < 1, got 2.0.`"""
  from dpjax.privacy import checks  # pylint: disable=g-import-not-at-top

  if args.noise_multiplier is not None:
    checks.check_noise_multiplier(args.noise_multiplier, '--noise-multiplier')
  if args.target_epsilon is not None:
    checks.check_number('--target-epsilon', args.target_epsilon, low=0.0)
  if args.delta is not None:
    checks.check_delta(args.delta, '--delta')


def _monte_carlo_options(args) -> dict:
  """Accountant options of the Monte-Carlo estimate; --workers only if given (else config / 1)."""
  options = dict(
    monte_carlo_samples=args.monte_carlo_samples,
    beta=args.beta,
    monte_carlo_estimate=args.monte_carlo,
  )
  if args.monte_carlo_samples is not None and args.monte_carlo_samples < 1:
    raise ValueError(
      f'--monte-carlo-samples must be an integer >= 1, got {args.monte_carlo_samples}.'
    )
  if args.random_allocation_timeout is not None:
    if not args.random_allocation_timeout >= 0:
      raise ValueError(
        f'--random-allocation-timeout must be seconds >= 0 (0: no limit), got '
        f'{args.random_allocation_timeout}.'
      )
    options['random_allocation_timeout'] = args.random_allocation_timeout or None
  if args.workers is not None:
    if args.workers < 1:
      raise ValueError(f'--workers must be an integer >= 1, got {args.workers}.')
    options['monte_carlo_workers'] = args.workers
  return options


def _from_config(args, monte_carlo_options) -> tuple[accountant_lib.Accountant, dict]:
  config = args.config  # Loaded by config_flags, --config.<field> overrides applied.
  cli.set_fields(
    config,
    {
      'sampler.name': args.sampler,
      'sampler.batch_size': args.batch_size,
      'sampler.max_batch_size': args.max_batch_size,
      'privacy.delta': args.delta,
      'privacy.allow_large_delta': args.allow_large_delta or None,
      'privacy.accountant': args.accountant,
      'privacy.group_size': args.group_size,
    },
  )
  # Unset fields are 0 (the config convention; None is accepted too).
  if args.steps is not None:
    config.num_steps, config.num_epochs = args.steps, 0
  if args.epochs is not None:
    config.num_steps, config.num_epochs = 0, args.epochs
  if args.noise_multiplier is not None:
    config.privacy.noise_multiplier, config.privacy.target_epsilon = args.noise_multiplier, 0.0
  if args.target_epsilon is not None:
    config.privacy.noise_multiplier, config.privacy.target_epsilon = None, args.target_epsilon
  from dpjax.trainer.planning import plan as plan_lib  # pylint: disable=g-import-not-at-top

  num_examples = args.num_examples
  if num_examples is None:
    # N as training counts it: the data's rows plus the audit canaries' (one code path).
    num_examples = len(plan_lib.make_training_sources(config)[0])
  acct = plan_lib.make_accountant(config, num_examples, **monte_carlo_options)
  extra = {'config': args.config_file}
  if not config.privacy.get('noise_multiplier') and config.privacy.get('target_epsilon'):
    extra['calibrated_for_target_epsilon'] = config.privacy.target_epsilon
  if config.sampler.max_batch_size == 0:
    extra['max_batch_size_source'] = 'auto (batching.resolve_max_batch_size)'
  return acct, extra


def _from_flags(args, monte_carlo_options) -> tuple[accountant_lib.Accountant, dict]:
  missing = [
    flag
    for flag, value in (
      ('--sampler', args.sampler),
      ('--num-examples', args.num_examples),
      ('--batch-size', args.batch_size),
      ('--delta', args.delta),
    )
    if value is None
  ]
  if args.steps is None and args.epochs is None:
    missing.append('--steps or --epochs')
  if args.noise_multiplier is None and args.target_epsilon is None:
    missing.append('--noise-multiplier or --target-epsilon')
  if missing:
    raise ValueError(f'missing {", ".join(missing)} (or give --config).')
  # pylint: disable=import-outside-toplevel
  from dpjax.privacy import checks
  from dpjax.privacy import samplers as samplers_lib
  from dpjax.privacy.accounting import accountant as accountant_lib
  from dpjax.privacy.accounting import calibration

  # pylint: enable=import-outside-toplevel
  for flag, value in (
    ('--num-examples', args.num_examples),
    ('--batch-size', args.batch_size),
    ('--steps', args.steps),
    ('--epochs', args.epochs),
  ):
    if value is not None and value < 1:
      raise ValueError(f'{flag} must be an integer >= 1, got {value}.')
  checks.check_delta(
    args.delta,
    '--delta',
    num_examples=args.num_examples,
    allow_large_delta=args.allow_large_delta,
    flag='--allow-large-delta',
    warn=False,  # The accountant warns.
  )
  fields = {}
  if args.num_groups is not None:
    if args.sampler != 'cyclic_poisson':
      raise ValueError(f'--num-groups is a cyclic_poisson flag, not one of {args.sampler}.')
    fields['num_groups'] = args.num_groups
  sampler = samplers_lib.sampler_class(args.sampler)(
    num_examples=args.num_examples, batch_size=args.batch_size, **fields
  )
  steps = args.steps if args.steps is not None else args.epochs * sampler.steps_per_epoch
  noise = args.noise or 'gaussian'
  options = dict(
    accountant=args.accountant or 'auto',
    max_batch_size=args.max_batch_size,
    group_size=1 if args.group_size is None else args.group_size,
    allow_large_delta=args.allow_large_delta,
    noise=noise,
    num_bands=1 if args.num_bands is None else args.num_bands,
    strategy=_strategy(args, sampler, noise, steps),
    **monte_carlo_options,
  )
  extra = {}
  sigma = args.noise_multiplier
  if sigma is None:
    # calibrate_noise_multiplier validates every option before its (possibly long) search.
    sigma = calibration.calibrate_noise_multiplier(
      sampler, args.target_epsilon, args.delta, steps, **options
    )
    extra['calibrated_for_target_epsilon'] = args.target_epsilon
  return accountant_lib.Accountant(sampler, sigma, args.delta, num_steps=steps, **options), extra


def _strategy(args, sampler, noise: str, steps: int):
  """`matrix_mechanism.strategy_for` the flags (the strategy the accountant reads, or None)."""
  from dpjax.privacy.accounting import matrix_mechanism  # pylint: disable=g-import-not-at-top

  if args.num_buffers is not None and noise != 'blt':
    raise ValueError(f'--num-buffers is a --noise blt flag, not one of --noise {noise}.')
  bands = 1 if args.num_bands is None else args.num_bands
  return matrix_mechanism.strategy_for(sampler, noise, steps, bands, args.num_buffers)


def _fmt(value) -> str:
  if value is None:
    return '-'
  if isinstance(value, float):
    return 'inf' if math.isinf(value) else f'{value:.6g}'
  return str(value)


def format_table(report: accountant_lib.PrivacyReport) -> str:
  """A readable summary; every number carries its label."""
  kind = {
    'upper': 'upper bound (provable)',
    'high_probability_upper': f'upper bound with probability >= {report.confidence} '
    f'(Monte Carlo, {report.num_samples} samples/direction)',
    'lower': 'lower bound',
  }[report.bound]
  d = report.details
  rows = [
    ('sampler', report.sampler),
    ('examples N, batch b', f'{d.get("num_examples")}, {d.get("batch_size")}'),
    (
      'steps',
      f'{report.steps} ({report.steps_per_epoch} per epoch, '
      f'{report.steps / report.steps_per_epoch:.4g} epochs)',
    ),
    ('noise multiplier σ', _fmt(report.noise_multiplier)),
    ('δ', _fmt(report.delta)),
    ('ε', f'{_fmt(report.epsilon)}   [{kind}]'),
    ('accountant', f'{report.accountant}: {d.get("method")}'),
    ('ε lower bound', _fmt(report.epsilon_lower)),
    ('max batch size B', d.get('truncation') or _fmt(d.get('max_batch_size'))),
  ]
  skip = {'method', 'num_examples', 'batch_size', 'max_batch_size', 'truncation'}
  for key, value in d.items():
    if key not in skip:
      rows.append((key.replace('_', ' '), _fmt(value)))
  if 'as_if_poisson_not_a_guarantee' in d:
    rows.append(
      ('NOTE', 'the "as if poisson" ε is NOT a guarantee: this run did not use Poisson sampling')
    )
  width = max(len(k) for k, _ in rows)
  return '\n'.join(f'{k:<{width}}  {v}' for k, v in rows)


def _from_workdir(workdir: str) -> tuple[accountant_lib.PrivacyReport, dict]:
  """The newest checkpoint's report, and the planned final ε if the run is not finished."""
  from dpjax.trainer.workdir import checkpoints  # pylint: disable=g-import-not-at-top
  from dpjax.privacy.accounting.report import PrivacyReport  # pylint: disable=g-import-not-at-top

  if not os.path.isdir(workdir):
    raise ValueError(f'--workdir {workdir!r}: not a directory.')
  rows = [row for row in checkpoints.read_metadata(workdir) if 'error' not in row]
  if not rows:
    raise ValueError(f'--workdir {workdir!r}: no readable checkpoint (nothing trained yet).')
  meta = rows[-1]
  if meta['privacy'].get('epsilon') is None:
    raise ValueError(f'--workdir {workdir!r}: a non-private run (ε = ∞).')
  report = PrivacyReport.from_dict(meta['privacy'])
  extra = {'workdir': os.path.abspath(workdir), 'checkpoint_step': meta['step']}
  planned = meta['config'].get('num_steps')
  if planned and planned > meta['step']:
    from dpjax.trainer.planning import plan as plan_lib  # pylint: disable=g-import-not-at-top
    from dpjax.configs import from_workdir  # pylint: disable=g-import-not-at-top
    from dpjax.privacy import precision  # pylint: disable=g-import-not-at-top

    config = from_workdir.get_config(workdir)
    if meta.get('noise_multiplier') is not None:  # The σ that ran, never calibrated again.
      config.privacy.noise_multiplier = meta['noise_multiplier']
    fmt = meta['fingerprint'].get('privacy.matmul_format')  # η as the run pays it, whatever
    options = {'platform': precision.platform_of_format(fmt)} if fmt else None  # runs this.
    extra['planned_steps'] = planned
    extra['planned_final_epsilon'] = plan_lib.make_plan(
      config, meta['num_examples'], accountant_options=options
    ).privacy.accountant.epsilon(planned)
  return report, extra


def main(argv=None) -> int:
  # dp_accounting's RDP logs a warning per fractional order it skips; the numbers are unaffected.
  logging.getLogger('absl').setLevel(logging.ERROR)
  args = parse_args(list(sys.argv[1:] if argv is None else argv))
  if args.workdir is not None:
    try:
      report, extra = _from_workdir(args.workdir)
    except ValueError as e:
      cli.fail(PROG, e)
    report.details.update(extra)
    print(report.to_json() if args.json else format_table(report))
    return 0
  try:
    _check_flag_ranges(args)  # In the names typed, before any loading or computing.
    options = _monte_carlo_options(args)  # validated before any loading or computing
    acct, extra = (
      _from_config(args, options) if args.config is not None else _from_flags(args, options)
    )
    # pylint: disable=import-outside-toplevel
    from dpjax.privacy.accounting import step_pld
    from dpjax.trainer.configuration import accounting_refusals

    # pylint: enable=import-outside-toplevel
    try:
      report = acct.final_report()
    except step_pld.GridTooLargeError as e:  # Its fixes as this command's flags.
      raise ValueError(accounting_refusals.grid_too_large(e, acct, FLAG_NAMES)) from None
  except ValueError as e:
    cli.fail(PROG, e)
  report.details.update(extra)
  print(report.to_json() if args.json else format_table(report))
  return 0


if __name__ == '__main__':
  sys.exit(main())
