"""The plan's typed blocks (issue 35, item 2): `make_plan` reads the config once, below it
nothing reads the config (tests/test_structure.py), so every field the step, the loop and the
reports use must reach its block, and a field a config lacks has its declared default.

On da06065 the blocks did not exist (the loop, `build` and `run_report` read `plan.config`,
and `config.get(key, default)` repeated FIELDS' defaults): this module fails there at import
(no `plan_blocks`, nor the `rounding` of η). The fingerprint test guards that existing
workdirs still resume: its fields and values are those 11c40e5 wrote, byte for byte.
"""

import json

import ml_collections
import pytest

from dpjax.privacy import precision
from dpjax.privacy import privacy_plan
from dpjax.privacy import rounding
from dpjax.privacy import samplers
from dpjax.trainer.configuration import config_fields
from dpjax.trainer.planning import plan as plan_lib
from dpjax.trainer.planning import plan_blocks
from tests.run_configs import small_config

N = 1437
# Field -> (block, attribute) and a value other than small_config's.
READ = {
  'log_every_steps': ('schedule', 'log_every', 7),
  'eval_every_steps': ('schedule', 'eval_every', 9),
  'checkpoint_every_steps': ('schedule', 'checkpoint_every', 5),
  'keep_checkpoints': ('schedule', 'keep_checkpoints', 1),
  'loss': ('recipe', 'loss', 'mse'),
  'privacy.clipping': ('recipe', 'clipping', 'vmap'),
  'privacy.noise_prng': ('recipe', 'noise_prng', 'rbg'),
  'precision': ('recipe', 'precision', 'highest'),
  'ema_decay': ('recipe', 'ema_decay', 0.5),
  'init_from_disjoint_data': ('finetune', 'init_from_disjoint_data', True),
  'lora.alpha': ('finetune', 'lora_alpha', 4.0),
  'audit.confidence': ('audit', 'confidence', 0.9),
  'audit.every_checkpoint': ('audit', 'every_checkpoint', True),
  'data.label_format': ('data', 'label_format', 'one_hot'),
}


@pytest.mark.parametrize('path', sorted(READ))
def test_a_field_set_in_the_config_reaches_its_block(path):
  block, attribute, value = READ[path]
  config = small_config(**{path: value})
  assert config_fields.FIELDS_BY_PATH[path].default != value
  blocks = {
    'schedule': plan_blocks.Schedule,
    'recipe': plan_blocks.Recipe,
    'finetune': plan_blocks.Finetune,
    'audit': plan_blocks.AuditPlan,
    'data': plan_blocks.DataSettings,
  }
  assert getattr(blocks[block].of(config), attribute) == value


def test_a_field_the_config_lacks_has_its_declared_default():
  """An accounting-only config (no loop fields): each block holds FIELDS' defaults."""
  default = lambda path: config_fields.FIELDS_BY_PATH[path].default
  empty = ml_collections.ConfigDict()
  assert plan_blocks.Schedule.of(empty) == plan_blocks.Schedule(
    default('log_every_steps'),
    default('eval_every_steps'),
    default('checkpoint_every_steps'),
    default('keep_checkpoints'),
  )
  recipe = plan_blocks.Recipe.of(empty)
  assert (recipe.loss, recipe.precision, recipe.augmult) == (
    default('loss'),
    default('precision'),
    None,
  )
  assert recipe.optimizer.learning_rate == default('optimizer.learning_rate')
  assert plan_blocks.AuditPlan.of(empty).num_canaries == default('audit.num_canaries')
  assert plan_blocks.DataSettings.of(empty).public_num_examples == 0


@pytest.mark.parametrize(
  'path, argument, value',
  [
    ('privacy.noise_multiplier', 'noise_multiplier', -1.0),
    ('privacy.clip_norm', 'clip_norm', float('inf')),
    ('privacy.delta', 'delta', 1.5),
    ('sampler.batch_size', 'batch_size', 5000),
  ],
)
def test_the_core_names_its_argument_and_the_config_its_field(path, argument, value):
  """σ, C, δ and b: `PrivacyPlan.create` (through `checks` and the sampler) says the argument's
  name, `make_plan` the config field's path, each in one line."""
  core = dict(num_steps=6, clip_norm=1.0, noise_multiplier=1.0, delta=1e-5)
  sampler = lambda b: samplers.make('poisson', N, b, seed=0)
  with pytest.raises(ValueError) as core_error:
    if argument == 'batch_size':
      privacy_plan.PrivacyPlan.create(sampler(value), **core)
    else:
      privacy_plan.PrivacyPlan.create(sampler(128), **{**core, argument: value})
  assert str(core_error.value).startswith(f'{argument} ')
  with pytest.raises(config_fields.ConfigError) as config_error:
    plan_lib.make_plan(small_config(**{path: value}), N)
  assert str(config_error.value).startswith(f'{path} = ')
  assert '\n' not in str(core_error.value) + str(config_error.value)


def _golden(private: bool, **fields):
  """The fingerprint 11c40e5 wrote for small_config at N = 1437 (seed 0), in its key order."""
  eta = rounding.eta(288, precision.matmul_format('default'))
  out = {
    'fingerprint_version': 3,
    'privacy.enabled': private,
    'sampler.name': 'poisson',
    'sampler.num_examples': fields.pop('num_examples', N),
    'sampler.batch_size': 128,
    'sampler.max_batch_size': 288,
    'privacy.group_size': 1 if private else None,
    'privacy.noise_multiplier': 1.0 if private else None,
    'privacy.clip_norm': 1.0 if private else None,
    'privacy.delta': 1e-05 if private else None,
    'privacy.accountant': 'pld' if private else None,
    'privacy.matmul_format': 'float32' if private else None,
    'privacy.rounding_eta': eta if private else None,
    'seed_sha256': privacy_plan.seed_digest(0),
    'audit.num_canaries': 0,
    'audit.kind': None,
    'data.source': None,
    'data.split': None,
    'data.num_examples': None,
    'data.content_sha256': None,
  }
  out.update(fields)
  return out


@pytest.mark.parametrize(
  'overrides, expected',
  [
    ({}, _golden(True)),
    (
      {'privacy.enabled': False, 'audit.num_canaries': 4},
      _golden(False, **{'audit.num_canaries': 4, 'audit.kind': 'gradient'}),
    ),
    (
      {'data.public_num_examples': 1500},
      _golden(True, num_examples=1500, **{'data.public_num_examples': 1500}),
    ),
  ],
)
def test_the_fingerprint_is_the_one_existing_workdirs_hold(overrides, expected):
  fingerprint = plan_lib.make_plan(small_config(**overrides), N).fingerprint
  assert json.dumps(fingerprint) == json.dumps(expected)
