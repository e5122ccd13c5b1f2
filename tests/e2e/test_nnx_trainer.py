"""An NNX model through `dpjax.train`: ghost clipping, and a resume that is bit-exact."""

import jax
import numpy as np
import pytest

from dpjax import train
from tests.run_configs import small_config

pytestmark = pytest.mark.slow  # Whole trainings or child processes (`make test-unit` skips).


def _nnx_config(**overrides):
  config = small_config(**overrides)
  config.model.framework = 'nnx'
  return config


def test_nnx_mlp_trains_with_ghost_clipping_and_resumes_bit_exactly(
  tmp_path, capsys, reference_run
):
  straight = train.train_and_evaluate(_nnx_config(), str(tmp_path / 'straight'))
  out = capsys.readouterr().out
  assert 'ghost clipping' in out and 'hidden/0: dense' in out, out
  train.train_and_evaluate(_nnx_config(num_steps=4), str(tmp_path / 'resumed'))
  resumed = train.train_and_evaluate(_nnx_config(), str(tmp_path / 'resumed'))
  assert 'Resuming from step 4' in capsys.readouterr().out
  for a, b in zip(jax.tree.leaves(straight['params']), jax.tree.leaves(resumed['params'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert straight['eval_accuracy'] == resumed['eval_accuracy']
  _, linen = reference_run  # The linen MLP of small_config().
  shapes = lambda p: sorted(np.shape(x) for x in jax.tree.leaves(p))
  assert shapes(linen['params']) == shapes(straight['params'])  # The same network.
