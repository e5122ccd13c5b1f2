"""Fine-tuning: loading (npz, orbax workdir, clear errors), freezing and LoRA under DP-SGD."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.trainer.workdir import checkpoints
from dpjax.privacy import dp_step
from dpjax.privacy import lora
from dpjax.trainer.planning import finetune
from dpjax.models import factory as models
from dpjax.models import mlp
from dpjax.models import transformer
from tests.privacy.ghost_clipping import harness

MODEL = mlp.MLP(num_classes=3, hidden_sizes=(8, 8), activation='tanh')


def _params(seed=0):
  """Parameters from NumPy (harness.init): an eager `MODEL.init` compiled each of its ops."""
  return harness.init(MODEL, np.zeros((1, 5), np.float32), seed)


def _batch(seed=1, n=16):
  rng = np.random.default_rng(seed)
  return {
    'x': jnp.asarray(rng.normal(size=(n, 5)), jnp.float32),
    'y': jnp.asarray(rng.integers(0, 3, n), jnp.int32),
    'weight': jnp.asarray(np.r_[np.ones(n - 3), np.zeros(3)], jnp.float32),
  }


def _train(model, trainable, steps=3):
  """A few DP-SGD steps (σ = 1, C = 0.5, vmap clipping) on the trainable parameters."""
  step = dp_step.DPStep.for_model(
    model,
    optax.sgd(0.5),
    clip_norm=0.5,
    noise_multiplier=1.0,
    expected_batch_size=13.0,
    clipping='vmap',
  )
  opt_state = step.optimizer.init(trainable)
  for t in range(steps):
    acc = step.accumulate(trainable, step.init_accumulator(trainable), _batch(t))
    trainable, opt_state, _ = step.apply(trainable, opt_state, acc, t)
  return trainable


def test_npz_round_trip(tmp_path):
  params = _params()
  path = str(tmp_path / 'p.npz')
  finetune.save_npz(path, params)
  assert set(np.load(path).files) == {
    'Dense_0/kernel',
    'Dense_0/bias',
    'Dense_1/kernel',
    'Dense_1/bias',
    'Dense_2/kernel',
    'Dense_2/bias',
  }
  loaded = finetune.load_pretrained(path, _params(seed=1))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_loads_a_dpjax_workdir(tmp_path):
  params = _params(seed=3)
  manager = checkpoints.make_manager(str(tmp_path), keep=2)
  for step in (1, 2):
    state = {'step': np.int32(step), 'params': jax.tree.map(lambda p: p * step, params)}
    checkpoints.save(manager, step, state, {'step': step})
  manager.wait_until_finished()
  manager.close()
  loaded = finetune.load_pretrained(str(tmp_path), _params())  # The newest: step 2.
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(2 * np.asarray(a), np.asarray(b))
  step1 = finetune.load_pretrained(str(tmp_path / 'checkpoints' / '1'), _params())
  np.testing.assert_array_equal(
    np.asarray(step1['Dense_0']['kernel']), np.asarray(params['Dense_0']['kernel'])
  )


def test_loading_errors_are_one_clear_line(tmp_path):
  path = str(tmp_path / 'p.npz')
  other = mlp.MLP(num_classes=4, hidden_sizes=(8,), activation='tanh')
  finetune.save_npz(path, {'encoder': harness.init(other, np.zeros((1, 5), np.float32), 0)})
  with pytest.raises(ValueError) as e:
    finetune.load_pretrained(path, _params())
  msg = str(e.value)
  assert '\n' not in msg
  assert 'missing keys [Dense_0/bias, Dense_0/kernel, Dense_1/bias' in msg
  assert 'unexpected keys [encoder/Dense_0/bias' in msg
  # Renamed, the keys match but the shapes of the head (4 classes vs 3) and Dense_1 do not.
  with pytest.raises(
    ValueError,
    match=r'missing keys \[Dense_2/bias, Dense_2/kernel\]; shape '
    r'mismatches \[Dense_1/bias \(4,\) vs model \(8,\), Dense_1/kernel \(8, 4\) '
    r'vs model \(8, 8\)\]',
  ):
    finetune.load_pretrained(path, _params(), rules=[('^encoder/', '')])
  with pytest.raises(ValueError, match='init_from = .*not found'):
    finetune.load_pretrained(str(tmp_path / 'nope'), _params())
  with pytest.raises(ValueError, match="init_from_rules regex '\\['"):
    finetune.load_pretrained(path, _params(), rules=[('[', '')])


def test_frozen_parameters_are_bit_identical_after_dp_training():
  params = _params()
  model, trainable = lora.make_finetune(MODEL, params, freeze=('Dense_[01]/',))
  assert set(lora.flatten(trainable)) == {'Dense_2/kernel', 'Dense_2/bias'}
  trained = _train(model, trainable)
  full = lora.flatten(model.full_params(trained))
  before = lora.flatten(params)
  for path in ('Dense_0/kernel', 'Dense_0/bias', 'Dense_1/kernel', 'Dense_1/bias'):
    np.testing.assert_array_equal(np.asarray(full[path]), np.asarray(before[path]))
  assert not np.array_equal(np.asarray(full['Dense_2/kernel']), before['Dense_2/kernel'])


@pytest.mark.slow
def test_lora_only_the_adapters_change_and_start_at_the_pretrained_model():
  params = _params()
  model, trainable = lora.make_finetune(
    MODEL,
    params,
    freeze=('Dense_2/',),
    lora_rank=2,
    lora_alpha=4.0,
    lora_targets=('Dense_[01]/kernel',),
  )
  assert set(lora.flatten(trainable)) == {
    'Dense_0/bias',
    'Dense_1/bias',
    'Dense_0/kernel_lora_a',
    'Dense_0/kernel_lora_b',
    'Dense_1/kernel_lora_a',
    'Dense_1/kernel_lora_b',
  }
  x = _batch()['x']
  np.testing.assert_array_equal(
    np.asarray(_jitted_apply(model, trainable, x)), np.asarray(_jitted_apply(MODEL, params, x))
  )
  trained = lora.flatten(_train(model, trainable))
  start = lora.flatten(trainable)
  for k in ('Dense_0/kernel_lora_b', 'Dense_1/kernel_lora_b', 'Dense_0/bias'):
    assert not np.array_equal(np.asarray(trained[k]), np.asarray(start[k]))
  merge = jax.jit(model.full_params)  # One program (eager, each op its own compilation).
  full = lora.flatten(merge(lora.unflatten(trained)))
  before = lora.flatten(params)
  for k in ('Dense_2/kernel', 'Dense_2/bias'):
    np.testing.assert_array_equal(np.asarray(full[k]), np.asarray(before[k]))
  # W' = W + (α/r)·A·B, checked in float64 (A·B in float32: GPUs default to TF32 matmuls).
  with jax.default_matmul_precision('highest'):  # Part of jit's key: traced again under it.
    full = lora.flatten(merge(lora.unflatten(trained)))
  a = np.asarray(trained['Dense_0/kernel_lora_a'], np.float64)
  b = np.asarray(trained['Dense_0/kernel_lora_b'], np.float64)
  expected = np.asarray(before['Dense_0/kernel'], np.float64) + 2.0 * a @ b
  np.testing.assert_allclose(np.asarray(full['Dense_0/kernel']), expected, rtol=1e-5, atol=1e-6)
  assert (
    np.linalg.matrix_rank(
      np.asarray(full['Dense_0/kernel'], np.float64)
      - np.asarray(before['Dense_0/kernel'], np.float64),
      tol=1e-5,
    )
    <= 2
  )


def _jitted_apply(model, params, x):
  """model.apply as one program (eager, each of its ops is compiled alone: a transformer's
  forward pass compiled op by op cost seconds)."""
  return jax.jit(lambda p, v: model.apply({'params': p}, v))(params, x)


@pytest.mark.slow
def test_attention_kernels_are_viewed_as_in_by_out_matrices():
  assert lora.matrix_split('MultiHeadDotProductAttention_0/query/kernel', (64, 4, 16)) == 1
  assert lora.matrix_split('MultiHeadDotProductAttention_0/out/kernel', (4, 16, 64)) == 2
  assert lora.matrix_split('Conv_0/kernel', (3, 3, 8, 16)) == 3
  model = transformer.Transformer(
    num_classes=3, max_length=4, num_layers=1, num_heads=2, model_dim=8, mlp_dim=8
  )
  params = harness.init(model, np.zeros((1, 4, 5), np.float32), 0)
  wrapped, trainable = lora.make_finetune(
    model, params, freeze=('.',), lora_rank=2, lora_targets=('query|value',)
  )
  flat = lora.flatten(trainable)
  assert set(flat) == {
    f'MultiHeadDotProductAttention_0/{n}/kernel{s}'
    for n in ('query', 'value')
    for s in ('_lora_a', '_lora_b')
  }
  assert flat['MultiHeadDotProductAttention_0/query/kernel_lora_a'].shape == (8, 2)
  assert flat['MultiHeadDotProductAttention_0/query/kernel_lora_b'].shape == (2, 8)
  x = jnp.ones((2, 4, 5))
  np.testing.assert_array_equal(
    np.asarray(_jitted_apply(wrapped, trainable, x)), np.asarray(_jitted_apply(model, params, x))
  )


@pytest.mark.parametrize(
  'kwargs, match',
  [
    (dict(freeze=('Conv',)), "freeze regex 'Conv' matches no parameter"),
    (dict(freeze=('.',)), 'freezes every parameter'),
    (dict(freeze='Dense_0'), 'must be a tuple'),
    (dict(lora_rank=2, lora_targets=('bias',)), "lora.targets regex 'bias' matches no"),
    (dict(lora_rank=9, lora_targets=('Dense_2',)), r'lora.rank = 9: must be <= min\(in, out\) = 3'),
    (dict(lora_rank=2, lora_targets=()), 'lora.targets'),
    (dict(lora_rank=2, lora_alpha=0.0, lora_targets=('Dense_0',)), 'lora.alpha'),
    (dict(lora_rank=-1), 'lora.rank'),
  ],
)
def test_bad_freeze_and_lora_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    lora.make_finetune(MODEL, _params(), **kwargs)


def test_ghost_clipping_with_frozen_layers_or_lora_equals_vmap():
  """Freezing and LoRA keep ghost clipping exact (the sums equal vmap's): catches a LoRA rule
  that drops s = α/r or a factor, or a frozen kernel leaking into the covered parameters."""
  batch = _batch(n=8)
  for kwargs in (dict(freeze=('Dense_0/',)), dict(lora_rank=2, lora_targets=('Dense_0/kernel',))):
    model, trainable = lora.make_finetune(MODEL, _params(), lora_alpha=3.0, **kwargs)
    trainable = jax.tree.map(lambda v: v + 0.1, trainable)  # B != 0: both factors move.
    sums = {}
    for method in ('vmap', 'ghost'):
      step = dp_step.DPStep.for_model(
        model,
        optax.sgd(0.1),
        clip_norm=0.3,
        noise_multiplier=1.0,
        expected_batch_size=8.0,
        clipping=method,
        precision='highest',
      )  # GPUs default to TF32 (~5e-4 relative).
      sums[method] = step.accumulate(trainable, step.init_accumulator(trainable), batch).grad_sum
    for a, b in zip(jax.tree.leaves(sums['vmap']), jax.tree.leaves(sums['ghost'])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
