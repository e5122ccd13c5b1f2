"""dpjax.privacy.ema against a hand computation in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.privacy import ema


def test_matches_hand_computation_over_a_few_steps():
  decay = 0.9
  rng = np.random.default_rng(0)
  thetas = [rng.normal(size=(3, 2)) for _ in range(16)]
  with jax.enable_x64(True):
    state = ema.init({'w': jnp.asarray(thetas[0])})
    update = jax.jit(ema.update, static_argnums=2)
    for theta in thetas[1:]:
      state = update(state, {'w': jnp.asarray(theta)}, decay)
    got = np.asarray(state.params['w'])
    assert state.params['w'].dtype == jnp.float64
  expected = thetas[0]
  for t, theta in enumerate(thetas[1:]):
    d = min(decay, (1 + t) / (10 + t))  # 0.1, 0.1818, ..., capped at 0.9 from t = 80 on.
    expected = d * expected + (1 - d) * theta
  assert int(state.count) == 15
  np.testing.assert_allclose(got, expected, rtol=1e-12)
  # The warm-up matters here: without it the result differs.
  no_warmup = thetas[0]
  for theta in thetas[1:]:
    no_warmup = decay * no_warmup + (1 - decay) * theta
  assert np.max(np.abs(got - no_warmup)) > 1e-2


def test_decay_cap_is_reached():
  assert float(ema.decay_at(0.5, 0)) == pytest.approx(0.1)
  assert float(ema.decay_at(0.5, 8)) == pytest.approx(0.5)  # 9/18 = 0.5.
  assert float(ema.decay_at(0.999, 10**6)) == pytest.approx(0.999)


def test_constant_parameters_are_a_fixed_point():
  state = ema.init({'b': jnp.full((4,), 2.5, jnp.bfloat16)})
  for _ in range(3):
    state = ema.update(state, {'b': jnp.full((4,), 2.5, jnp.bfloat16)}, 0.99)
  assert state.params['b'].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(state.params['b']), 2.5)


@pytest.mark.parametrize('bad', [-0.1, 1.0, float('nan'), True])
def test_bad_decay(bad):
  with pytest.raises(ValueError, match=r'ema_decay = .*\[0, 1\)'):
    ema.check_decay(bad)
