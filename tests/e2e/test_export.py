"""python -m dpjax.export: the parameters and a privacy card, nothing else (issue 24, item 1)."""

import json
import os

import numpy as np
import pytest

from dpjax.trainer import checkpoints
from dpjax import export
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


def test_the_card_says_n_is_public_and_records_the_scale_that_ran(drawn_run, tmp_path):
  """Issue 34 item 4 and the scale bullet; fails on da06065 (checked): the card had no word on
  N and recorded data.scale = 0.0 ('derive it') instead of digits' 16, the value used."""
  card = export.export(str(drawn_run), str(tmp_path / 'model'))
  assert card['num_examples'] == 1437 and card['exact_num_examples_is_public'] is True
  assert 'treated as public' in card['num_examples_note']
  assert 'data.public_num_examples' in card['num_examples_note']
  assert card['preprocessing'] == {
      'scale': 16.0, 'scale_source': "data.scale = 0: the digits data's range", 'mean': [0.5],
      'std': [0.5], 'label_format': 'int', 'targets': 'labels'}
  # The card's preprocessing maps raw digits exactly as training did.
  from dpjax.data import digits  # pylint: disable=import-outside-toplevel
  from dpjax.data import sources  # pylint: disable=import-outside-toplevel
  raw = digits.load_digits_arrays()[0][:3]
  p = card['preprocessing']
  trained = sources.make_sources(small_config().data)[0].gather(np.arange(3))['x']
  np.testing.assert_allclose((raw / p['scale'] - p['mean'][0]) / p['std'][0], trained, rtol=1e-6)


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
