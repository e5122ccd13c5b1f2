"""The DP step with parameters split over a mesh (FSDP, tensor parallel) against one device.

JAX fixes the device count when its backend starts, so every check runs in ONE child process
with 8 forced CPU devices (`python -m tests.privacy.test_param_sharding OUTDIR`), which writes
what it saw to OUTDIR/results.json; the tests below read it. Layouts: one device,
(data=8), (data=2, fsdp=4) and (data=2, fsdp=2, tensor=2) with the tensor-parallel rules.
A tiny model (LayerNorm -> Dense at 6 positions -> Dense head, as the ghost tests' dense
model) and `min_sharded_size` 16 so that its kernels and a bias are split.
"""

import functools
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.privacy import (
  clipping,
  correlated_noise,
  dp_step,
  losses,
  multi_step,
  noise,
  param_sharding,
  privacy_plan,
  samplers,
  sharding,
  step_layout,
)
from dpjax.privacy import ema as ema_lib
from dpjax.utils.child_env import child_env
from tests.privacy.ghost_clipping import harness

P = param_sharding.P
pytestmark = pytest.mark.slow  # A child process (`make test-unit` skips).

NUM_DEVICES = 8
C = 1e-4  # Below every example's gradient norm at the adversarial states: each is clipped.
RULES = param_sharding.ShardingRules(tensor_parallel=True, min_sharded_size=16)
LAYOUTS = {'data8': (1, 1), 'fsdp4': (4, 1), 'fsdp2_tensor2': (2, 2)}  # (fsdp, tensor).
# (LayerNorm bias, gain) far from init: the ghost tests' adversarial states.
STATES = [(1e3, 10.0), (1e3, 100.0), (1e4, 100.0)]
BANDS = tuple(np.array([1.0, 0.6, 0.3]) / np.linalg.norm([1.0, 0.6, 0.3]))  # Unit l2 norm.


def _model():

  class DenseLayers(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(16)(nn.LayerNorm()(x.reshape(x.shape[0], 6, 18)))
      return nn.Dense(4)(jnp.mean(jnp.tanh(h), axis=1))

  return DenseLayers()


def _uncovered_model():
  """A layer ghost clipping has no rule for (harness.Scaled: a gain [108], split over 'fsdp')."""

  class Uncovered(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(harness.Scaled()(x.reshape(x.shape[0], -1)))

  return Uncovered()


def _params(model, x):

  return jax.tree.map(np.asarray, model.init(jax.random.PRNGKey(0), x[:1])['params'])


def _adversarial(params, bias, gain):
  """The LayerNorm's bias set to `bias` (exactly constant) and its scale to `gain`."""
  out = {k: dict(v) for k, v in params.items()}
  out['LayerNorm_0'] = {
    'bias': np.full_like(params['LayerNorm_0']['bias'], bias),
    'scale': np.full_like(params['LayerNorm_0']['scale'], gain),
  }
  return out


def _mesh(fsdp, tensor):

  return sharding.make_mesh(0, fsdp=fsdp, tensor=tensor)


def _privatizers():

  scale = 1 / 1.3664988301217094  # BLT((0.9, 0.3), (0.4, 0.2)): unit column norm over 7 steps.
  return {
    'gaussian': noise.GaussianPrivatizer.gaussian(1.0, 1.0, 1.0, seed=5),
    'bandmf': correlated_noise.BandedPrivatizer.banded(BANDS, 1.0, 1.0, 1.0, 5),
    'blt': correlated_noise.BLTPrivatizer.blt((0.9, 0.3), (0.4, 0.2), scale, 7, 1.0, 1.0, 1.0, 5),
  }


def _releases(privatizers, grads, states, keys):
  """Each privatizer's releases of `grads` at steps 0 and 1 (its state carried; the Gaussian at 0)."""
  out = {}
  for name, privatizer in privatizers.items():
    state, out[name] = states[name], []
    for t in range(2 if privatizer.stateful else 1):
      noised, state = privatizer.release(grads, state, np.uint32(t), keys[name])
      out[name].append(noised)
  return out


def _noise_checks(params, out):
  """Every privatizer's releases of a zero sum (σ = C = b = 1: the release IS the noise) for
  steps 0 and 1 on every layout, in one program per layout whose outputs are held to the state
  layout, bit for bit against one device."""

  privatizers = _privatizers()
  params = {'Dense_0': params['Dense_0'], 'Dense_1': {'kernel': params['Dense_1']['kernel']}}
  zeros = jax.tree.map(np.zeros_like, params)
  states = {name: p.init(params) for name, p in privatizers.items()}
  draws, results = {}, {}
  for layout, shape in {'one': None, **LAYOUTS}.items():
    keys = {name: p.key_data() for name, p in privatizers.items()}
    fn = functools.partial(_releases, privatizers, keys=keys)
    grads, state = zeros, states
    if shape is None:
      draws[layout] = jax.jit(fn)(grads, state)
      continue
    mesh = _mesh(*shape)
    grads, state = param_sharding.place_state(mesh, RULES, params, zeros, states)[1:]
    want = param_sharding.state_specs(jax.eval_shape(fn, grads, state), params, mesh, RULES)
    where = jax.tree.map(
      lambda s, mesh=mesh: jax.sharding.NamedSharding(mesh, s),
      want,
      is_leaf=lambda s: isinstance(s, P),
    )
    compiled = jax.jit(fn, out_shardings=where).lower(grads, state).compile()
    if layout == 'fsdp4':
      text = compiled.as_text()
      results['hlo_whole_kernel'] = '[18,16]' in text  # Dense_0's kernel [18, 16], whole.
      results['hlo_kernel_shard'] = '[18,4]' in text  # Its shard on each of 4 devices.
    draws[layout] = compiled(grads, state)
    got = jax.tree.map(lambda a: str(a.sharding.spec), draws[layout])
    results[f'{layout}_layout_kept'] = got == jax.tree.map(str, want)
  flat = lambda t: np.concatenate([np.ravel(v) for v in jax.tree.leaves(t)])
  for name in privatizers:
    one = [flat(r) for r in draws['one'][name]]
    results[f'{name}_std'] = float(np.std(one[0]))
    for layout in LAYOUTS:
      got = [flat(r) for r in draws[layout][name]]
      results[f'{name}_{layout}_bitwise'] = all(np.array_equal(a, b) for a, b in zip(got, one))
  out['noise'] = results


def _ghost_checks(model, params, x, y, out):
  """Per-example contributions on (data=2, fsdp=4) at the adversarial states (each row alone,
  weight 1, the others 0) and the whole clipped sum against one device's ghost and vmap."""

  loss_fn = losses.make_loss_fn(model)
  mesh = _mesh(4, 1)
  ghost = jax.jit(clipping.make_clipped_sum_fn('ghost', loss_fn, C))
  vmap = jax.jit(clipping.make_clipped_sum_fn('vmap', loss_fn, C))
  shardings = param_sharding.state_shardings(params, params, mesh, RULES)
  out['ghost_specs'] = {
    '/'.join(param_sharding.path_names(p)): str(s.spec)
    for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]
  }
  norms, sums = [], []
  for bias, gain in STATES:
    host = _adversarial(params, bias, gain)
    placed = param_sharding.place(host, shardings)
    for i in range(len(x)):
      w = np.eye(len(x), dtype=np.float32)[i]
      batch = jax.device_put({'x': x, 'y': y, 'weight': w}, sharding.batch_sharding(mesh))
      g = ghost(placed, batch)[0]
      norms.append(float(np.sqrt(sum(np.sum(np.float64(v) ** 2) for v in jax.tree.leaves(g)))))
    batch = {'x': x, 'y': y, 'weight': np.ones(len(x), np.float32)}
    sharded = ghost(placed, jax.device_put(batch, sharding.batch_sharding(mesh)))[0]
    one = [ghost(host, batch)[0], vmap(host, batch)[0]]
    flat = lambda t: np.concatenate([np.ravel(np.float64(v)) for v in jax.tree.leaves(t)])
    sums.append([float(np.max(np.abs(flat(sharded) - flat(o)))) for o in one])
  out['ghost_row_norms'] = norms
  out['ghost_vs_one_device'] = sums  # Per state: |mesh ghost − 1-device ghost|, − vmap.


def _step(model, plan, mesh=None, loop='device', **kwargs):

  return dp_step.DPStep.from_plan(
    model, optax.adam(1e-2), plan, mesh=mesh, rules=RULES, physical_loop=loop, **kwargs
  )


def _step_checks(model, params, x, y, out):
  """The library tier on (data=2, fsdp=4): from_plan + place_state + train_step against one
  device; MultiStep with an EMA, 'device' and 'host' loops, keeps every layout; vmap refused;
  compiled_bytes per device."""

  sampler = samplers.make('poisson', 1000, 16, 3)
  plan = privacy_plan.PrivacyPlan.create(
    sampler, num_steps=10, clip_norm=1.0, delta=1e-5, noise_multiplier=1.0, precision='highest'
  )
  logical = {'x': x[None], 'y': y[None], 'weight': np.ones((1, len(x)), np.float32)}
  mesh = _mesh(4, 1)
  results = {}
  runs = {}
  for name, where in (('one', None), ('fsdp4', mesh)):
    step = _step(model, plan, where, clipping='ghost')
    p, o = step.place_state(params, step.init_opt_state(params))
    if name == 'fsdp4':
      results['bytes_sharded'] = step.compiled_bytes(p, o, logical)
      replicated = sharding.replicate(mesh, (params, step.init_opt_state(params)))
      results['bytes_replicated'] = step.compiled_bytes(*replicated, logical)
    for t in range(2):
      p, o, _ = step.train_step(p, o, logical, np.int32(1), np.uint32(t))
    runs[name] = (p, o)
    if name == 'fsdp4':
      want = param_sharding.state_specs((p, o), params, mesh, RULES)
      got = jax.tree.map(lambda a: str(a.sharding.spec), (p, o))
      results['train_step_layout_kept'] = got == jax.tree.map(str, want)
      results['params_split'] = param_sharding.sharded_names(params, mesh, RULES)
  flat = lambda t: np.concatenate([np.ravel(np.float64(v)) for v in jax.tree.leaves(t)])
  ref = flat(runs['one'][0])
  results['fsdp4_vs_one_rel'] = float(np.max(np.abs(flat(runs['fsdp4'][0]) - ref) / np.abs(ref)))
  for loop in ('device', 'host'):
    step = _step(model, plan, mesh, loop, clipping='ghost')
    runner = multi_step.MultiStep(step, 2, ema_decay=0.9, mesh=mesh)
    p, o, e = step.place_state(params, step.init_opt_state(params), ema_lib.init(params))
    chunk = multi_step.stack(0, [(None, logical, 1)] * 2, 2)
    p, o, e, _ = runner(p, o, e, chunk)
    want = param_sharding.state_specs((p, o, e), params, mesh, RULES)
    got = jax.tree.map(lambda a: str(a.sharding.spec), (p, o, e))
    results[f'multi_step_{loop}_layout_kept'] = got == jax.tree.map(str, want)
    results[f'multi_step_{loop}_vs_train_step'] = float(
      np.max(np.abs(flat(p) - flat(runs['fsdp4'][0])))
    )
  step = _step(model, plan, mesh, clipping='vmap')
  p, o = step.place_state(params, step.init_opt_state(params))
  try:  # Refused when first traced, before anything is compiled.
    step.train_step(p, o, logical, np.int32(1), np.uint32(0))
    results['vmap_fsdp4'] = 'ran'
  except ValueError as e:
    results['vmap_fsdp4'] = str(e)
  step = _step(_uncovered_model(), plan, mesh, clipping='auto')
  (p,) = step.place_state(_params(_uncovered_model(), x))
  try:  # 'auto' falls back to per-example gradients: refused alike.
    step.train_step(p, step.init_opt_state(p), logical, np.int32(1), np.uint32(0))
    results['auto_uncovered_fsdp4'] = 'ran'
  except ValueError as e:
    results['auto_uncovered_fsdp4'] = str(e)
  for name, shape in LAYOUTS.items():  # The same check, on every layout.
    options = dp_step.StepOptions(mesh=_mesh(*shape), rules=RULES)
    try:
      step_layout.check_vmap(options, params)
      results[f'check_vmap_{name}'] = 'allowed'
    except ValueError as e:
      results[f'check_vmap_{name}'] = str(e)
    options = dp_step.StepOptions(mesh=_mesh(*shape), rules=param_sharding.ShardingRules())
    step_layout.check_vmap(options, params)  # Default rules: every array < 2**14, replicated.
  out['step'] = results


def _worker(outdir):

  jax.config.update('jax_default_matmul_precision', 'highest')
  assert jax.device_count() == NUM_DEVICES, jax.devices()
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 6, 6, 3)).astype(np.float32)
  y = rng.integers(0, 4, 8).astype(np.int32)
  model = _model()
  params = _params(model, x)
  out = {}
  _noise_checks(params, out)
  _ghost_checks(model, params, x, y, out)
  _step_checks(model, params, x, y, out)
  with open(os.path.join(outdir, 'results.json'), 'w', encoding='utf-8') as f:
    json.dump(out, f)


@pytest.fixture(scope='module')
def seen(tmp_path_factory):
  outdir = tmp_path_factory.mktemp('param_sharding')
  flags = f'--xla_force_host_platform_device_count={NUM_DEVICES}'
  proc = subprocess.run(
    [sys.executable, '-m', 'tests.privacy.test_param_sharding', str(outdir)],
    env=child_env(JAX_PLATFORMS='cpu', XLA_FLAGS=f'{os.environ.get("XLA_FLAGS", "")} {flags}'),
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads((outdir / 'results.json').read_text())


def test_noise_is_bit_identical_on_every_layout(seen):
  """Catches noise that depends on the layout: drawn per device, from a key split by shard,
  or in an order the partitioner changes (the Gaussian's and the correlated privatizers'
  releases at σ = C = b = 1 of a zero sum, steps 0 and 1, against one device, bit for bit)."""
  noise = seen['noise']
  for name in ('gaussian', 'bandmf', 'blt'):
    assert 0.8 < noise[f'{name}_std'] < 1.6, name  # The release is the noise: not all zeros.
    for layout in LAYOUTS:
      assert noise[f'{name}_{layout}_bitwise'], (name, layout)
  for layout in LAYOUTS:  # The correlated state (history, buffers) follows its parameter.
    assert noise[f'{layout}_layout_kept'], layout


def test_each_shard_draws_only_its_own_noise(seen):
  """Catches a draw of the whole leaf on every device (a flat [n] draw reshaped, which the
  partitioner cannot split): the (data=2, fsdp=4) program holds Dense_0's kernel [18, 16]
  only as its shards [18, 4], never whole."""
  assert seen['noise']['hlo_kernel_shard']
  assert not seen['noise']['hlo_whole_kernel']


def test_ghost_clips_each_example_at_c_on_a_sharded_mesh(seen):
  """Catches per-example norms summed over one shard only (each device clipping by its part
  of the norm: contributions up to sqrt(4) C): on (data=2, fsdp=4), with Dense kernels and a
  bias split over 'fsdp', each row's contribution as summed (weight 1, others 0) has norm
  <= C at the adversarial LayerNorm states, and the clipped sum equals one device's ghost
  and vmap sums (float32 tolerance on values ~C = 1e-4)."""
  specs = seen['ghost_specs']
  assert specs['Dense_0/kernel'] == "P(None, 'fsdp')" and specs['Dense_1/kernel'] == "P('fsdp',)"
  norms = np.asarray(seen['ghost_row_norms'])
  assert len(norms) == 8 * len(STATES)
  assert np.all(norms <= C * (1 + 1e-6)), norms.max()
  assert np.all(norms >= C * (1 - 1e-6))  # Each clipped (its gradient's norm is above C).
  for ghost_gap, vmap_gap in seen['ghost_vs_one_device']:
    assert ghost_gap <= 1e-10 and vmap_gap <= 1e-10


def test_vmap_is_refused_where_a_parameter_is_split(seen):
  """Catches per-example gradients of a sharded parameter (a per-example copy of it, whole,
  on every device): refused in one line naming ghost clipping, before any compute, on
  fsdp = 4 and fsdp = 2 × tensor = 2, also where 'auto' falls back to vmap (a parameter ghost
  clipping does not cover); allowed on data = 8 (everything replicated)."""
  step = seen['step']
  keys = ('vmap_fsdp4', 'auto_uncovered_fsdp4', 'check_vmap_fsdp4', 'check_vmap_fsdp2_tensor2')
  for key in keys:
    assert "use clipping='ghost'" in step[key] and '\n' not in step[key], key
    assert 'per-example copy of each sharded parameter' in step[key]
  assert step['check_vmap_data8'] == 'allowed'


def test_the_library_step_on_fsdp_equals_one_device_and_keeps_the_layout(seen):
  """Catches a wrong gradient, noise or optimiser update under FSDP and a state that comes
  back replicated: DPStep.from_plan + place_state + 2 train_steps on (data=2, fsdp=4) against
  one device (float32 reduction order: <= 1e-5 relative), every output where state_specs puts
  it; MultiStep with an EMA, 'device' and 'host' loops, equal to train_step and in layout."""
  step = seen['step']
  assert step['params_split'] == ['Dense_0/bias', 'Dense_0/kernel', 'Dense_1/kernel']
  assert step['fsdp4_vs_one_rel'] <= 1e-5
  assert step['train_step_layout_kept']
  for loop in ('device', 'host'):
    assert step[f'multi_step_{loop}_layout_kept'], loop
    assert step[f'multi_step_{loop}_vs_train_step'] <= 1e-7, loop


def test_compiled_bytes_are_per_device_for_a_sharded_state(seen):
  """Catches sizing that drops the state's sharding (then a sharded and a replicated state
  size the same): XLA's memory analysis of the step is smaller with the state on fsdp = 4."""
  step = seen['step']
  assert 0 < step['bytes_sharded'] < step['bytes_replicated']


def test_sharding_rules_are_validated():
  """Catches rules of the wrong type reaching the step (one line, before any compute)."""

  with pytest.raises(ValueError, match='rules must be a param_sharding.ShardingRules'):
    step_layout.StepOptions(rules={'tensor_parallel': True})


def test_tensor_parallel_arrays_take_fsdp_on_the_same_dimension():
  """Catches 'fsdp' on another dimension of a tensor-parallel array: XLA's SPMD partitioner
  (jax 0.10.2) miscomputes x @ w0 + (x @ w3) @ w1 with w1 P('tensor', 'fsdp') (a digits
  transformer on fsdp = 2 × tensor = 2: gradients up to 0.9 relative off)."""

  mesh = jax.sharding.AbstractMesh((2, 2, 2), ('data', 'fsdp', 'tensor'))
  both = ('fsdp', 'tensor')
  for names, shape, want in (
    (('mlp', 'kernel'), (128, 64), P(both)),  # Row-parallel.
    (('mlp', 'kernel'), (64, 128), P(None, both)),  # Column-parallel.
    (('attention', 'out', 'kernel'), (4, 16, 64), P(both)),
    (('attention', 'query', 'kernel'), (64, 4, 16), P(None, both)),
    (('attention', 'query', 'kernel'), (64, 2, 16), P(None, 'tensor')),  # 2 heads: 'tensor' only.
    (('pos_embedding',), (8, 64), P(None, 'fsdp')),  # No tensor-parallel rule: FSDP alone.
  ):
    assert param_sharding.parameter_spec(names, shape, mesh, RULES) == want, (names, shape)


if __name__ == '__main__':
  _worker(sys.argv[1])
