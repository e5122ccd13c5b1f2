"""clipping='auto': ghost where it covers every parameter, else vmap; the DP step's choice."""

import logging

import jax
import numpy as np
import optax
import pytest

from dpjax.privacy import clipping
from dpjax.privacy import dp_step
from dpjax.privacy import ghost_clipping
from dpjax.models import layers
from dpjax.models import mlp
from dpjax.privacy import losses
from tests import child_imports
from tests.privacy.ghost_clipping import harness


def test_auto_falls_back_to_vmap_with_a_log_line_and_ghost_raises(caplog):
  model = harness.Uncovered()
  x, y = harness.inputs((5,), 4, seed=6)
  params = harness.init(model, x, seed=6)
  batch = {'x': x, 'y': y, 'weight': np.ones(4, np.float32)}
  loss_fn = losses.make_loss_fn(model)
  auto = clipping.make_clipped_sum_fn('auto', loss_fn, 0.1)
  with caplog.at_level(logging.INFO, logger='root'):
    (got, _), (want, _) = jax.jit(
      lambda p, b: (auto(p, b), clipping.per_example_clipped_sum(loss_fn, p, b, 0.1))
    )(params, batch)
  assert any('Scaled_0/gain' in r.getMessage() and 'vmap' in r.getMessage() for r in caplog.records)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
  with pytest.raises(ValueError, match='Scaled_0/gain'):
    jax.jit(clipping.make_clipped_sum_fn('ghost', loss_fn, 0.1))(params, batch)


def test_auto_picks_ghost_for_covered_models(caplog):
  model = mlp.MLP(harness.K, (8,))
  x, y = harness.inputs((5,), 4, seed=7)
  params = harness.init(model, x, seed=7)
  batch = {'x': x, 'y': y, 'weight': np.ones(4, np.float32)}
  with caplog.at_level(logging.INFO, logger='root'):
    fn = jax.jit(clipping.make_clipped_sum_fn('auto', losses.make_loss_fn(model), 0.1))
    jax.block_until_ready(fn(params, batch))
  messages = [r.getMessage() for r in caplog.records]
  assert any('ghost clipping: 2 layers' in m for m in messages), messages
  assert not any('vmap' in m for m in messages)


def test_dp_step_auto_is_ghost_equals_vmap_and_compiles_once(caplog):
  model = mlp.MLP(harness.K, (8,))
  x, y = harness.inputs((5,), 11, seed=8)
  params = harness.init(model, x, seed=8)
  batches = []
  for i in range(3):  # harness.K = 3 physical batches of P = 4, one padding row.
    xb, yb = x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4]
    pad = 4 - len(yb)
    batches.append(
      {
        'x': np.concatenate([xb, np.full((pad, 5), np.nan, np.float32)]),
        'y': np.r_[yb, np.zeros(pad, np.int32)],
        'weight': np.r_[np.ones(len(yb)), np.zeros(pad)].astype(np.float32),
      }
    )
  results = {}
  with caplog.at_level(logging.INFO, logger='root'):
    for method in ('vmap', 'auto'):
      step = dp_step.DPStep.for_model(
        model,
        optax.sgd(0.5),
        clip_norm=0.3,
        noise_multiplier=1.0,
        expected_batch_size=11,
        clipping=method,
      )
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
  assert (
    sum("clipping='auto': ghost clipping" in r.getMessage() for r in caplog.records) == 1
  )  # Decided once, at trace time.
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    results['auto'][0],
    results['vmap'][0],
  )
  for k in (
    'loss',
    'num_clipped',
    'num_examples',
    'example_grad_norm',
    'grad_norm',
    'noisy_grad_norm',
  ):
    np.testing.assert_allclose(results['auto'][1][k], results['vmap'][1][k], rtol=1e-5)
  assert float(results['auto'][1]['num_examples']) == 11
  assert int(results['auto'][1]['num_clipped']) > 0


@pytest.mark.slow
def test_clipping_code_does_not_import_models():
  """The rules live in dpjax.privacy.ghost_clipping; models register theirs (WSConv), not vice versa."""
  code = 'import dpjax.privacy.ghost_clipping, dpjax.privacy.clipping'
  assert child_imports.imported(code, ('dpjax.models.factory',)) == []
  assert layers.WSConv in ghost_clipping.RULES  # Registered by dpjax.models.factory itself.
