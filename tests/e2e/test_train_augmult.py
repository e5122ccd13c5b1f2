"""Augmentation multiplicity in the DP step and the trainer (De et al. 2022, dpjax.privacy.augmult).

The references are independent of the code under test: views from
`augmult.make_views` called directly, the view-mean loss from
`augmult.mean_over_views` (a vmap over views of the ordinary single-example
loss), per-example gradients by `jax.vmap(jax.grad)` in float64, clipped once.
"""

import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.privacy import augmult
from dpjax.trainer.workdir import checkpoints
from dpjax.data import device as device_data
from dpjax.privacy import dp_step
from dpjax.models import factory as models
from dpjax.models import layers
from dpjax import train
from tests.run_configs import small_config
from dpjax.privacy import losses
from dpjax.privacy import ghost_clipping
from dpjax.privacy import prng
from tests.privacy.ghost_clipping import harness

SEED, STEP, C, SIGMA, B = 5, 3, 0.5, 0.7, 6.0


class _AllLayersOnViews(nn.Module):
  """harness.AllLayers behind a parameter declared in the model body (materialised, like a
  ViT's pos_embedding), and wider layers that stay in the ghost form on K = 3 views.

  The K views of an example are positions to ghost clipping (S grows K-fold), so most of
  AllLayers' calls turn materialised here; the wide branch keeps the ghost form of dense
  (S=9, m=36, c=64), dense_general (S=9, m=36, c=64), conv and WSConv (S=12, m=27, c=64)."""

  @nn.compact
  def __call__(self, x):
    n = x.shape[0]
    x = x + self.param('pos_embedding', nn.initializers.normal(0.5), x.shape[1:])
    seq = x.reshape(n, 3, 36)
    wide = [
      nn.Dense(64)(seq),
      nn.DenseGeneral((4, 16))(seq),
      nn.Conv(64, (3, 3), strides=3)(x),
      layers.WSConv(64, (3, 3), (3, 3))(x),
    ]
    h = jnp.concatenate([jnp.mean(jnp.tanh(w).reshape(n, -1, 64), 1) for w in wide], -1)
    return harness.AllLayers()(x) + nn.Dense(harness.K)(h)


def _assert_every_rule_in_both_forms_on_views(model, params, buffer):
  """The all_layers program holds each linear rule's ghost and materialised forms on K = 3
  views (so the comparison below covers both)."""
  views = np.stack([buffer['x'][0, 0]] * 3)
  coverage = ghost_clipping.analyse_coverage(
    losses.make_loss_fn(model, views=True), params, {'x': views, 'y': buffer['y'][0, 0]}
  )
  forms = {tuple(line.split(' ')[1:3]) for line in coverage.layer_forms()}
  for rule in ('dense', 'dense_general', 'conv', 'wsconv', 'embed'):
    assert {(rule, 'ghost'), (rule, 'materialised')} <= forms, (rule, forms)
  assert coverage.materialised == (('pos_embedding',),)


def _model(name):
  if name == 'all_layers':
    return _AllLayersOnViews()
  cfg = models.default_model_config(name)
  if name == 'cnn':
    cfg.strides = (1, 2)
    cfg.features, cfg.kernel_sizes, cfg.paddings, cfg.hidden_size = (
      (3, 4),
      (3, 2),
      ('SAME', 'SAME'),
      5,
    )
  else:
    cfg.hidden_sizes = (7,)
  return models.make_model(cfg, 4, SHAPE[name][0])


# Input shape and classes per model: AllLayers reads [6, 6, 3] images, 3 classes.
SHAPE = {'mlp': ((6, 6, 2), 4), 'cnn': ((6, 6, 2), 4), 'all_layers': ((6, 6, 3), harness.K)}


def _init(model, name):
  """Parameters from NumPy (`harness.init`): an eager model.init compiles a program per op
  and leaf shape (~200 for the all_layers model)."""
  return harness.init(model, np.zeros((1, *SHAPE[name][0]), np.float32), seed=0)


def _buffer(k_max=2, p=4, real=6, seed=0, name='mlp'):
  """A logical buffer [k_max, p] with `real` real rows, the rest padding (weight 0)."""
  rng = np.random.default_rng(seed)
  shape, classes = SHAPE[name]
  x = rng.normal(size=(k_max, p, *shape)).astype(np.float32)
  y = rng.integers(0, classes, size=(k_max, p)).astype(np.int32)
  index = rng.permutation(100)[: k_max * p].reshape(k_max, p).astype(np.int32)
  weight = (np.arange(k_max * p) < real).reshape(k_max, p).astype(np.float32)
  return {'x': x, 'y': y, 'weight': weight, 'index': index}


def _run(step, params, opt, buffer):
  """train_step on a copy of params (train_step donates its inputs)."""
  params = jax.tree.map(lambda p: jax.device_put(np.array(p)), params)  # No copy program.
  return step.train_step(params, opt.init(params), buffer, np.int32(2), np.uint32(STEP))[0]


def _reference_update(model, params, buffer, k, spec, clip_bound):
  """Params after one DP step computed without DPStep's augmult code (float64), and how many
  real rows the clip scaled down."""
  loss = augmult.mean_over_views(losses.make_loss_fn(model))
  grad = jax.jit(jax.grad(lambda p, v, y: loss(p, {'x': v, 'y': y})[0]))
  total = jax.tree.map(lambda p: np.zeros(p.shape, np.float64), params)
  clipped = 0
  p64 = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
  # The views as float32 programs draw them (under x64, randint draws other bits).
  all_views = [
    np.asarray(
      augmult.make_views(
        buffer['x'][i],
        buffer['index'][i],
        STEP,
        seed=SEED,
        num_views=spec.num_views,
        crop_padding=spec.crop_padding,
        flip=spec.flip,
      ),
      np.float64,
    )
    for i in range(k)
  ]
  with jax.enable_x64(True), jax.default_matmul_precision('highest'):
    for i, views in enumerate(all_views):
      for r in range(views.shape[0]):
        if buffer['weight'][i, r] == 0:
          continue
        g = jax.tree.map(np.asarray, grad(p64, views[r], buffer['y'][i, r]))
        # In NumPy: eager jnp ops would compile one program per leaf shape.
        norm = np.sqrt(sum(np.sum(np.square(gi)) for gi in jax.tree.leaves(g)))
        scale = min(1.0, clip_bound / norm)  # The step's C'' (precision and sum margins).
        clipped += scale < 1
        total = jax.tree.map(lambda t, gi: t + scale * gi, total, g)
  noise = _leaf_normals(prng.noise_key(SEED, STEP), params)
  update = jax.tree.map(
    lambda p, s, z: (
      np.asarray(p, np.float64) - 0.1 * (s + SIGMA * C * np.asarray(z, np.float64)) / B
    ),
    params,
    total,
    noise,
  )
  return update, clipped


@jax.jit
def _leaf_normals(key, params):
  """`optax.tree.random_like(key, params, jax.random.normal)`, bit for bit, in one sampler.

  Leaf i's normals are those of key i of `split(key, L)` (what random_like draws); with
  partitionable threefry (JAX's default) element j of a draw depends only on its key and j, so
  leaf i is the first `size_i` of one [L, max size] vmapped draw, reshaped. One sampler instead
  of one per leaf: the all_layers reference 4.7 -> 0.6 s CPU cold (41 leaves). Were the bits
  ever other than random_like's, the comparison with train_step would fail, not pass.
  """
  leaves, tree = jax.tree.flatten(params)
  n = max(leaf.size for leaf in leaves)
  keys = jax.random.split(key, len(leaves))
  z = jax.vmap(lambda k: jax.random.normal(k, (n,)))(keys)
  return tree.unflatten([z[i, : x.size].reshape(x.shape) for i, x in enumerate(leaves)])


@pytest.mark.slow
# Every ghost-clipping rule (dense, dense_general, conv, embed, norms, WSConv, a body-declared
# parameter) runs on the K views in the all_layers program, each linear rule in both forms (it
# replaced WRN-10-1 and ViT here: 65 s and 27 s cold; their whole networks are checked without
# views in test_networks); the
# vmap road is the same for every model, checked on the CNN (the crops reach a conv); the MLP
# is the smallest ghost case (the CNN's ghost case, 3.5 s, is in all_layers: four convs).
@pytest.mark.parametrize(
  'name, clipping',
  [
    ('mlp', 'ghost'),
    ('cnn', 'vmap'),
    ('all_layers', 'ghost'),
  ],
)
def test_train_step_clips_the_view_mean_once(name, clipping):
  """train_step with K = 3 views (crops + flips made in the program) equals the reference:
  each example's gradient averaged over its views, clipped once to C, summed, noised."""
  model = _model(name)
  spec = augmult.Augmult(3, crop_padding=1, flip=True)
  step = dp_step.DPStep.for_model(
    model,
    optax.sgd(0.1),
    clip_norm=C,
    noise_multiplier=SIGMA,
    expected_batch_size=B,
    clipping=clipping,
    seed=SEED,
    augmult=spec,
    precision='highest',
    physical_loop='device',
    allow_repeated_steps=True,
  )  # Steps compared under one noise.
  params = _init(model, name)
  buffer = _buffer(name=name)
  if name == 'all_layers':
    _assert_every_rule_in_both_forms_on_views(model, params, buffer)
  expected, clipped = _reference_update(model, params, buffer, 2, spec, step.clip_bound)
  assert clipped > 0  # The clip is exercised (C is below some view-mean gradient's norm).
  new, _, metrics = step.train_step(
    params, optax.sgd(0.1).init(params), buffer, np.int32(2), np.uint32(STEP)
  )
  assert float(metrics['num_examples']) == 6
  for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_views_differ_from_identity_one_view_is_the_ordinary_step_and_padded_rows_add_nothing():
  model = _model('mlp')
  kw = dict(
    clip_norm=C,
    noise_multiplier=SIGMA,
    expected_batch_size=B,
    seed=SEED,
    precision='highest',
    physical_loop='device',
    allow_repeated_steps=True,
  )  # Steps compared under one noise.
  params = _init(model, 'mlp')
  opt = optax.sgd(0.1)
  buffer = _buffer()
  # K = 3 views, ghost clipping: the program of test_train_step_clips_the_view_mean_once[mlp-ghost]
  # (the same model, buffer shapes and options), loaded from the persistent compilation cache.
  on = dp_step.DPStep.for_model(
    model, opt, augmult=augmult.Augmult(3, crop_padding=1, flip=True), clipping='ghost', **kw
  )
  off = dp_step.DPStep.for_model(model, opt, **kw)
  a, b = _run(on, params, opt, buffer), _run(off, params, opt, buffer)
  assert not np.allclose(jax.tree.leaves(a)[0], jax.tree.leaves(b)[0])  # The views are used.
  # One view is the ordinary step (augmult dropped, the same program as `off`).
  one = dp_step.DPStep.for_model(
    model,
    opt,
    augmult=augmult.Augmult.of(small_config(**{'augmult.num_views': 1}).augmult.num_views),
    **kw,
  )
  assert one.augmult is None
  for u, v in zip(jax.tree.leaves(_run(one, params, opt, buffer)), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
  garbage = {**buffer, 'x': buffer['x'].copy()}
  garbage['x'][buffer['weight'] == 0] = np.nan  # Padding rows: non-finite inputs, weight 0.
  c = _run(on, params, opt, garbage)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(c)):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_host_buffer_carries_the_example_indices():
  from dpjax.privacy import batching
  from dpjax.data import sources as data  # pylint: disable=import-outside-toplevel

  config = small_config()
  source, _ = data.make_sources(config.data, seed=0)
  logical = batching.LogicalBatch(
    indices=np.array([[3, 9], [4, 0]]),
    weights=np.array([[1.0, 1.0], [1.0, 0.0]], np.float32),
    size=3,
    truncated=False,
    step=0,
  )
  buffer, k = device_data.host_buffer(source, logical, 3)
  assert int(k) == 2
  np.testing.assert_array_equal(buffer['index'][:2], [[3, 9], [4, 0]])
  np.testing.assert_array_equal(buffer['x'][0, 1], source.gather(np.array([9]))['x'][0])


AUGMULT = {'augmult.num_views': 3, 'augmult.crop_padding': 1, 'augmult.flip': True}


@pytest.fixture
def augmult_run(shared_result):
  return shared_result(
    'augmult', lambda w: train.train_and_evaluate(small_config(**AUGMULT), str(w))
  )


@pytest.mark.slow
def test_trainer_with_augmult_reports_the_same_epsilon_and_compiles_once(
  augmult_run, reference_run
):
  workdir, result = augmult_run
  plain_workdir, plain = reference_run  # small_config() without augmult: 6 steps.
  assert result['epsilon'] == plain['epsilon']  # Accounting is unchanged by augmult.
  assert result['compilations'] == {'train_steps': 1}
  a = checkpoints.read_metadata(str(workdir))[-1]
  b = checkpoints.read_metadata(str(plain_workdir))[-1]
  assert a['step'] == b['step'] == 6 and a['fingerprint'] == b['fingerprint']
  assert not np.array_equal(
    jax.tree.leaves(result['params'])[0], jax.tree.leaves(plain['params'])[0]
  )


@pytest.mark.slow
def test_trainer_with_augmult_resumes_bit_exactly(augmult_run, tmp_path):
  workdir, result = augmult_run
  copy = tmp_path / 'copy'
  shutil.copytree(workdir, copy)
  for step in (4, 6):
    shutil.rmtree(copy / 'checkpoints' / str(step))
  resumed = train.train_and_evaluate(small_config(**AUGMULT), str(copy))
  for u, v in zip(jax.tree.leaves(result['params']), jax.tree.leaves(resumed['params'])):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
