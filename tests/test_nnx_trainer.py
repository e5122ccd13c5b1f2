"""An NNX model through `dpjax.train`: ghost clipping, and a resume that is bit-exact."""

import jax
import numpy as np

from dpjax import train
from tests.run_configs import small_config


def _nnx_config(**overrides):
  config = small_config(**overrides)
  config.model.framework = 'nnx'
  return config


def test_nnx_mlp_trains_with_ghost_clipping_and_resumes_bit_exactly(tmp_path, capsys):
  straight = train.train_and_evaluate(_nnx_config(), str(tmp_path / 'straight'))
  out = capsys.readouterr().out
  assert 'ghost clipping' in out and 'hidden/0: dense' in out, out
  train.train_and_evaluate(_nnx_config(num_steps=4), str(tmp_path / 'resumed'))
  resumed = train.train_and_evaluate(_nnx_config(), str(tmp_path / 'resumed'))
  assert 'Resuming from step 4' in capsys.readouterr().out
  for a, b in zip(jax.tree.leaves(straight['params']), jax.tree.leaves(resumed['params'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert straight['eval_accuracy'] == resumed['eval_accuracy']


def test_nnx_and_linen_networks_have_the_same_parameters_and_both_learn(tmp_path):
  linen = train.train_and_evaluate(small_config(num_steps=20), str(tmp_path / 'linen'))
  nnx = train.train_and_evaluate(_nnx_config(num_steps=20), str(tmp_path / 'nnx'))
  shapes = lambda p: sorted(np.shape(x) for x in jax.tree.leaves(p))
  assert shapes(linen['params']) == shapes(nnx['params'])
  assert nnx['eval_accuracy'] > 0.5 and linen['eval_accuracy'] > 0.5
