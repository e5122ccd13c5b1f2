"""An NNX model through `dpjax.train`: ghost clipping, and a resume that is bit-exact."""

import shutil

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
  """The resumed run is the straight one's workdir (checkpoints 2, 4, 6) without checkpoint 6,
  as if stopped after step 4 (it was a 4-step run of its own: the same state, one more
  training)."""
  straight = train.train_and_evaluate(_nnx_config(), str(tmp_path / 'straight'))
  out = capsys.readouterr().out
  assert 'ghost clipping' in out and 'hidden/0: dense' in out, out
  shutil.copytree(tmp_path / 'straight', tmp_path / 'resumed')
  shutil.rmtree(tmp_path / 'resumed' / 'checkpoints' / '6')
  resumed = train.train_and_evaluate(_nnx_config(), str(tmp_path / 'resumed'))
  assert 'Resuming from step 4' in capsys.readouterr().out
  for a, b in zip(jax.tree.leaves(straight['params']), jax.tree.leaves(resumed['params'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert straight['eval_accuracy'] == resumed['eval_accuracy']
  _, linen = reference_run  # The linen MLP of small_config().
  shapes = lambda p: sorted(np.shape(x) for x in jax.tree.leaves(p))
  assert shapes(linen['params']) == shapes(straight['params'])  # The same network.
