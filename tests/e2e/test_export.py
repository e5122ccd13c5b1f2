"""python -m dpjax.export: the parameters and a privacy card, nothing else (issue 24, item 1)."""

import json
import os

import numpy as np
import pytest

from dpjax.trainer import checkpoints
from dpjax import export
from dpjax.privacy import rounding
from dpjax.trainer import finetune
from dpjax.trainer import run_seed
from dpjax import train
from tests.run_configs import small_config

CARD_FIELDS = {'epsilon', 'delta', 'bound', 'accountant', 'sampler', 'num_examples',
               'noise_multiplier', 'clip_norm', 'steps', 'neighbouring_relation',
               'dpjax_version', 'guarantee', 'seed_drawn_in_secret'}


@pytest.fixture(autouse=True)
def _private_registry(tmp_path, monkeypatch):
  monkeypatch.setenv('DPJAX_STATE_DIR', str(tmp_path / 'state'))


@pytest.fixture(scope='module')
def drawn_run(tmp_path_factory):
  """A 3-step run with a drawn seed and an EMA."""
  workdir = tmp_path_factory.mktemp('export') / 'run'
  config = small_config(**{'seed': None, 'num_steps': 3, 'checkpoint_every_steps': 3,
                           'ema_decay': 0.9})
  train.train_and_evaluate(config, str(workdir))
  return workdir


def test_export_writes_params_ema_and_card_and_nothing_private(drawn_run, tmp_path, capsys):
  out = tmp_path / 'release' / 'model'
  assert export.main(['--workdir', str(drawn_run), '--out', str(out)]) == 0
  assert 'Exported step 3' in capsys.readouterr().out
  assert sorted(os.listdir(out)) == ['ema_params.npz', 'params.npz', 'privacy_card.json']
  card = json.load(open(out / 'privacy_card.json'))
  assert CARD_FIELDS <= set(card)
  meta = checkpoints.read_metadata(str(drawn_run))[-1]
  assert card['epsilon'] == meta['privacy']['epsilon'] and card['bound'] == 'upper'
  assert card['noise_multiplier'] == 1.0 and card['clip_norm'] == 1.0 and card['steps'] == 3
  assert card['seed_drawn_in_secret'] is True
  assert card['neighbouring_relation'] == 'add or remove one training example'
  state = checkpoints.read_state(str(drawn_run), 3)
  with np.load(out / 'params.npz') as f:
    for key, value in finetune.flatten(state['params']).items():
      np.testing.assert_array_equal(f[key], value)
  with np.load(out / 'ema_params.npz') as f:
    assert set(f.files) == set(finetune.flatten(state['params']))
  # Nothing private: not the seed, its digest, a path, or a non-private statistic.
  seed = run_seed.stored_seed(str(drawn_run)).value
  secrets = [str(seed).encode(), meta['fingerprint']['seed_sha256'].encode(),
             str(drawn_run).encode(), b'nonprivate', b'num_truncated', b'train_loss']
  for name in os.listdir(out):
    blob = open(out / name, 'rb').read()
    assert not [s for s in secrets if s in blob], name
  # What init_from reads.
  assert set(finetune.read_params(str(out / 'params.npz'))) == set(
      finetune.flatten(state['params']))


def test_the_card_states_eta_and_what_it_cost_in_epsilon(drawn_run, tmp_path):
  """η of the run's cap B and matmul format, and Δε = ε − ε₀ with ε₀ of the same accountant at
  sensitivity C: recomputed here from dp_accounting at σ and σ/(1 + η). Fails on da06065: the
  card had no η (clipping was below C and ε was that of σ)."""
  from dp_accounting import dp_event  # pylint: disable=import-outside-toplevel
  from dp_accounting.pld import pld_privacy_accountant  # pylint: disable=import-outside-toplevel
  card = export.export(str(drawn_run), str(tmp_path / 'model'))
  meta = checkpoints.read_metadata(str(drawn_run))[-1]
  cap, fmt = card['sampler']['max_batch_size'], meta['fingerprint']['privacy.matmul_format']
  rounded = card['float_rounding']
  assert rounded['eta'] == meta['fingerprint']['privacy.rounding_eta'] == rounding.eta(cap, fmt)
  assert rounded['max_batch_size'] == cap and rounded['matmul_format'] == fmt
  assert rounded['statement'].startswith(f"η = {rounded['eta']:.2g} (float rounding of the sum, "
                                         f'B = {cap}')
  sigma, q = card['noise_multiplier'], card['sampler']['expected_batch_size'] / card['num_examples']
  def epsilon(noise):  # The run's cap truncates with negligible probability here.
    direct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    direct.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(noise)), 3)
    return direct.get_epsilon(card['delta'])
  assert card['epsilon'] == pytest.approx(epsilon(sigma / (1 + rounded['eta'])), rel=1e-6)
  assert rounded['epsilon_cost'] == pytest.approx(card['epsilon'] - epsilon(sigma), rel=1e-3)
  assert 0 < rounded['epsilon_cost']


def test_exports_of_two_runs_sharing_a_seed_into_one_tree_are_refused(tmp_path, capsys):
  for name in ('lr_a', 'lr_b'):
    train.train_and_evaluate(small_config(**{'seed': 11, 'num_steps': 2,
                                             'checkpoint_every_steps': 2}),
                             str(tmp_path / name))
  export.export(str(tmp_path / 'lr_a'), str(tmp_path / 'sweep' / 'a'))
  export.export(str(tmp_path / 'lr_a'), str(tmp_path / 'sweep' / 'a_again'))  # Same run: fine.
  with pytest.raises(SystemExit) as exit_info:
    export.main(['--workdir', str(tmp_path / 'lr_b'), '--out', str(tmp_path / 'sweep' / 'b')])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and 'same seed' in err and 'noise-free difference' in err
  assert not os.path.exists(tmp_path / 'sweep' / 'b')
  export.export(str(tmp_path / 'lr_b'), str(tmp_path / 'sweep' / 'b'), allow_shared_seed=True)


@pytest.mark.parametrize('where', ['inside_workdir', 'not_empty', 'no_checkpoint'])
def test_bad_exports_are_refused_before_writing(drawn_run, tmp_path, where):
  workdir, out = str(drawn_run), str(tmp_path / 'out')
  if where == 'inside_workdir':
    out = os.path.join(workdir, 'release')
  elif where == 'not_empty':
    os.makedirs(out)
    open(os.path.join(out, 'x'), 'w').close()
  else:
    workdir = str(tmp_path)
  with pytest.raises(ValueError):
    export.export(workdir, out)
  assert not os.path.exists(os.path.join(str(drawn_run), 'release'))
