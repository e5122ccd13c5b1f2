"""dpjax.privacy.precision: margins, and the bound ‖contribution as summed‖ ≤ C(1 + m) in bfloat16."""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.privacy import dp_step
from dpjax.models import factory as models
from dpjax.privacy import ghost_clipping
from dpjax.privacy import losses
from dpjax.privacy import precision
from tests.privacy.ghost_clipping import harness
from dpjax.models import cnn
from dpjax.models import layers
from dpjax.models import mlp
from dpjax.privacy.ghost_clipping import mixed


def test_margins_are_the_closed_form():
  for fmt, u in (('float32', 2**-24), ('tf32', 2**-11), ('bfloat16', 2**-8)):
    ku = precision.KAPPA * u
    assert (1 + ku) / (1 - ku) - 1 == pytest.approx(2 * ku / (1 - ku), rel=1e-9)
  assert precision.clip_margin('highest', 'gpu') == pytest.approx(16 * 2**-24, rel=1e-5)
  assert precision.clip_margin('default', 'cpu') == precision.clip_margin('highest', 'cpu')
  assert precision.clip_margin('default', 'gpu') == pytest.approx(16 * 2**-11 / (1 - 2**-8))
  assert precision.clip_margin('default', 'tpu') == precision.clip_margin('bfloat16', 'cpu')
  assert (
    precision.clip_margin('bfloat16')
    == precision.format_margin('bfloat16')
    == pytest.approx(16 * 2**-8 / (1 - 2**-5))
  )
  with pytest.raises(ValueError, match="config.precision = 'fp16'; valid: default, highest"):
    precision.check_precision('fp16')
  with pytest.raises(ValueError, match='config.precision'):
    dp_step.DPStep.for_model(
      mlp.MLP(3, (4,)),
      optax.sgd(1.0),
      clip_norm=1.0,
      noise_multiplier=1.0,
      expected_batch_size=4,
      precision='fp16',
    )


def test_traced_matmul_format_reads_the_dtype_and_the_precision_setting():
  assert precision.traced_matmul_format(jnp.bfloat16) == 'bfloat16'
  assert precision.traced_matmul_format(jnp.float16) == 'bfloat16'
  for setting, want in (
    ('highest', 'float32'),
    ('float32', 'float32'),
    ('F32_F32_F32', 'float32'),
    ('tensorfloat32', 'tf32'),
    ('high', 'tf32'),
    ('BF16_BF16_F32', 'bfloat16'),
  ):
    with jax.default_matmul_precision(setting):
      assert precision.traced_matmul_format(jnp.float32, 'gpu') == want, setting
      assert precision.traced_matmul_format(jnp.bfloat16, 'gpu') == 'bfloat16'
  for setting in ('default', 'bfloat16'):  # The platform's default format.
    with jax.default_matmul_precision(setting):
      for platform, want in (('cpu', 'float32'), ('gpu', 'tf32'), ('tpu', 'bfloat16')):
        assert precision.traced_matmul_format(jnp.float32, platform) == want


def _config(name, **kw):
  c = models.default_model_config(name)
  c.update(kw)
  return c


class WSConvGroupNorm(nn.Module):
  """harness.AllLayers' WSConv call (WSConv(4, 3x3, stride 2) on the [6, 6, 3] input: S=9, m=27,
  c=4, materialised by the mixed rule) -> GroupNorm -> a rank-1 Dense head."""

  @nn.compact
  def __call__(self, x):
    h = nn.GroupNorm(num_groups=2)(layers.WSConv(4, (3, 3), (2, 2))(x))
    return nn.Dense(3)(jnp.tanh(h).reshape(x.shape[0], -1))


def _model_and_rows(name, n):
  rng = np.random.default_rng(0)
  classes = 10
  if name == 'mlp':
    model, shape = mlp.MLP(10, (64, 32)), (8, 8, 1)
  elif name == 'cnn':
    model, shape = cnn.CNN(10, (8, 16), (3, 3), (1, 2), ('SAME', 'SAME'), 16), (8, 8, 1)
  elif name == 'transformer':  # LayerNorm, attention, a per-example positional embedding.
    shape = (6, 8)
    model = models.make_model(
      _config('transformer', num_layers=1, model_dim=16, mlp_dim=32, num_heads=2), 10, shape
    )
  elif name == 'wsconv_in_ghost_form':
    model, shape, classes = WSConvGroupNorm(), (6, 6, 3), 3
  else:  # 'all_layers': every rule (GroupNorm, WSConv, RMSNorm, Embed, DenseGeneral, ...).
    model, shape, classes = harness.AllLayers(), (6, 6, 3), 3
  x = rng.normal(size=(n, *shape)).astype(np.float32) * 2
  y = rng.integers(0, classes, n).astype(np.int32)
  return model, shape, x, y


@pytest.mark.slow
@pytest.mark.parametrize(
  'name,method',
  [
    ('mlp', 'ghost'),
    ('mlp', 'vmap'),
    ('cnn', 'ghost'),
    ('transformer', 'ghost'),
    ('all_layers', 'ghost'),
    ('wsconv_in_ghost_form', 'ghost'),  # WSConv's ghost form (mixed: materialised).
  ],
)
def test_each_contribution_as_summed_in_bfloat16_has_norm_at_most_c(name, method):
  """One-hot weights materialise example i's contribution exactly as the weighted pass sums it.

  Models with norm layers and WSConv check the rules that re-apply a layer to the captured
  bfloat16 input with the float32 master parameters (they once crashed on the dtypes): all_layers
  has every rule a WRN uses (GroupNorm, WSConv, conv, dense; the WRN itself cost 17 s cold here,
  its float32 ghost norms are test_networks'); their compile time dominates, so only MLP and CNN
  are compared with a float32 step. all_layers runs each rule in the form the mixed rule picks:
  every rule's ghost and materialised forms but WSConv's ghost form, which wsconv_in_ghost_form
  forces on AllLayers' own WSConv call (it was all of AllLayers forced to ghost: a second
  AllLayers bfloat16 program, 3.9 s cold, whose other ghost forms all_layers already runs).
  """
  n, c = 16, 0.05  # C far below every ‖g_i‖: every example is clipped.
  model, shape, x, y = _model_and_rows(name, n)
  with mixed.forced_form(True) if name.endswith('ghost_form') else contextlib.nullcontext():
    if name == 'wsconv_in_ghost_form':  # The form really run: an abstract trace, no compile.
      forms = ghost_clipping.analyse_coverage(
        losses.make_loss_fn(model), harness.init(model, x, seed=0), {'x': x[0], 'y': y[0]}
      ).layer_forms()
      assert forms[0] == 'WSConv_0: wsconv ghost (S=9, m=27, c=4)', forms
    _assert_contributions_at_most_c(name, method, model, shape, x, y, n, c)


def _assert_contributions_at_most_c(name, method, model, shape, x, y, n, c):
  params = harness.init(model, x, seed=0)  # From NumPy: an eager model.init compiles per op.
  step = dp_step.DPStep.for_model(
    model,
    optax.sgd(1.0),
    clip_norm=c,
    noise_multiplier=1.0,
    expected_batch_size=n,
    clipping=method,
    precision='bfloat16',
  )
  margin = precision.clip_margin('bfloat16')
  assert step.clip_bound == c  # Clipped at C itself: the margin is in η, paid in ε.
  reference = name in ('mlp', 'cnn')
  f32 = dp_step.DPStep.for_model(
    model,
    optax.sgd(1.0),
    clip_norm=c,
    noise_multiplier=1.0,
    expected_batch_size=n,
    clipping=method,
    precision='highest',
  )
  ratios, differs = [], []
  for i in range(n):
    batch = {'x': x, 'y': y, 'weight': np.eye(n, dtype=np.float32)[i]}
    acc = step.accumulate(params, step.init_accumulator(params), batch)
    contribution = np.concatenate(
      [np.ravel(np.asarray(g, np.float64)) for g in jax.tree.leaves(acc.grad_sum)]
    )
    norm = np.linalg.norm(contribution)
    assert norm <= c * (1 + margin), (i, norm)  # The guarantee: the margin η counts.
    ratios.append(norm / step.clip_bound)
    if not reference:
      continue
    ref = f32.accumulate(params, f32.init_accumulator(params), batch)
    ref = np.concatenate(
      [np.ravel(np.asarray(g, np.float64)) for g in jax.tree.leaves(ref.grad_sum)]
    )
    differs.append(np.linalg.norm(contribution / norm - ref / np.linalg.norm(ref)))
  assert int(acc.stats.num_clipped) == 1
  # The computation really ran in bfloat16 (directions differ by ~u = 4e-3, not float32's 1e-7),
  # and the clip bound was hit to within the margin.
  assert not reference or np.median(differs) > 1e-4, differs
  assert max(ratios) <= 1 + margin and min(ratios) > 1 - margin, ratios
  assert step.compile_count('accumulate') == 1


@pytest.mark.slow
def test_highest_matches_a_float64_reference():
  n, c = 8, 0.3
  model, shape, x, y = _model_and_rows('mlp', n)
  params = harness.init(model, x, seed=0)
  step = dp_step.DPStep.for_model(
    model,
    optax.sgd(1.0),
    clip_norm=c,
    noise_multiplier=1.0,
    expected_batch_size=n,
    clipping='ghost',
    precision='highest',
  )
  acc = step.accumulate(
    params, step.init_accumulator(params), {'x': x, 'y': y, 'weight': np.ones(n, np.float32)}
  )
  with jax.enable_x64(True):
    p64 = jax.tree.map(lambda v: jnp.asarray(v, jnp.float64), params)
    loss = lambda p, xi, yi: optax.softmax_cross_entropy_with_integer_labels(
      model.apply({'params': p}, xi[None])[0], yi
    )
    grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))(  # One program, not eager.
      p64, jnp.asarray(x, jnp.float64), y
    )
    grads = jax.tree.map(np.asarray, grads)
    norms = np.sqrt(sum(np.sum(np.reshape(g, (n, -1)) ** 2, 1) for g in jax.tree.leaves(grads)))
    bound = step.clip_bound  # C.
    want = jax.tree.map(lambda g: np.tensordot(np.minimum(1, bound / norms), g, axes=1), grads)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), acc.grad_sum, want
  )
  assert step.clip_bound == c
