"""The sharding benchmark's and the 1B plan's core functions, at toy size on one device.

scripts/bench_sharding.py and scripts/sharding_plan_1b.py are not run by the suite (minutes
on 8 forced devices); this keeps their pieces from rotting against dpjax's API and checks
the two things their tables rest on. Catches: a per-device byte count that drops or doubles
a state tree (Adam's μ, ν, the EMA), an XLA argument count that is not the state's plus the
step's inputs (a program that is not the one measured), a step that does not train, and a
batch search that reports a P it never found to fit, or misses the largest one.
"""

import importlib
import pathlib
import sys

import jax
import numpy as np

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / 'scripts'


def _script(name: str):
  """scripts/<name>.py as a module (the plan imports the benchmark by name)."""
  if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))
  return importlib.import_module(name)


def test_toy_benchmark_bytes_are_the_states():
  """One device, a 1-layer LM: bytes_per_device of (params, Adam, EMA) = 16·n + 8 for n
  parameters (4 bytes × n each for the params, the EMA, Adam's μ and ν; + Adam's and the
  EMA's int32 counts); XLA's argument bytes of the compiled step = that + the buffer, K, t
  and the noise key, exactly; the data's targets are its inputs shifted by one. (The
  training loop is not run here: it would double the test's CPU.)"""
  bench = _script('bench_sharding')
  setup = bench.Setup(
    num_layers=1,
    model_dim=16,
    num_heads=2,
    mlp_dim=32,
    vocab=32,
    length=8,
    physical_batch=4,
    clipping='vmap',  # Ghost clipping's layer analysis would add seconds of tracing.
  )
  (layout,) = bench.build_layouts(setup, (1,), num_devices=1)
  step, state = layout.step, layout.shapes
  n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(state[0]))
  assert bench.state_bytes(state, layout.shardings)['state'] == 16 * n + 8
  inputs = 4 * (2 * setup.physical_batch * setup.length + setup.physical_batch + 2)
  keys = step.keys['noise'].nbytes  # jit drops the unused augmult key (keep_unused=False).
  assert bench.memory(layout.compiled)['arguments'] == 16 * n + 8 + inputs + keys
  (buffer,) = bench.data_buffers(setup, 1)
  np.testing.assert_array_equal(buffer['x'][..., 1:], buffer['y'][..., :-1])
  assert len(np.unique(buffer['x'])) <= 16


def test_plan_search_finds_the_largest_fitting_batch():
  """`largest_batch` on closed-form byte counts: linear (the line's answer at once), convex
  (the line over-predicts: it steps down) and one that never fits (P = 0); every P it reports
  was measured and fits, and the next multiple was measured and does not."""
  plan = _script('sharding_plan_1b')
  cases = [
    (lambda p: 100 + 10 * p, 8, 1000, 88),  # (1000 - 100) / 10 = 90 -> 88.
    (lambda p: 100 + p * p, 8, 1000, 24),  # 24² + 100 = 676 <= 1000 < 32² + 100.
    (lambda p: 5000 + p, 8, 1000, 0),
  ]
  for total, groups, limit, expected in cases:
    found = plan.largest_batch(lambda p, t=total: {'total': t(p)}, groups, limit, lambda *a: None)
    assert found['largest_physical_batch'] == expected
    if expected:
      assert found['measured'][expected]['total'] <= limit
      assert found['measured'][expected + groups]['total'] > limit
