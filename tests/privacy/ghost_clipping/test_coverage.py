"""Coverage: what ghost clipping proves it covers, and what it names as uncovered."""

import flax.linen as nn
import jax.numpy as jnp

from dpjax.privacy import ghost_clipping
from dpjax.models import mlp
from dpjax.privacy import losses
from tests.privacy.ghost_clipping import harness


class Tied(nn.Module):
  """Embedding reused as the output layer (weight tying)."""

  @nn.compact
  def __call__(self, x):
    embed = nn.Embed(harness.K, 4)
    return embed.attend(jnp.mean(embed(x), axis=-2))


class Shared(nn.Module):
  """One Dense applied twice."""

  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(x.shape[-1])
    return nn.Dense(harness.K)(dense(jnp.tanh(dense(x))))


def test_coverage_reports_what_it_cannot_prove():
  cases = [
    (harness.Uncovered(), (5,), 0, {'Scaled_0/gain': 'Scaled has no ghost rule'}),
    (Tied(), (4,), harness.K, {'Embed_0/embedding': 'called 2 times'}),
    (Shared(), (5,), 0, {'Dense_0/kernel': 'called 2 times', 'Dense_0/bias': 'called 2 times'}),
  ]
  for model, shape, vocab, want in cases:
    x, y = harness.inputs(shape, 2, seed=4, vocab=vocab)
    params = harness.init(model, x, seed=4)
    cov = ghost_clipping.analyse_coverage(
      losses.make_loss_fn(model), params, {'x': x[0], 'y': y[0]}
    )
    got = dict(cov.uncovered)
    assert set(got) == set(want), cov.describe()
    for path, reason in want.items():
      assert reason in got[path]


def test_parameter_used_outside_its_layer_is_uncovered():
  """A loss term on a kernel changes g_i: the dependency proof catches it."""
  model = mlp.MLP(harness.K, (4,))
  x, y = harness.inputs((5,), 2, seed=5)
  params = harness.init(model, x, seed=5)

  def loss_fn(p, example):
    loss, aux = losses.make_loss_fn(model)(p, example)
    return loss + 0.1 * jnp.sum(p['Dense_1']['kernel'] ** 2), aux

  cov = ghost_clipping.analyse_coverage(loss_fn, params, {'x': x[0], 'y': y[0]})
  assert {p for p, _ in cov.uncovered} == {'Dense_1/kernel', 'Dense_1/bias'}
  assert 'outside the layer call' in dict(cov.uncovered)['Dense_1/kernel']
  assert len(cov.layers) == 1


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
    return self.second(harness.K)(jnp.tanh(QuietDense(6)(x)))


def test_subclass_keeping_call_uses_the_rule_and_matches_per_example_gradients():
  x, y = harness.inputs((8,), 6, seed=300)
  coverage = harness.assert_matches_vmap(SubclassedLayers(), x, y)
  assert [l.rule.name for l in coverage.layers] == ['dense', 'dense']


def test_subclass_overriding_call_is_named_as_uncovered():
  model = SubclassedLayers(second=DoubledDense)
  x, y = harness.inputs((5,), 2, seed=301)
  params = harness.init(model, x, seed=301)
  cov = ghost_clipping.analyse_coverage(losses.make_loss_fn(model), params, {'x': x[0], 'y': y[0]})
  reasons = dict(cov.uncovered)
  assert set(reasons) == {'DoubledDense_0/kernel', 'DoubledDense_0/bias'}
  assert 'DoubledDense subclasses Dense but overrides __call__' in reasons['DoubledDense_0/kernel']
  assert 'DoubledDense' in cov.describe()
