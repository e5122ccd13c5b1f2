"""Settings that cannot change ε are a type (`Perf`) the privacy fingerprint never reads."""

import dataclasses
import inspect

import pytest

from dpjax.configs import digits_mlp
from dpjax.privacy import precision as precision_lib
from dpjax.privacy import rounding
from dpjax.trainer.planning import fingerprint
from dpjax.trainer.configuration import perf as perf_lib
from dpjax.trainer.planning import plan as plan_lib

N = 1000
# One other valid value of each Perf field (B stays a multiple of the new P).
OTHER = {
  'physical_batch_size': 16,
  'steps_per_call': 4,
  'num_devices': 1,
  'compilation_cache_dir': 'none',
  'clipping_forms': 'measured',
  'fsdp': 2,
  'tensor': 2,
  'tensor_parallel': True,
  'min_sharded_size': 4096,
}


def _config(**overrides):
  config = digits_mlp.get_config()
  config.privacy.noise_multiplier, config.privacy.target_epsilon = 1.0, 0.0
  config.num_steps, config.num_epochs = 50, 0
  config.sampler.batch_size, config.sampler.physical_batch_size = 64, 32
  for name, value in overrides.items():
    *parents, leaf = perf_lib.CONFIG_PATHS[name].split('.')
    node = config
    for part in parents:
      node = node[part]
    node[leaf] = value
  return config


def test_every_perf_field_has_another_value_here_and_a_declared_config_path():
  assert set(OTHER) == {f.name for f in dataclasses.fields(perf_lib.Perf)}
  assert set(perf_lib.CONFIG_PATHS) == set(OTHER)


def test_the_fingerprint_takes_no_perf():
  params = inspect.signature(fingerprint.run_fingerprint).parameters
  assert 'perf' not in params and all('Perf' not in str(p.annotation) for p in params.values())


def test_changing_any_perf_field_keeps_the_fingerprint_and_resumes():
  base = plan_lib.make_plan(_config(), N, seed=7)
  assert base.perf == perf_lib.Perf.from_config(_config())
  for name, value in OTHER.items():
    other = plan_lib.make_plan(
      _config(**{name: value}), N, base.fingerprint, seed=7, resumed_step=10
    )
    assert getattr(other.perf, name) == value != getattr(base.perf, name), name
    assert other.fingerprint == base.fingerprint, name
    assert other.privacy.noise_multiplier == base.privacy.noise_multiplier
    assert other.privacy.accountant.epsilon(50) == base.privacy.accountant.epsilon(50)


def test_a_privacy_field_is_not_a_perf_field_and_is_refused_on_resume():
  base = plan_lib.make_plan(_config(), N, seed=7)
  config = _config()
  config.privacy.clip_norm = 2.0
  try:
    plan_lib.make_plan(config, N, base.fingerprint, seed=7, resumed_step=10)
  except plan_lib.PlanError as e:
    assert 'privacy.clip_norm: 1.0 → 2.0' in str(e)
  else:
    raise AssertionError('a changed C resumed')
  assert not set(perf_lib.CONFIG_PATHS.values()) & set(base.fingerprint)


def test_the_precision_enters_epsilon_through_eta_and_a_new_matmul_format_is_refused():
  """η (the float rounding the accountant pays for) comes from B and the precision's matmul
  format, so precision is no Perf field: a resume in another format is refused, one in another
  mode with the same format (on the CPU: 'default' and 'highest', both float32) resumes.
  Fails on da06065: precision was a Perf field and η did not exist."""
  base = plan_lib.make_plan(_config(), N, seed=7)
  eta = rounding.eta(base.max_batch_size, precision_lib.matmul_format('default'))
  assert base.fingerprint['privacy.rounding_eta'] == eta == base.privacy.rounding.eta
  assert base.privacy.accountant.sensitivity == 1 + eta
  config = _config()
  config.precision = 'bfloat16'
  with pytest.raises(plan_lib.PlanError, match="privacy.matmul_format: '[a-z0-9]+' → 'bfloat16'"):
    plan_lib.make_plan(config, N, base.fingerprint, seed=7, resumed_step=10)
  config.precision = 'highest'
  if precision_lib.matmul_format('highest') == precision_lib.matmul_format('default'):
    other = plan_lib.make_plan(config, N, base.fingerprint, seed=7, resumed_step=10)
    assert other.fingerprint == base.fingerprint and other.privacy.precision == 'highest'
