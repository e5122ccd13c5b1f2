"""Learning-rate schedules of dpjax.trainer.planning.optimizers against their closed forms."""

import math

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from dpjax.trainer.planning import optimizers


def _config(**fields):
  c = ml_collections.ConfigDict(
    dict(
      name='sgd',
      learning_rate=0.5,
      momentum=0.0,
      schedule='constant',
      warmup_steps=0,
      decay_steps=(),
      decay_factor=0.1,
    )
  )
  c.update(fields)
  return c


def _applied_rates(config, num_steps, steps):
  """η_t recovered from the sgd update of a parameter with gradient 1 (momentum 0)."""
  opt = optimizers.make_optimizer(config, num_steps)
  params = jnp.zeros(())
  state = opt.init(params)
  rates = []
  for _ in range(max(steps) + 1):
    updates, state = opt.update(jnp.ones(()), state, params)
    rates.append(-float(updates))
  return [rates[t] for t in steps]


def test_constant():
  assert _applied_rates(_config(), 10, [0, 5, 9]) == pytest.approx([0.5] * 3, rel=1e-6)


def test_cosine_with_warmup_matches_closed_form():
  lr, warmup, total = 0.5, 4, 20
  steps = [0, 1, 3, 4, 7, 12, 19, 20]

  def closed(t):
    if t < warmup:
      return lr * t / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (t - warmup) / (total - warmup)))

  got = _applied_rates(_config(schedule='cosine', warmup_steps=warmup), total, steps)
  np.testing.assert_allclose(got, [closed(t) for t in steps], rtol=1e-5, atol=1e-7)


def test_step_decay_matches_closed_form():
  config = _config(schedule='step', decay_steps=(3, 6), decay_factor=0.2)
  steps = [0, 2, 3, 5, 6, 9]
  closed = [0.5 * 0.2 ** sum(s <= t for s in (3, 6)) for t in steps]
  np.testing.assert_allclose(_applied_rates(config, 10, steps), closed, rtol=1e-6)


def test_adam_uses_the_schedule():
  # Adam's first update has magnitude η_0 (m̂/√v̂ = ±1 up to ε) for any gradient.
  config = _config(name='adam', schedule='step', decay_steps=(1,), decay_factor=0.1)
  opt = optimizers.make_optimizer(config, 5)
  state = opt.init(jnp.zeros(()))
  u0, state = opt.update(jnp.array(3.0), state)
  u1, _ = opt.update(jnp.array(3.0), state)
  assert float(u0) == pytest.approx(-0.5, rel=1e-5)
  assert float(u1) == pytest.approx(-0.05, rel=1e-5)


@pytest.mark.parametrize(
  'fields, match',
  [
    (dict(schedule='linear'), 'optimizer.schedule'),
    (dict(schedule='cosine', warmup_steps=10), 'optimizer.warmup_steps'),
    (dict(schedule='step', decay_steps=(5, 3)), 'optimizer.decay_steps'),
    (dict(schedule='step', decay_steps=(3,), decay_factor=0.0), 'optimizer.decay_factor'),
    (dict(name='rmsprop'), 'optimizer.name'),
  ],
)
def test_bad_fields_name_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    optimizers.make_optimizer(_config(**fields), 10)
