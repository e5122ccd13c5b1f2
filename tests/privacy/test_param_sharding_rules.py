"""The placement rules of `dpjax.privacy.param_sharding`, on abstract meshes (no devices).

What runs on real devices (the same release on every layout) is tests/privacy/test_param_sharding.py;
here the rules themselves: which axis each array is split on, and that optimiser, EMA and noise
states follow their parameter.
"""

import jax
import numpy as np
import optax
import pytest
from dpjax.privacy import param_sharding as ps

P = jax.sharding.PartitionSpec


def mesh(data=1, fsdp=1, tensor=1):
  return jax.sharding.AbstractMesh((data, fsdp, tensor), ('data', 'fsdp', 'tensor'))


SMALL = ps.ShardingRules(min_sharded_size=16)
TP = ps.ShardingRules(tensor_parallel=True, min_sharded_size=16)


@pytest.mark.parametrize(
  'shape, expected',
  [
    ((64, 128), P(None, 'fsdp')),  # The largest dimension.
    ((128, 64), P('fsdp')),
    ((64, 64), P('fsdp')),  # A tie: the first.
    ((6, 40), P(None, 'fsdp')),
    ((40, 6), P('fsdp')),
    ((12, 6, 3), P('fsdp')),  # 12 % 4 == 0; 6 is not.
    ((6, 10, 3), P()),  # No dimension divisible by 4: replicated.
    ((3,), P()),  # Under min_sharded_size: replicated.
    ((), P()),
  ],
)
def test_fsdp_splits_the_largest_divisible_dimension(shape, expected):
  """Catches: a rule splitting an axis the fsdp size does not divide (jit rejects it), small
  arrays split (all-gathers of biases for nothing), or not the largest axis (uneven memory)."""
  assert ps.parameter_spec(('params', 'Dense_0', 'kernel'), shape, mesh(2, 4), SMALL) == expected


def test_arrays_under_the_threshold_stay_whole_and_the_threshold_is_validated():
  rules = ps.ShardingRules(min_sharded_size=64 * 128 + 1)
  assert ps.parameter_spec(('kernel',), (64, 128), mesh(2, 4), rules) == P()
  assert ps.parameter_spec(('kernel',), (64, 128), mesh(8), SMALL) == P()  # fsdp = 1.
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match='min_sharded_size'):
      ps.ShardingRules(min_sharded_size=bad)


@pytest.mark.parametrize(
  'names, shape, expected',
  [
    (('attn', 'query', 'kernel'), (32, 4, 8), P(None, 'tensor')),  # [D, H, d_h]: by head.
    (('attn', 'key', 'bias'), (4, 8), P('tensor')),  # [H, d_h]: by head.
    (('attn', 'out', 'kernel'), (4, 8, 32), P('tensor')),  # [H, d_h, D]: by head.
    (('mlp', 'Dense_1', 'kernel'), (32, 64), P(None, 'tensor')),  # Widens: column-parallel.
    (('mlp', 'Dense_2', 'kernel'), (64, 32), P('tensor')),  # Narrows: row-parallel.
    (('Dense_0', 'kernel'), (32, 32), P()),  # Square: no rule.
    (('Dense_0', 'bias'), (64,), P()),  # 1-D biases stay whole.
    (('attn', 'query', 'kernel'), (32, 3, 8), P()),  # 3 heads on 2 devices: no rule.
  ],
)
def test_tensor_parallel_rules(names, shape, expected):
  """Megatron's pairing (Shoeybi et al. 2019): heads split in attention, the MLP's first layer
  by columns and its second by rows. Catches a rule on the wrong axis of flax's kernels."""
  assert ps.parameter_spec(names, shape, mesh(4, 1, 2), TP) == expected
  assert ps.parameter_spec(names, shape, mesh(4, 1, 2), SMALL) == P()  # Rules off.


def test_tensor_then_fsdp_on_the_largest_remaining_axis():
  assert ps.parameter_spec(('mlp', 'k', 'kernel'), (32, 64), mesh(2, 2, 2), TP) == P(
    'fsdp', 'tensor'
  )
  assert ps.parameter_spec(('attn', 'out', 'kernel'), (4, 8, 32), mesh(2, 2, 2), TP) == P(
    'tensor', None, 'fsdp'
  )


def test_every_spec_is_valid_for_random_shapes():
  """Any shape on any mesh: each split axis is divisible by its mesh axis, and no mesh axis is
  used twice (what jit requires of a sharding); the rule is a function of (path, shape)."""
  rng = np.random.default_rng(0)
  for _ in range(300):
    m = mesh(*(int(v) for v in rng.choice([1, 2, 4, 8], 3)))
    shape = tuple(int(v) for v in rng.integers(1, 70, rng.integers(1, 4)))
    names = ('x', str(rng.choice(['query', 'out', 'Dense_3', 'key'])), 'kernel')
    spec = ps.parameter_spec(names, shape, m, TP)
    used = [a for a in spec if a is not None]
    assert len(used) == len(set(used))
    for axis, name in enumerate(spec):
      if name is not None:
        assert shape[axis] % dict(m.shape)[name] == 0


def test_state_leaves_follow_their_parameter():
  """Adam's μ and ν, an EMA and a banded noise history [b−1, *shape] are placed as their
  parameter (leading axes whole); counters are replicated. Catches an optimiser state left
  replicated (no memory saved) or split differently from its parameter (a reshard per step)."""
  params = {'params': {'a': {'kernel': np.zeros((64, 128))}, 'b': {'bias': np.zeros((8,))}}}
  m = mesh(2, 4)
  state = optax.adam(1e-3).init(params)
  specs = ps.state_specs(state, params, m, SMALL)
  flat = {
    tuple(ps.path_names(path)): spec
    for path, spec in jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=lambda x: isinstance(x, P)
    )[0]
  }
  kernel = [s for names, s in flat.items() if names[-2:] == ('a', 'kernel')]
  assert kernel == [P(None, 'fsdp')] * 2  # μ and ν.
  assert [s for names, s in flat.items() if names[-1] == 'count'] == [P()]
  history = {'history': {'params': {'a': {'kernel': np.zeros((3, 64, 128))}}}}
  assert jax.tree.leaves(
    ps.state_specs(history, params, m, SMALL), is_leaf=lambda x: isinstance(x, P)
  ) == [P(None, None, 'fsdp')]
  # A leaf whose path ends a parameter's but whose shape does not: replicated.
  other = {'params': {'a': {'kernel': np.zeros((64, 127))}}}
  assert jax.tree.leaves(
    ps.state_specs(other, params, m, SMALL), is_leaf=lambda x: isinstance(x, P)
  ) == [P()]


def test_describe_names_the_layout():
  line = ps.describe(mesh(2, 2, 2), TP)
  assert line.startswith('mesh data=2 fsdp=2 tensor=2: FSDP over 2')
  assert 'tensor parallel over 2' in line
  assert 'replicated state (data parallel)' in ps.describe(mesh(8), SMALL)
