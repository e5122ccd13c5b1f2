"""The names a user chooses a sampler and an accountant by, without their code.

A command's flags list these choices, so `--help` and a bad flag answer without
importing numpy, dp_accounting or jax. `samplers.SAMPLER_NAMES` (its registry's
keys) must equal `SAMPLER_NAMES` (tests/e2e/test_cli_start.py checks it);
`accounting.accountant` validates against `ACCOUNTANTS`.
"""

SAMPLER_NAMES = (
  'poisson',
  'cyclic_poisson',
  'balls_and_bins',
  'shuffle',
  'deterministic',
  'fixed_size',
  'fixed_size_with_replacement',
)
ACCOUNTANTS = ('auto', 'pld', 'rdp', 'monte_carlo')
NOISES = ('gaussian', 'bandmf', 'blt')  # The noise mechanisms (`accounting.options.check_noise`).
