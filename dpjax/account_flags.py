"""The flags of `python -m dpjax.account`: their declarations, as absl flags.

`flag_values(argv)` defines them fresh per call, beside `--config` (ml_collections'
config_flags, as `python -m dpjax.train`); `EXCLUSIVE` names the pairs of which one may be
given. Imports no accountant (numpy, dp_accounting), so that --help answers at once
(tests/e2e/test_cli_start.py).
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from dpjax.privacy import names

# Flag names keep the dashes users type (absl accepts them); the value is read as
# args.<name with underscores>.
FLAGS = (
  # (definer, name, default, help[, extra])
  ('enum', 'sampler', None, 'the sampler', names.SAMPLER_NAMES),
  ('integer', 'num-examples', None, 'N, training examples'),
  ('integer', 'batch-size', None, 'b, (expected) logical batch size'),
  ('integer', 'steps', None, 'T, total steps (or --epochs)'),
  ('integer', 'epochs', None, 'E; steps = E * ceil(N/b) (or --steps)'),
  ('float', 'noise-multiplier', None, 'σ (or --target-epsilon)'),
  ('float', 'target-epsilon', None, 'calibrate the smallest σ for this ε (or --noise-multiplier)'),
  ('float', 'delta', None, 'δ'),
  (
    'enum',
    'accountant',
    None,
    'default: auto (tightest provable for the sampler)',
    names.ACCOUNTANTS,
  ),
  ('integer', 'max-batch-size', None, 'B, cap on the logical batch; omitted = no truncation'),
  ('integer', 'group-size', None, 'k, group privacy (default 1)'),
  ('integer', 'num-groups', None, 'cyclic_poisson: k groups, step t from group t mod k'),
  (
    'enum',
    'noise',
    None,
    'the noise mechanism (default gaussian: DP-SGD; bandmf: banded matrix factorisation, '
    'amplified with cyclic_poisson and --num-groups >= --num-bands, else accounted by its '
    'sensitivity with deterministic, shuffle or cyclic_poisson; blt: buffered linear Toeplitz, '
    'by its sensitivity with those samplers); the strategy is optimised for --steps',
    names.NOISES,
  ),
  ('integer', 'num-bands', None, "bandmf: the strategy's bands (default 1)"),
  ('integer', 'num-buffers', None, "blt: the strategy's buffers (required with --noise blt)"),
  (
    'boolean',
    'monte-carlo',
    False,
    'balls-and-bins: also report the Monte-Carlo estimate (high-probability, not a proof) '
    'beside the provable ε; opt-in, as at delta = 1e-5 it takes minutes (the output says how '
    'many samples and about how long)',
  ),
  (
    'integer',
    'monte-carlo-samples',
    None,
    'Monte-Carlo samples per direction; default: chosen from delta and beta so that an '
    'estimate exists (10x the least such count)',
  ),
  ('float', 'beta', 1e-3, 'Monte-Carlo failure probability (confidence 1 - beta)'),
  (
    'integer',
    'workers',
    None,
    'processes drawing the Monte-Carlo samples (the estimate does not depend on it); '
    'default: privacy.monte_carlo_workers of --config, else the available cores that the '
    'samples pay to start',
  ),
  (
    'float',
    'random-allocation-timeout',
    None,
    'balls-and-bins: seconds allowed to build a new random-allocation PLD (default 300; then '
    'cached) before the deterministic fallback; 0 = no limit',
  ),
  (
    'boolean',
    'allow-large-delta',
    False,
    'accept --delta >= 1/N (refused by default: such a δ allows publishing a random record)',
  ),
  ('boolean', 'json', False, 'print one JSON object'),
  (
    'string',
    'workdir',
    None,
    "a run's workdir: report the ε its newest checkpoint carries "
    '(and, when it is not finished, the ε planned for its last step)',
  ),
)
EXCLUSIVE = (('steps', 'epochs'), ('noise-multiplier', 'target-epsilon'))


def flag_values(argv: list[str]) -> flags.FlagValues:
  """This command's flags (absl + ml_collections.config_flags, as `dpjax.train`), fresh per call."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file(
    'config',
    None,
    'training config file (path[:arg]); --config.<field>=value overrides a '
    'field, and the flags below override it too',
    flag_values=fv,
    lock_config=False,
    sys_argv=argv,
  )
  for definer, name, default, help_text, *extra in FLAGS:
    define = getattr(flags, f'DEFINE_{definer}')
    define(name, default, *extra, help_text, flag_values=fv) if extra else define(
      name, default, help_text, flag_values=fv
    )
  return fv
