"""LoRA fine-tuning in the library tier: ghost norms of the adapters, the frozen base as data."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax.models import transformer
from dpjax.privacy import clipping
from dpjax.privacy import dp_step
from dpjax.privacy import lora
from dpjax.privacy import losses
from dpjax.privacy import param_sharding
from dpjax.privacy import step_layout
from tests.privacy.ghost_clipping import harness

MODEL = transformer.Transformer(
  num_classes=3, max_length=4, num_layers=1, num_heads=2, model_dim=8, mlp_dim=8
)
TARGETS = ('query|value|out', 'Dense_[01]')  # Attention projections and MLP kernels.
ALPHA, RANK = 6.0, 2  # s = 3: a rule that drops s is off by 9x in ‖g‖².
N = 5
P = jax.sharding.PartitionSpec


def _setup():
  """(wrapped model, trainable with B != 0, batch of N sequences [N, 4, 5])."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N, 4, 5)).astype(np.float32)
  wrapped, trainable = lora.make_finetune(
    MODEL, harness.init(MODEL, x[:1], 0), lora_rank=RANK, lora_alpha=ALPHA, lora_targets=TARGETS
  )
  trainable = jax.tree.map(
    lambda v: v + 0.3 * rng.normal(size=v.shape).astype(np.float32), trainable
  )
  return wrapped, trainable, {'x': x, 'y': np.arange(N) % 3}


def _float64_sq_norms(wrapped, trainable, batch) -> np.ndarray:
  """‖g_i‖² by autodiff of the whole model in float64 (x64 on): independent of any rule."""
  with jax.enable_x64(True):
    f64 = lambda t: jax.tree.map(lambda v: np.asarray(v, np.float64), t)
    model64 = lora.FineTuneModel(
      wrapped.model, f64(wrapped.frozen), wrapped.lora_targets, wrapped.lora_scale
    )
    loss = losses.make_loss_fn(model64)
    grads = jax.jit(jax.vmap(jax.grad(lambda p, e: loss(p, e)[0]), in_axes=(None, 0)))(
      f64(trainable), {'x': np.asarray(batch['x'], np.float64), 'y': batch['y']}
    )
    return np.asarray(sum(jnp.sum(jnp.square(g.reshape(N, -1)), 1) for g in jax.tree.leaves(grads)))


def test_lora_ghost_norms_equal_vmap_and_float64_and_each_clipped_row_is_within_c():
  """Ghost norms of LoRA adapters on attention projections (DenseGeneral) and MLP kernels
  (Dense) over sequences equal per-example gradients' (vmap) and a float64 reference (≤ 1e-5
  relative, never below it), and each row's clipped contribution is ≤ C. Catches a rule that
  drops s = α/r, mixes up ∂A and ∂B, reads the frozen kernel, or a coverage that refuses
  LoRA ('auto' must pick ghost)."""
  wrapped, trainable, batch = _setup()
  loss = losses.make_loss_fn(wrapped)
  with jax.default_matmul_precision('highest'):
    want = _float64_sq_norms(wrapped, trainable, batch)
    clip = 0.5 * float(np.sqrt(want.min()))  # Every row is clipped.
    sums, norms = {}, {}
    for method in ('vmap', 'auto'):
      fn = clipping.clipped_sum_fn(loss, clip, method)
      grad = jax.jit(lambda p, b, w, fn=fn: fn(p, b, w))
      total, per_example = grad(trainable, batch, np.ones(N, np.float32))
      sums[method], norms[method] = jax.tree.leaves(total), np.asarray(per_example.norm)
      for i in range(N):  # Row i alone: its clipped contribution.
        row = grad(trainable, batch, np.eye(N, dtype=np.float32)[i])[0]
        size = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(row)))
        assert size <= clip * (1 + 1e-6), (method, i, size, clip)
    lines = ' | '.join(fn.choice)
    assert 'ghost' in fn.choice[0] and lines.count(f'LoRA s={ALPHA / RANK:g}') == 5, lines
    ghost_sq = np.square(norms['auto'].astype(np.float64))
    np.testing.assert_allclose(ghost_sq, want, rtol=1e-5)
    np.testing.assert_allclose(np.square(norms['vmap'].astype(np.float64)), want, rtol=1e-5)
    assert np.all(ghost_sq >= want * (1 - 1e-6))  # An upper bound: never under-clips.
    for a, b in zip(sums['vmap'], sums['auto']):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_the_frozen_base_is_an_argument_of_the_step_not_a_constant():
  """The DP step's program takes the base as an argument: a marker value planted in a frozen
  kernel is absent from its HLO, while a jit closing over the same base embeds it (the
  control: jax 0.10 inlines closed-over arrays as constants, on one device)."""
  wrapped, trainable, batch = _setup()
  marker = 1234.5
  path = 'MultiHeadDotProductAttention_0/value/kernel'
  flat = lora.flatten(wrapped.frozen)
  flat[path] = flat[path].at[0, 0, 0].set(marker)
  wrapped = lora.FineTuneModel(MODEL, lora.unflatten(flat), wrapped.lora_targets, 3.0)
  step = dp_step.DPStep.for_model(
    wrapped, optax.sgd(0.1), clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=5.0
  )
  logical = jax.tree.map(lambda v: v[None], dict(batch, weight=np.ones(N, np.float32)))
  state = step.init_opt_state(trainable)
  text = jax.jit(step.logical_step).lower(trainable, state, logical, 1, 0, None, step.keys)
  text = text.as_text()
  closed = jax.jit(lambda p, b: losses.make_loss_fn(wrapped)(p, b)[0])
  control = closed.lower(trainable, jax.tree.map(lambda v: v[0], batch)).as_text()
  assert '1.234500e+03' in control and '1.234500e+03' not in text
  assert 'frozen' in step.keys and step.keys['frozen'] is wrapped.frozen


def test_the_base_is_placed_like_parameters_over_the_mesh():
  """The step's keys argument places the base as `param_sharding` would place the same
  arrays trained (FSDP: a kernel of >= `MIN_SHARDED_SIZE` elements split on its largest axis, a bias
  whole) and the keys replicated; catches a base left replicated (memory x fsdp) or a
  placement that drifts from the parameters' rule. An abstract (data=2, fsdp=4) mesh: no
  devices needed."""
  mesh = jax.sharding.AbstractMesh((2, 4, 1), ('data', 'fsdp', 'tensor'))
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)
  base = {'Dense_1': {'kernel': f32(128, 256), 'bias': f32(256)}, 'pos_embedding': f32(8, 128)}
  want = param_sharding.parameter_specs(base, mesh, param_sharding.ShardingRules())
  assert want['Dense_1']['kernel'] == P(None, 'fsdp') and want['Dense_1']['bias'] == P()
  keys = {'noise': np.zeros(2, np.uint32), 'views': np.zeros(2, np.uint32), 'frozen': base}
  ins = step_layout.program_shardings(mesh, 'sk', keys)['in_shardings']
  assert ins[0] is None and ins[1]['noise'].spec == ins[1]['views'].spec == P()  # 's': as it comes.
  got = jax.tree.map(lambda s: s.spec, ins[1]['frozen'])
  assert got == want
