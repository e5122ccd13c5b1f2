"""The accountant's refusal of an oversized privacy-loss grid, told in the names a user sets.

`dpjax.privacy.accounting.Accountant` refuses a per-step privacy-loss distribution that would
need more than `max_grid_points` points (minutes and GBs of memory) and lists what would shrink
it, as its own arguments: σ, the group size, the sampler, and two settings of the grid
(`value_discretization_interval`, `max_grid_points`) that only a caller of the library can set.
A trainer or CLI user sets config fields or flags instead: `grid_too_large` keeps the
accountant's diagnosis and names the fixes as `names` spells them (`CONFIG_NAMES` or a CLI's
flags), leaving out the grid settings.
"""

from __future__ import annotations

from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import step_pld

# The accountant's arguments that fix an oversized grid, as config fields.
CONFIG_NAMES = {
  'noise_multiplier': 'privacy.noise_multiplier',
  'group_size': 'privacy.group_size',
  'sampler': 'sampler.name',
}


def grid_too_large(
  error: step_pld.GridTooLargeError, accountant: accountant_lib.Accountant, names: dict[str, str]
) -> str:
  """`error`'s diagnosis, then its fixes as `names` spells the accountant's arguments
  ('noise_multiplier', 'group_size', 'sampler'). A refusal with no list of fixes (too many
  steps to compose) is returned as it is."""
  diagnosis, listed, _ = str(error).partition(' To fix:')
  if not listed:
    return str(error)
  fixes = [f'raise σ ({names["noise_multiplier"]} = {accountant.noise_multiplier:.4g})']
  if accountant.group_size > 1:
    fixes.insert(0, f'lower {names["group_size"]} = {accountant.group_size}')
  if accountant.sampler.grid_too_large_hint:
    fixes.append(f'{names["sampler"]}: {accountant.sampler.grid_too_large_hint}')
  listed = f'{"; ".join(fixes[:-1])}; or {fixes[-1]}' if len(fixes) > 1 else fixes[0]
  return f'{diagnosis} To fix: {listed}.'
