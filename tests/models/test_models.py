"""dpjax.models.factory: architectures match their papers, examples never mix."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from dpjax.models import factory as models


def _config(name, **overrides):
  c = models.default_model_config(name)
  c.update(overrides)
  return c


def _param_shapes(model, input_shape):
  """The variables' shapes, abstractly: no eager op (each would be its own XLA program)."""
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  x = jax.ShapeDtypeStruct((1, *input_shape), models.input_dtype(model))
  return jax.eval_shape(model.init, key, x)


def _numpy_init(model, input_shape, seed):
  """Fan-in scaled numpy parameters with the model's structure.

  jax.random inside model.init costs seconds of XLA compile per model on a
  small CPU; the properties tested here do not depend on the init.
  """
  rng = np.random.default_rng(seed)

  def leaf(path, s):
    name = path[-1].key
    if name in ('scale', 'gain'):
      return np.ones(s.shape, np.float32)
    if name == 'bias':
      return np.zeros(s.shape, np.float32)
    fan_in = 1 if name == 'embedding' else int(np.prod(s.shape[:-1]))
    return (rng.normal(size=s.shape) / np.sqrt(fan_in)).astype(np.float32)

  shapes = _param_shapes(model, input_shape)['params']
  return jax.tree_util.tree_map_with_path(leaf, shapes)


def _num_params(tree):
  return sum(int(np.prod(l.shape)) for l in jax.tree.leaves(tree))


# Small instances of every model, with an input shape they accept.
SMALL = {
  'mlp': (_config('mlp', hidden_sizes=(16, 8)), (6, 6, 1)),
  'cnn': (_config('cnn', paddings=('SAME', 'SAME')), (8, 8, 1)),
  'wrn': (_config('wrn', depth=10, width=1, groups=4), (8, 8, 3)),
  'transformer_tokens': (
    _config('transformer', vocab_size=20, num_layers=1, model_dim=16, num_heads=2, mlp_dim=32),
    (7,),
  ),
  'transformer_features': (
    _config('transformer', num_layers=1, model_dim=16, num_heads=2, mlp_dim=32),
    (7, 5),
  ),
  'vit': (_config('vit', patch_size=2, num_layers=1, num_heads=2, width=8, mlp_dim=16), (4, 6, 3)),
}


def _inputs(model, input_shape, n, seed=0):
  rng = np.random.default_rng(seed)
  if models.input_dtype(model) == jnp.int32:
    return rng.integers(0, model.vocab_size, size=(n, *input_shape)).astype(np.int32)
  return rng.normal(size=(n, *input_shape)).astype(np.float32)


def test_cnn_is_the_papernot_mnist_architecture():
  # TF Privacy's MNIST tutorial CNN (Papernot et al. 2021): 26,010 parameters.
  model = models.make_model(_config('cnn'), 10, (28, 28, 1))
  p = _param_shapes(model, (28, 28, 1))['params']
  shapes = {k: (v['kernel'].shape, v['bias'].shape) for k, v in p.items()}
  assert shapes == {
    'Conv_0': ((8, 8, 1, 16), (16,)),
    'Conv_1': ((4, 4, 16, 32), (32,)),
    'Dense_0': ((4 * 4 * 32, 32), (32,)),  # 28 -> 14 -> 13 -> 5 -> 4.
    'Dense_1': ((32, 10), (10,)),
  }
  assert _num_params(p) == 26_010


def _wrn_num_params(depth, k, num_classes, in_ch=3):
  """Closed form for our WRN: WS conv = kernel + gain + bias, GN = 2 per ch."""
  conv = lambda cin, cout, ks: ks * ks * cin * cout + 2 * cout
  gn = lambda c: 2 * c
  n = (depth - 4) // 6
  total, cin = conv(in_ch, 16, 3), 16
  for w in (16 * k, 32 * k, 64 * k):
    total += gn(cin) + conv(cin, w, 1)  # Projection shortcut.
    for i in range(n):
      c = cin if i == 0 else w
      total += gn(c) + conv(c, w, 3) + gn(w) + conv(w, w, 3)
    cin = w
  return total + gn(cin) + cin * num_classes + num_classes


@pytest.mark.parametrize('depth,width', [(16, 4), (10, 1), (22, 2)])
def test_wrn_parameter_count_matches_closed_form(depth, width):
  model = models.make_model(_config('wrn', depth=depth, width=width), 10, (32, 32, 3))
  v = _param_shapes(model, (32, 32, 3))
  assert set(v) == {'params'}  # No batch statistics collection.
  assert _num_params(v['params']) == _wrn_num_params(depth, width, 10)
  if (depth, width) == (16, 4):
    assert abs(_num_params(v['params']) - 2.75e6) < 0.01e6  # WRN-16-4: 2.7M.


@pytest.mark.parametrize('kind', sorted(SMALL))
def test_examples_never_mix(kind):
  """Row i of the logits depends on example i only (per-example DP needs it)."""
  cfg, shape = SMALL[kind]
  model = models.make_model(cfg, 3, shape)
  x = _inputs(model, shape, 4)
  params = _numpy_init(model, shape, seed=1)
  apply = jax.jit(lambda x: model.apply({'params': params}, x))
  batched = apply(x)
  assert batched.shape == (4, 3)
  # Changing example 0 leaves the logits of examples 1..3 exactly unchanged.
  x2 = x.copy()
  x2[0] = _inputs(model, shape, 1, seed=7)[0]
  other = apply(x2)
  np.testing.assert_array_equal(other[1:], batched[1:])
  assert not np.allclose(other[0], batched[0])
  # Deterministic: no dropout, no randomness at apply time.
  np.testing.assert_array_equal(apply(x), batched)


@pytest.mark.slow
@pytest.mark.parametrize('kind', sorted(SMALL))
def test_models_fit_a_tiny_batch(kind):
  """Gradients reach every model: 9 Adam steps cut the loss on 8 examples by half.

  Was 25 steps: after 9 the loss is at most 0.25 of the first (MLP; WRN 0.001), and each step of
  the WRN-10 runs ~75 ms at the tests' XLA optimisation level 0 (1.2 s of CPU spared). Without
  gradients the loss would not move: the test still fails."""
  cfg, shape = SMALL[kind]
  model = models.make_model(cfg, 3, shape)
  x = _inputs(model, shape, 8, seed=3)
  y = np.arange(8) % 3
  params = _numpy_init(model, shape, seed=2)
  opt = optax.adam(1e-2)

  def loss(p):
    logits = model.apply({'params': p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def step(p, s):
    l, g = jax.value_and_grad(loss)(p)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, l

  state = jax.jit(opt.init)(params)  # One program, not one eager zeros_like per leaf shape.
  losses = []
  for _ in range(10):  # losses[i] is the loss after i updates.
    params, state, l = step(params, state)
    losses.append(float(l))
  assert losses[-1] < 0.5 * losses[0]


def test_transformer_tokens_use_embedding_and_positions():
  cfg, shape = SMALL['transformer_tokens']
  model = models.make_model(cfg, 3, shape)
  p = _numpy_init(model, shape, seed=0)
  assert p['Embed_0']['embedding'].shape == (20, 16)
  assert p['pos_embedding'].shape == (7, 16)
  apply = jax.jit(model.apply)
  tokens = np.array([[1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1]], np.int32)
  out = apply({'params': p}, tokens)
  # Mean pooling is order-invariant; the positional embedding is what makes a
  # permuted sequence give different logits.
  assert not np.allclose(out[0], out[1], atol=1e-6)
  no_pos = dict(p, pos_embedding=np.zeros_like(p['pos_embedding']))
  out = apply({'params': no_pos}, tokens)
  np.testing.assert_allclose(out[0], out[1], rtol=1e-5, atol=1e-6)


def test_transformer_features_use_dense_projection():
  cfg, shape = SMALL['transformer_features']
  model = models.make_model(cfg, 4, shape)
  assert models.input_dtype(model) == jnp.float32
  p = _param_shapes(model, shape)['params']
  assert p['Dense_0']['kernel'].shape == (5, 16)
  assert 'Embed_0' not in p


@pytest.mark.parametrize(
  'field,value',
  [
    ('normalization', 'batchnorm'),
    ('normalization', 'BatchNorm'),
    ('normalization', 'batch_norm'),
    ('use_batchnorm', True),
  ],
)
@pytest.mark.parametrize('name', models.MODEL_NAMES)
def test_batchnorm_is_rejected_with_reason(name, field, value):
  c = models.default_model_config(name)
  c[field] = value
  with pytest.raises(ValueError, match='BatchNorm is not allowed') as e:
    models.make_model(c, 10, (32, 32, 3))
  assert 'other examples' in str(e.value)


def test_bad_configs_raise_clear_errors():
  with pytest.raises(ValueError, match="valid: \\('mlp', 'cnn', 'wrn'"):
    models.default_model_config('resnet50')
  with pytest.raises(ValueError, match='unknown field'):
    models.make_model(ml_collections.ConfigDict({'name': 'mlp', 'hiden_sizes': (3,)}), 10, (4,))
  with pytest.raises(ValueError, match='normalization'):
    models.make_model(_config('wrn', normalization='layernorm'), 10, (8, 8, 3))
  with pytest.raises(ValueError, match='depth'):
    models.make_model(_config('wrn', depth=12), 10, (8, 8, 3))
  with pytest.raises(ValueError, match='too small'):
    models.make_model(_config('cnn'), 10, (8, 8, 1))  # Paper padding on 8x8.
  with pytest.raises(ValueError, match='must divide'):
    models.make_model(_config('transformer', num_heads=5), 10, (7, 5))
  with pytest.raises(ValueError, match='tokens'):
    models.make_model(_config('transformer', vocab_size=10), 10, (7, 5))
  with pytest.raises(ValueError, match='activation'):
    models.make_model(_config('mlp', activation='sigmoidish'), 10, (4,))


def test_partial_config_takes_defaults():
  # configs/digits_mlp.py sets only name and hidden_sizes.
  c = ml_collections.ConfigDict({'name': 'mlp', 'hidden_sizes': (256, 128)})
  model = models.make_model(c, 10, (8, 8, 1))
  assert model.activation == models.default_model_config('mlp').activation
  assert _num_params(_param_shapes(model, (8, 8, 1))) == (
    64 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
  )


def _vit_num_params(depth, width, mlp, patch, channels, tokens, classes):
  """Closed form: patch conv, positions, per block 2 LN + attention + MLP, final LN, head."""
  block = 2 * 2 * width + 4 * (width * width + width) + (width * mlp + mlp) + (mlp * width + width)
  return (
    (patch * patch * channels * width + width)
    + tokens * width
    + depth * block
    + 2 * width
    + (width * classes + classes)
  )


def test_vit_s4_parameter_count_matches_closed_form():
  """ViT-S/4 on CIFAR-10, at the default config's depth L counted as c(1) + (L − 1)·(c(2) − c(1))
  from its identical blocks (tracing all 12 blocks: 0.65 s of CPU; 1 and 2 blocks: 0.2 s)."""
  depth = models.default_model_config('vit').num_layers
  assert depth == 12
  c1, c2 = (
    _param_shapes(models.make_model(_config('vit', num_layers=l), 10, (32, 32, 3)), (32, 32, 3))[
      'params'
    ]
    for l in (1, 2)
  )
  count = _num_params(c1) + (depth - 1) * (_num_params(c2) - _num_params(c1))
  assert count == _vit_num_params(12, 384, 1536, 4, 3, 64, 10)
  assert abs(count - 21.4e6) < 0.1e6  # ViT-S/4 on 32x32x3: 21.4M.
  assert c1['pos_embedding'].shape == (64, 384)
  with pytest.raises(ValueError, match='multiples of config.model.patch_size=4'):
    models.make_model(_config('vit'), 10, (30, 32, 3))
  with pytest.raises(ValueError, match='must divide width'):
    models.make_model(_config('vit', num_heads=5), 10, (32, 32, 3))
