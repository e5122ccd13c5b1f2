"""One validator per quantity that enters ε (issue 35, item 2): σ, C, b and δ are checked by
`dpjax.privacy.checks` alone, so every entry point refuses the same values with the same line.

On da06065 δ was validated in 5 functions with 3 different rules and messages, σ in 4 places
(`fixed_size_rdp` took σ = ∞ and NaN-free strings of types it did not expect, `white_box`
compared σ > 0 only), C in 2 (one allowing ∞ with a different message): the parametrized
refusals below fail there for the entry points whose message or rule differed.
"""

import ast
import math
import pathlib

import jax.numpy as jnp
import pytest

from dpjax.privacy import checks
from dpjax.privacy import clipping
from dpjax.privacy import noise
from dpjax.privacy import privacy_plan
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import balls_and_bins
from dpjax.privacy.accounting import fixed_size_rdp
from dpjax.privacy.accounting import max_test
from dpjax.privacy.accounting.monte_carlo import search
from dpjax.privacy.auditing import one_run
from dpjax.privacy.auditing import white_box

PRIVACY = pathlib.Path(checks.__file__).resolve().parent
SAMPLER = samplers.make('poisson', 1000, 50, seed=0)


def _plan(**kw):
  args = dict(
    sampler=SAMPLER,
    num_steps=10,
    clip_norm=1.0,
    noise_multiplier=1.0,
    delta=1e-5,
    physical_batch_size=25,
    max_batch_size=100,
  )
  args.update(kw)
  return privacy_plan.PrivacyPlan.create(**args)


SIGMA_ENTRIES = {
  'gaussian_privatizer': lambda s: noise.gaussian_privatizer(s, 1.0, 10.0, seed=0),
  'PrivacyPlan.create': lambda s: _plan(noise_multiplier=s),
  'Accountant': lambda s: accountant_lib.Accountant(
    SAMPLER, s, 1e-5, max_batch_size=100, num_steps=10
  ),
  'fixed_size_rdp_epsilon': lambda s: fixed_size_rdp.fixed_size_rdp_epsilon(0.1, s, 10, 1e-5),
  'balls_and_bins.deterministic_epsilon': lambda s: balls_and_bins.deterministic_epsilon(
    s, 1, 1e-5
  ),
  'white_box.effective_sigma': lambda s: white_box.effective_sigma(
    jnp.zeros(4), jnp.zeros(4), jnp.ones(4), jnp.ones(4, bool), clip_norm=1.0, noise_multiplier=s
  ),
}
DELTA_ENTRIES = {
  'PrivacyPlan.create': lambda d: _plan(delta=d),
  'Accountant': lambda d: accountant_lib.Accountant(
    SAMPLER, 1.0, d, max_batch_size=100, num_steps=10
  ),
  'fixed_size_rdp_epsilon': lambda d: fixed_size_rdp.fixed_size_rdp_epsilon(0.1, 1.0, 10, d),
  'balls_and_bins.deterministic_epsilon': lambda d: balls_and_bins.deterministic_epsilon(1.0, 1, d),
  'max_test.balls_and_bins_lower_bound_epsilon': lambda d: (
    max_test.balls_and_bins_lower_bound_epsilon(1.0, 10, d)
  ),
  'monte_carlo.balls_and_bins_epsilon': lambda d: search.balls_and_bins_epsilon(1.0, 10, d),
}


@pytest.mark.parametrize('entry', sorted(SIGMA_ENTRIES))
@pytest.mark.parametrize('sigma', [0.0, -1.0, math.inf, math.nan, True, '1.0'])
def test_every_entry_refuses_a_bad_sigma_with_the_one_line(entry, sigma):
  with pytest.raises(ValueError, match=r'^noise_multiplier must be a finite number > 0, got'):
    SIGMA_ENTRIES[entry](sigma)


@pytest.mark.parametrize('entry', sorted(DELTA_ENTRIES))
@pytest.mark.parametrize('delta', [0.0, 1.0, -1e-5, math.nan, True, '1e-5'])
def test_every_entry_refuses_a_bad_delta_with_the_one_line(entry, delta):
  with pytest.raises(ValueError, match=r'^delta must be a finite number > 0 and < 1, got'):
    DELTA_ENTRIES[entry](delta)


@pytest.mark.parametrize('clip_norm', [0.0, -1.0, math.inf, math.nan, None])
def test_what_is_noised_refuses_c_infinite_while_computing_norms_takes_it(clip_norm):
  """C = ∞ is refused wherever the sum is noised (σ·C = ∞: no guarantee) and accepted by the
  clipped sum alone (norms and gradients without clipping); the rest is refused everywhere."""
  loss_fn = lambda p, x: jnp.sum(p * x)
  for entry in (
    lambda c: noise.gaussian_privatizer(1.0, c, 10.0, seed=0),
    lambda c: _plan(clip_norm=c),
  ):
    with pytest.raises(ValueError, match=r'^clip_norm must be a finite number > 0, got'):
      entry(clip_norm)
  if clip_norm == math.inf:
    assert clipping.make_clipped_sum_fn('vmap', loss_fn, clip_norm) is not None
  else:
    with pytest.raises(ValueError, match=r'^clip_norm must be a number > 0 \(inf: no clipping\)'):
      clipping.make_clipped_sum_fn('vmap', loss_fn, clip_norm)


def test_delta_below_one_over_n_is_one_rule_named_by_its_caller():
  with pytest.raises(ValueError, match=r'^privacy.delta = 0.001 is >= 1/N .*privacy.flag'):
    checks.check_delta(1e-3, 'privacy.delta', num_examples=1000, flag='privacy.flag')
  assert checks.check_delta(1e-3, num_examples=1000, allow_large_delta=True, warn=False) == 1e-3
  with pytest.warns(checks.LargeDeltaWarning, match='exceeds 1/'):
    checks.check_delta(5e-4, num_examples=1000)
  assert one_run.p_value(10, 5, 5, 1.0, 0.0) > 0  # The audit takes δ = 0 (pure DP).


def _defined_functions(path: pathlib.Path) -> set[str]:
  return {
    node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)
  }


def test_no_module_of_the_core_defines_its_own_check_of_sigma_c_b_or_delta():
  """The validators exist once, in checks.py: a copy elsewhere could disagree again."""
  names = {
    'check_delta',
    '_check_delta',
    'check_noise_multiplier',
    'check_clip_norm',
    'validate_clip_norm',
    'check_expected_batch_size',
  }
  copies = sorted(
    f'{path.relative_to(PRIVACY)}: {name}'
    for path in PRIVACY.rglob('*.py')
    if path.name != 'checks.py'
    for name in _defined_functions(path) & names
  )
  assert copies == []
  texts = {path: path.read_text() for path in PRIVACY.rglob('*.py') if path.name != 'checks.py'}
  assert [str(p) for p, t in texts.items() if 'delta must be in' in t] == []
