"""dpjax.ghost_clipping against per-example gradients (the vmap path)."""

import logging
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from dpjax import clipping
from dpjax import dp_step
from dpjax import ghost_clipping
from dpjax import models

K = 3  # Classes.


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """Matmuls in float32 on every backend (GPUs default to TF32): these tests
  compare with float64 or float32 references at float32 tolerances."""
  with jax.default_matmul_precision('highest'):
    yield


class AllLayers(nn.Module):
  """Every covered layer type, each on its own branch of a [6, 6, 3] input.

  Shapes exercise both branches of the mixed rule (ghost when
  S·(m + c) < m·c, else materialised): see the comment on each layer.
  """

  @nn.compact
  def __call__(self, x):
    n = x.shape[0]
    seq = x.reshape(n, 6, 18)
    tokens = jnp.floor(jnp.abs(x[:, :, 0, 0]) * 2).astype(jnp.int32)  # Repeats.
    gn_in = nn.Conv(4, (3, 3), strides=2)(x)  # S=9, m=27, c=4: materialised.
    branches = [
        nn.Dense(5)(x.reshape(n, -1)),  # One vector per example: S = 1.
        nn.Dense(16)(seq),  # S=6, m=18, c=16: ghost.
        nn.Dense(2)(seq),  # Materialised.
        nn.DenseGeneral((4, 8))(seq),  # Ghost.
        nn.DenseGeneral(5, axis=(-2, -1))(x),  # Two contracted axes.
        nn.Conv(3, (2, 3), padding='VALID', kernel_dilation=(2, 1))(x),
        nn.Conv(32, (3, 3), strides=3, padding=((1, 0), (2, 1)))(x),  # Ghost.
        nn.Conv(3, (3,), use_bias=False)(seq),  # 1-D.
        nn.Embed(50, 4)(tokens),  # V > S: ghost with [tok_s = tok_s'].
        nn.Embed(3, 4)(tokens % 3),  # V <= S: one-hot, materialised.
        nn.LayerNorm()(seq),
        nn.RMSNorm()(seq),
        nn.GroupNorm(num_groups=2)(gn_in),
        models.WSConv(4, (3, 3), (2, 2))(x),
    ]
    h = jnp.concatenate([jnp.tanh(b).reshape(n, -1) for b in branches], -1)
    return nn.Dense(K)(h)


def _init(model, x, seed):
  """Random parameters from numpy (jax.random in init compiles slowly).

  Kernels N(0, 1/fan_in); scales and gains 1 + N(0, 0.09), so norm layers
  are not at their identity initialisation; other vectors N(0, 0.09).
  """
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                             x[:1]))['params']
  rng = np.random.default_rng(seed)

  def draw(path, s):
    name = str(getattr(path[-1], 'key', path[-1]))
    if len(s.shape) >= 2:
      return (rng.normal(size=s.shape) /
              np.sqrt(np.prod(s.shape[:-1]))).astype(np.float32)
    return (float(name in ('scale', 'gain')) +
            0.3 * rng.normal(size=s.shape)).astype(np.float32)
  return jax.tree_util.tree_map_with_path(draw, shapes)


def _inputs(shape, n, seed, vocab=0):
  rng = np.random.default_rng(seed)
  if vocab:
    x = rng.integers(0, vocab, (n, *shape)).astype(np.int32)
  else:
    x = rng.normal(size=(n, *shape)).astype(np.float32)
  return x, rng.integers(0, K, n).astype(np.int32)


def _compare(loss_fn, params, batch):
  """Per-example ‖g_i‖² per layer both ways, and both clipped sums.

  One vmap pass and one ghost pass, each feeding the same clipping code as
  `per_example_clipped_sum` / `ghost_clipped_sum` (halves the compile time).
  C is between the middle two finite norms, so about half the rows are
  clipped.
  """
  examples, w = clipping.examples_of(batch), batch['weight']
  y = batch['y']
  (losses, aux), grads = jax.vmap(
      jax.value_and_grad(loss_fn, has_aux=True), in_axes=(None, 0))(params, examples)
  want = {}
  for path, g in zip(ghost_clipping._leaf_paths(grads), jax.tree.leaves(grads)):
    key = '/'.join(path if path[0] == 'pos_embedding' else path[:-1])
    want[key] = want.get(key, 0.0) + jnp.sum(jnp.square(g.reshape(len(y), -1)),
                                             axis=1)
  ghost = ghost_clipping.ghost_pass(loss_fn, params, examples)
  total = sum(want.values())
  finite = jnp.sort(jnp.where(jnp.isfinite(total), total, jnp.inf))
  m = jnp.sum(jnp.isfinite(total)) // 2
  clip = jnp.sqrt((finite[m - 1] + finite[m]) / 2)
  ref, ref_rows = clipping._clip_and_sum(
      losses, aux, total,
      lambda f, keep: clipping._weighted_row_sum(f, grads, keep), w, clip)
  got, rows = clipping._clip_and_sum(ghost.losses, ghost.aux, ghost.sq_norms,
                                     ghost.weighted_sum, w, clip)
  return (want, ghost.sq_norms_by_path, (got, clipping.ClipStats.of(rows, w, clip)),
          (ref, clipping.ClipStats.of(ref_rows, w, clip)))


def _assert_matches_vmap(model, x, y, num_pad=3):
  """Norms and clipped sums equal the vmap path, on a batch with padding
  rows (garbage copies of real rows, weight 0), one NaN and one inf row."""
  loss_fn = dp_step.make_loss_fn(model)
  params = _init(model, x, seed=int(np.sum(y)))
  coverage = ghost_clipping.analyse_coverage(loss_fn, params, {'x': x[0], 'y': y[0]})
  assert coverage.complete, coverage.describe()
  n = len(y)
  x = np.concatenate([x, x[:num_pad]])
  floats = x.dtype == np.float32
  if floats:  # Real rows 1, 2 and the first padding row become non-finite.
    x[1].flat[3], x[2].flat[0], x[n].flat[5] = np.nan, np.inf, np.nan
  batch = {'x': x, 'y': np.concatenate([y, y[:num_pad]]),
           'weight': np.r_[np.ones(n), np.zeros(num_pad)].astype(np.float32)}
  want, got, (ghost, stats), (ref, ref_stats) = jax.jit(
      _compare, static_argnums=0)(loss_fn, params, batch)
  assert set(got) == set(want)
  ok = np.isfinite(sum(want.values()))
  assert np.sum(ok) == n + num_pad - 3 * floats
  for path in want:
    # Never below the per-example gradient's norm; above it by at most the cancellation
    # allowances (mixed.with_allowance, conv.ws_allowance: ~1e-5 relative in float32).
    np.testing.assert_array_less(want[path][ok] * (1 - 2e-5), got[path][ok], err_msg=path)
    np.testing.assert_allclose(got[path][ok], want[path][ok], rtol=2e-4, err_msg=path)
  assert not np.isfinite(sum(got.values())[~ok]).any()
  assert all(np.isfinite(l).all() for l in jax.tree.leaves(ghost))
  scale = max(float(np.max(np.abs(l))) for l in jax.tree.leaves(ref))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-4, atol=1e-5 * scale), ghost, ref)
  for field in clipping.ClipStats._fields:
    np.testing.assert_allclose(getattr(stats, field),
                               getattr(ref_stats, field), rtol=1e-5)
  assert 0 < int(stats.num_clipped) < n
  assert int(stats.num_nonfinite) == 2 * floats  # Padding is not counted.
  return coverage


def test_every_layer_type_matches_per_example_gradients():
  x, y = _inputs((6, 6, 3), 7, seed=100)
  coverage = _assert_matches_vmap(AllLayers(), x, y)
  assert {l.rule for l in coverage.layers} == set(ghost_clipping.RULES.values())
  assert not coverage.materialised
  assert len(coverage.layers) == 16


# The form each AllLayers call takes by the mixed rule (its shapes; see the comments there).
ALL_LAYERS_FORMS = [
    'Conv_0: conv materialised (S=9, m=27, c=4)',
    'Dense_0: dense rank-1 (S=1, m=108, c=5)',
    'Dense_1: dense ghost (S=6, m=18, c=16)',
    'Dense_2: dense materialised (S=6, m=18, c=2)',
    'DenseGeneral_0: dense_general ghost (S=6, m=18, c=32)',
    'DenseGeneral_1: dense_general materialised (S=6, m=18, c=5)',
    'Conv_1: conv materialised (S=16, m=18, c=3)',
    'Conv_2: conv ghost (S=6, m=27, c=32)',
    'Conv_3: conv materialised (S=6, m=54, c=3)',
    'Embed_0: embed ghost (T=6 tokens, V=50, D=4)',
    'Embed_1: embed materialised (T=6 tokens, V=3, D=4)',
    'LayerNorm_0: norm per-example vjp',
    'RMSNorm_0: norm per-example vjp',
    'GroupNorm_0: norm per-example vjp',
    'WSConv_0: wsconv materialised (S=9, m=27, c=4)',
    'Dense_3: dense rank-1 (S=1, m=929, c=3)',
]


def test_layer_forms_follow_the_mixed_rule_from_each_calls_shapes():
  x, y = _inputs((6, 6, 3), 7, seed=100)
  model = AllLayers()
  coverage = ghost_clipping.analyse_coverage(
      dp_step.make_loss_fn(model), _init(model, x, seed=1), {'x': x[0], 'y': y[0]})
  assert coverage.layer_forms() == ALL_LAYERS_FORMS
  for line in ALL_LAYERS_FORMS:  # The logged choice is the rule's: S(m + c) < m·c.
    if match := re.search(r'(ghost|materialised) \(S=(\d+), m=(\d+), c=(\d+)\)', line):
      s, m, c = map(int, match.groups()[1:])
      assert (match[1] == 'ghost') == (s * (m + c) < m * c), line


@pytest.mark.parametrize('ghost', [True, False], ids=['all_ghost', 'all_materialised'])
def test_ghost_and_materialised_forms_give_the_same_clipped_sum_for_every_layer(ghost):
  """Each layer forced to one form of the mixed rule (and Embed's): norms and clipped
  sums still equal the per-example gradients', and the logged forms say so."""
  x, y = _inputs((6, 6, 3), 7, seed=100)
  with ghost_clipping.mixed.forced_form(ghost):
    coverage = _assert_matches_vmap(AllLayers(), x, y)
    forms = coverage.layer_forms()
  assert coverage.layer_forms() == ALL_LAYERS_FORMS  # The mixed rule again outside.
  want = 'ghost' if ghost else 'materialised'
  for line in forms:
    name, rule, form = line.split(' ', 2)
    if rule == 'norm':  # One form: a vjp of the layer per example.
      assert form == 'per-example vjp', line
    else:  # S = 1: ‖a‖²‖δ‖², exact in both forms.
      assert form.startswith('rank-1' if '(S=1,' in form else want), line


def _config(name, **kw):
  c = models.default_model_config(name)
  c.update(kw)
  return c


MODELS = {
    'mlp': (ml_collections.ConfigDict({'name': 'mlp', 'hidden_sizes': (16,)}),
            (6, 6, 1), 0),
    'cnn': (models.default_model_config('cnn'), (28, 28, 1), 0),
    # WRN structure (stem, 3 groups with projection shortcuts and strides
    # 1, 2, 2, GroupNorm, weight standardisation) at depth 10, width 1 for
    # compile time; scripts/bench_clipping.py checks WRN-16-4 itself.
    'wrn_10_1': (_config('wrn', depth=10, width=1), (8, 8, 3), 0),
    'transformer_features': (_config('transformer', num_layers=1, model_dim=16,
                                     mlp_dim=32, num_heads=2), (5, 6), 0),
    'transformer_tokens': (_config('transformer', vocab_size=11, num_layers=1,
                                   model_dim=16, mlp_dim=32, num_heads=2),
                           (7,), 11),
    'vit': (_config('vit', patch_size=2, num_layers=1, num_heads=2, width=8, mlp_dim=16),
            (4, 6, 3), 0),
}


@pytest.mark.parametrize('name', sorted(MODELS))
def test_each_model_matches_per_example_gradients(name):
  cfg, shape, vocab = MODELS[name]
  model = models.make_model(cfg, K, shape)
  x, y = _inputs(shape, 6, seed=200 + sorted(MODELS).index(name), vocab=vocab)
  coverage = _assert_matches_vmap(model, x, y)
  if name.startswith('transformer') or name == 'vit':  # Declared in the model body.
    assert coverage.materialised == (('pos_embedding',),)
  else:
    assert not coverage.materialised
  if name == 'wrn_10_1':
    assert sum(l.rule.name == 'wsconv' for l in coverage.layers) == 10


def test_patches_times_kernel_is_the_convolution():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 7, 6, 3)).astype(np.float32)
  w = rng.normal(size=(3, 2, 3, 4)).astype(np.float32)
  for strides, padding, dilation in (((1, 1), 'SAME', (1, 1)),
                                     ((2, 3), 'VALID', (2, 1)),
                                     ((2, 1), ((1, 2), (0, 1)), (1, 2))):
    want = jax.lax.conv_general_dilated(
        x, w, strides, padding, rhs_dilation=dilation,
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    p = ghost_clipping._patches(x, (3, 2), strides, padding, dilation)
    got = (p @ w.reshape(-1, 4)).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_scanned_and_unrolled_conv_blocks_agree(monkeypatch):
  """Large convs visit their kernel offsets with lax.scan (the model tests
  use small convs, which are unrolled): both give the same norms."""
  rng = np.random.default_rng(2)
  cases = [(nn.Conv(4, (3, 3)), (9, 9, 3)),  # Materialised.
           (nn.Conv(32, (3, 3), strides=3), (6, 6, 3)),  # Ghost.
           (models.WSConv(4, (3, 3)), (9, 9, 3)),
           (models.WSConv(32, (3, 3), (3, 3)), (6, 6, 3))]
  for module, shape in cases:
    x = rng.normal(size=(3, 1, *shape)).astype(np.float32)
    theta = jax.tree.map(np.asarray, _init(module, x[0], seed=2))
    out = jax.eval_shape(lambda: module.apply({'params': theta}, x[0]))
    d = rng.normal(size=(3, *out.shape)).astype(np.float32)
    layer = ghost_clipping.Layer(None, ghost_clipping.RULES[type(module)],
                                 module, (), tuple(theta), None, None)
    sq = {}
    for unroll_bytes in (2**40, 0):
      monkeypatch.setattr(ghost_clipping.conv, '_UNROLL_BYTES', unroll_bytes)
      sq[unroll_bytes] = jax.jit(lambda a, d: ghost_clipping._layer_norms(
          layer, theta, a, d)[0])(x, d)
    np.testing.assert_allclose(sq[0], sq[2**40], rtol=1e-5)


def test_linear_rule_both_branches_equal_the_frobenius_norm():
  rng = np.random.default_rng(1)
  branches = set()
  for s, m, c in ((1, 5, 4), (3, 20, 30), (40, 3, 2)):
    a = rng.normal(size=(4, s, m)).astype(np.float32)
    d = rng.normal(size=(4, s, c)).astype(np.float32)
    blocks = ghost_clipping._Blocks(lambda k: jnp.asarray(a), 1, m)
    sq, _ = ghost_clipping._linear_sq_norm(blocks, jnp.asarray(d))
    want = np.sum(np.einsum('nsm,nsc->nmc', a.astype(np.float64), d)**2,
                  axis=(1, 2))
    np.testing.assert_allclose(sq, want, rtol=1e-5)
    branches.add(ghost_clipping._use_ghost(s, m, c))
  assert branches == {True, False}


class Scaled(nn.Module):
  """A layer ghost clipping has no rule for."""

  @nn.compact
  def __call__(self, x):
    return x * self.param('gain', nn.initializers.ones, (x.shape[-1],))


class Uncovered(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(K)(jnp.tanh(Scaled()(nn.Dense(4)(x))))


class Tied(nn.Module):
  """Embedding reused as the output layer (weight tying)."""

  @nn.compact
  def __call__(self, x):
    embed = nn.Embed(K, 4)
    return embed.attend(jnp.mean(embed(x), axis=-2))


class Shared(nn.Module):
  """One Dense applied twice."""

  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(x.shape[-1])
    return nn.Dense(K)(dense(jnp.tanh(dense(x))))


def test_coverage_reports_what_it_cannot_prove():
  cases = [(Uncovered(), (5,), 0,
            {'Scaled_0/gain': 'Scaled has no ghost rule'}),
           (Tied(), (4,), K, {'Embed_0/embedding': 'called 2 times'}),
           (Shared(), (5,), 0, {'Dense_0/kernel': 'called 2 times',
                                'Dense_0/bias': 'called 2 times'})]
  for model, shape, vocab, want in cases:
    x, y = _inputs(shape, 2, seed=4, vocab=vocab)
    params = _init(model, x, seed=4)
    cov = ghost_clipping.analyse_coverage(dp_step.make_loss_fn(model),
                                          params, {'x': x[0], 'y': y[0]})
    got = dict(cov.uncovered)
    assert set(got) == set(want), cov.describe()
    for path, reason in want.items():
      assert reason in got[path]


def test_parameter_used_outside_its_layer_is_uncovered():
  """A loss term on a kernel changes g_i: the dependency proof catches it."""
  model = models.MLP(K, (4,))
  x, y = _inputs((5,), 2, seed=5)
  params = _init(model, x, seed=5)

  def loss_fn(p, example):
    loss, aux = dp_step.make_loss_fn(model)(p, example)
    return loss + 0.1 * jnp.sum(p['Dense_1']['kernel']**2), aux
  cov = ghost_clipping.analyse_coverage(loss_fn, params, {'x': x[0], 'y': y[0]})
  assert {p for p, _ in cov.uncovered} == {'Dense_1/kernel', 'Dense_1/bias'}
  assert 'outside the layer call' in dict(cov.uncovered)['Dense_1/kernel']
  assert len(cov.layers) == 1


def test_auto_falls_back_to_vmap_with_a_log_line_and_ghost_raises(caplog):
  model = Uncovered()
  x, y = _inputs((5,), 4, seed=6)
  params = _init(model, x, seed=6)
  batch = {'x': x, 'y': y, 'weight': np.ones(4, np.float32)}
  loss_fn = dp_step.make_loss_fn(model)
  auto = clipping.make_clipped_sum_fn('auto', loss_fn, 0.1)
  with caplog.at_level(logging.INFO, logger='root'):
    (got, _), (want, _) = jax.jit(lambda p, b: (
        auto(p, b), clipping.per_example_clipped_sum(loss_fn, p, b, 0.1)))(
            params, batch)
  assert any('Scaled_0/gain' in r.getMessage() and 'vmap' in r.getMessage()
             for r in caplog.records)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               got, want)
  with pytest.raises(ValueError, match='Scaled_0/gain'):
    jax.jit(clipping.make_clipped_sum_fn('ghost', loss_fn, 0.1))(params, batch)


def test_auto_picks_ghost_for_covered_models(caplog):
  model = models.MLP(K, (8,))
  x, y = _inputs((5,), 4, seed=7)
  params = _init(model, x, seed=7)
  batch = {'x': x, 'y': y, 'weight': np.ones(4, np.float32)}
  with caplog.at_level(logging.INFO, logger='root'):
    fn = jax.jit(clipping.make_clipped_sum_fn(
        'auto', dp_step.make_loss_fn(model), 0.1))
    jax.block_until_ready(fn(params, batch))
  messages = [r.getMessage() for r in caplog.records]
  assert any('ghost clipping: 2 layers' in m for m in messages), messages
  assert not any('vmap' in m for m in messages)


def test_dp_step_auto_is_ghost_equals_vmap_and_compiles_once(caplog):
  model = models.MLP(K, (8,))
  x, y = _inputs((5,), 11, seed=8)
  params = _init(model, x, seed=8)
  batches = []
  for i in range(3):  # K = 3 physical batches of P = 4, one padding row.
    xb, yb = x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]
    pad = 4 - len(yb)
    batches.append({'x': np.concatenate([xb, np.full((pad, 5), np.nan,
                                                      np.float32)]),
                    'y': np.r_[yb, np.zeros(pad, np.int32)],
                    'weight': np.r_[np.ones(len(yb)),
                                    np.zeros(pad)].astype(np.float32)})
  results = {}
  with caplog.at_level(logging.INFO, logger='root'):
    for method in ('vmap', 'auto'):
      step = dp_step.DPStep(model, optax.sgd(0.5), clip_norm=0.3,
                            noise_multiplier=1.0, expected_batch_size=11,
                            clipping=method)
      opt_state = step.optimizer.init(params)
      p = params
      for t in range(2):
        acc = step.init_accumulator(p)
        for b in batches:
          acc = step.accumulate(p, acc, b)
        p, opt_state, metrics = step.apply(p, opt_state, acc, t)
      assert step.compile_count('accumulate') == 1
      assert step.compile_count('apply') == 1
      results[method] = (p, metrics)
  assert sum("clipping='auto': ghost clipping" in r.getMessage()
             for r in caplog.records) == 1  # Decided once, at trace time.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6),
               results['auto'][0], results['vmap'][0])
  for k in ('loss', 'num_clipped', 'num_examples', 'example_grad_norm',
            'grad_norm', 'noisy_grad_norm'):
    np.testing.assert_allclose(results['auto'][1][k], results['vmap'][1][k],
                               rtol=1e-5)
  assert float(results['auto'][1]['num_examples']) == 11
  assert int(results['auto'][1]['num_clipped']) > 0


class QuietDense(nn.Dense):
  """A user's Dense that changes only a default: same __call__, so the Dense rule applies."""
  use_bias: bool = False


class DoubledDense(nn.Dense):
  """Overrides __call__: it may compute anything, so no rule may be assumed."""

  def __call__(self, x):
    return 2.0 * super().__call__(x)


class SubclassedLayers(nn.Module):
  second: type = QuietDense

  @nn.compact
  def __call__(self, x):
    x = x.reshape((x.shape[0], -1))
    return self.second(K)(jnp.tanh(QuietDense(6)(x)))


def test_subclass_keeping_call_uses_the_rule_and_matches_per_example_gradients():
  x, y = _inputs((8,), 6, seed=300)
  coverage = _assert_matches_vmap(SubclassedLayers(), x, y)
  assert [l.rule.name for l in coverage.layers] == ['dense', 'dense']


def test_subclass_overriding_call_is_named_as_uncovered():
  model = SubclassedLayers(second=DoubledDense)
  x, y = _inputs((5,), 2, seed=301)
  params = _init(model, x, seed=301)
  cov = ghost_clipping.analyse_coverage(dp_step.make_loss_fn(model), params, {'x': x[0], 'y': y[0]})
  reasons = dict(cov.uncovered)
  assert set(reasons) == {'DoubledDense_0/kernel', 'DoubledDense_0/bias'}
  assert 'DoubledDense subclasses Dense but overrides __call__' in reasons['DoubledDense_0/kernel']
  assert 'DoubledDense' in cov.describe()


def test_clipping_code_does_not_import_models():
  """The rules live in dpjax.ghost_clipping; models register theirs (WSConv), not vice versa."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  code = ('import sys; import dpjax.ghost_clipping, dpjax.clipping; '
          'print("dpjax.models" in sys.modules)')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == 'False'
  assert models.WSConv in ghost_clipping.RULES  # Registered by dpjax.models itself.
