"""The measured forms checked on the whole clipped sum (`ghost_clipping.whole_step`): they run
only if the whole program is faster with them than with the FLOP rule's, the verdict is cached
with the per-layer decisions (keyed by device, P, shapes and model), and the norms (hence the
clipping at C) are the same whichever assignment runs.

New in issue 35 item 4, the feature missing before: these fail at import on da06065 (no
`form_timing`) and on 11c40e5 (no `whole_step`: the per-layer winners ran whatever the whole
step's speed, WRN-16-4 at 0.89x the FLOP rule's)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.privacy import clipping
from dpjax.privacy import ghost_clipping
from dpjax.privacy.ghost_clipping import form_timing
from dpjax.privacy.ghost_clipping import whole_step
from tests.privacy.ghost_clipping import test_form_timing as per_layer

C = 1.0


def _forms(choice: list[str]) -> list[str]:
  return choice[choice.index('all layers:') + 1 :]


@pytest.mark.parametrize(
  'seconds, kept',
  [
    ({'measured': 1.0e-3, 'flops': 2.0e-3}, 'measured'),
    ({'measured': 2.0e-3, 'flops': 1.0e-3}, 'flops'),
  ],
)
def test_the_step_runs_the_assignment_faster_on_the_whole_clipped_sum(
  monkeypatch, tmp_path, seconds, kept
):
  """Per-layer timings against the FLOP rule on every layer of choice; the whole clipped sum,
  timed with those forms and with the FLOP rule's (an empty table), decides what the traced
  step runs, and its start line says so with both times."""
  monkeypatch.setattr(form_timing, 'cache_dir', lambda: str(tmp_path))
  calls = per_layer._fake_timing(monkeypatch, against_flops=True, whole=seconds)
  loss_fn, params, examples = per_layer._setup()
  measured = clipping.clipped_grad(loss_fn, C, method='ghost', forms='measured')
  jax.jit(measured).lower(params, examples, np.ones(8, np.float32))  # Traced, not compiled.
  flop_forms = per_layer._coverage(loss_fn, params, examples).layer_forms()
  (programs,) = calls.whole  # Timed once, with these two assignments.
  assert programs['flops'] == {}
  assert sorted(programs['measured'].values()) == [False, False, True]  # Conv ghost, 2 not.
  ms = lambda s: f'{s * 1e3:.3g} ms'
  line = (
    f"whole clipped sum: measured forms {ms(seconds['measured'])}, FLOP rule's "
    f'{ms(seconds["flops"])}: '
  )
  (got,) = [l for l in measured.choice if l.startswith('whole clipped sum')]
  assert got.startswith(line), got
  if kept == 'measured':
    assert got.endswith('the measured forms run')
    assert sum(l not in flop_forms for l in _forms(measured.choice)) == 3
  else:
    assert 'not faster on the whole step' in got
    assert _forms(measured.choice) == flop_forms


def test_a_tie_on_the_whole_step_keeps_the_flop_rule():
  assert whole_step.keep_measured({'measured': 0.97, 'flops': 1.0})
  assert not whole_step.keep_measured({'measured': 0.99, 'flops': 1.0})  # Within TIE.
  assert not whole_step.keep_measured({'measured': 1.2, 'flops': 1.0})


def _choose(loss_fn, params, examples, tmp_path, batch_size=8):
  coverage = per_layer._coverage(loss_fn, params, examples)
  thetas = [ghost_clipping.coverage.subtree(params, l.param_path) for l in coverage.layers]
  w = np.ones(batch_size, np.float32)
  step = whole_step.WholeStep(
    lambda *a: None, clipping.with_aux(loss_fn, False), params, examples, w
  )
  return form_timing.choose_forms(coverage, thetas, batch_size, str(tmp_path), step), step


def test_the_verdict_is_cached_and_keyed_by_device_shapes_and_model(monkeypatch, tmp_path):
  """The whole step is timed once per (device, P, layer shapes, model): a second choice reads
  its verdict from disk and times nothing; a model differing only outside the layers of choice
  (the activation) is timed again; layers that agree with the FLOP rule time no whole step."""
  calls = per_layer._fake_timing(monkeypatch, against_flops=True)
  loss_fn, params, examples = per_layer._setup()
  first, step = _choose(loss_fn, params, examples, tmp_path)
  assert first.timed and len(calls.whole) == 1 and sorted(first.ghost.values()) == [0, 0, 1]
  (path,) = tmp_path.iterdir()
  stored = json.loads(path.read_text())
  assert stored['key']['device_kind'] == jax.devices()[0].device_kind
  assert stored['key']['physical_batch_size'] == 8 and len(stored['key']['layers']) == 3
  assert stored['key']['program'] == step.key()
  assert stored['decisions']['whole_step']['kept'] == 'measured'
  monkeypatch.setattr(form_timing, '_MEMO', {})
  second, _ = _choose(loss_fn, params, examples, tmp_path)
  assert not second.timed and len(calls) == 3 and len(calls.whole) == 1
  assert (second.ghost, second.lines) == (first.ghost, first.lines)
  relu = per_layer.ThreeChoices(act=jax.nn.relu)  # Same layers of choice, same shapes.
  loss_fn, params, examples = per_layer._setup(relu)
  third, relu_step = _choose(loss_fn, params, examples, tmp_path)
  assert third.timed and len(calls.whole) == 2 and relu_step.key() != step.key()
  assert len(list(tmp_path.iterdir())) == 2
  per_layer._fake_timing(monkeypatch, against_flops=False)  # Winners = the FLOP rule's.
  agree, _ = _choose(loss_fn, params, examples, tmp_path / 'agree')
  assert agree.timed and not any(l.startswith('whole') for l in agree.lines)


def _float64_rows(loss_fn, params, examples):
  """Per-example gradients in float64 (x64, highest precision): (‖g_i‖ [n], C between the
  middle two norms, Σ_i clip_C(g_i))."""
  with jax.enable_x64(True), jax.default_matmul_precision('highest'):
    p64 = jax.tree.map(lambda l: np.asarray(l, np.float64), params)
    ex64 = {'x': np.asarray(examples['x'], np.float64), 'y': examples['y']}
    grads = jax.jit(jax.vmap(jax.grad(loss_fn), in_axes=(None, 0)))(p64, ex64)
    grads = jax.tree.map(np.asarray, grads)
  n = len(examples['y'])
  norms = np.sqrt(sum(np.sum(g.reshape(n, -1) ** 2, axis=1) for g in jax.tree.leaves(grads)))
  clip = float(np.mean(np.sort(norms)[n // 2 - 1 : n // 2 + 1]))
  factor = np.minimum(1.0, clip / norms)
  return norms, clip, jax.tree.map(lambda g: np.tensordot(factor, g, axes=1), grads)


@pytest.mark.slow
def test_either_assignment_gives_the_float64_norms_and_clipped_sum():
  """The two programs the whole step times (measured forms opposite to the FLOP rule's on
  every layer of choice, and the FLOP rule's) are different programs (jit's trace cache does
  not merge them) and compute the float64 per-example norms (never below, within the
  cancellation allowance) and clipped sum: the choice changes speed, not clipping at C."""
  loss_fn, params, examples = per_layer._setup()
  coverage = per_layer._coverage(loss_fn, params, examples)
  aux_loss = clipping.with_aux(loss_fn, False)
  w = np.ones(len(examples['y']), np.float32)
  norms, clip, want = _float64_rows(loss_fn, params, examples)  # Half the rows clipped.
  step = whole_step.WholeStep(
    lambda p, ex, w: clipping.ghost_clipped_sum(aux_loss, p, ex, w, clip, coverage),
    aux_loss,
    params,
    examples,
    w,
  )
  layers = [l for l in coverage.layers if form_timing.has_choice(l)]
  against = {l.key: not form_timing.flops_ghost(l) for l in layers}
  assert len(against) == 3
  inputs = (params, examples, w)
  compiled = {
    'm': whole_step.compile_with(step, against, inputs),
    'f': whole_step.compile_with(step, {}, inputs),
  }
  assert compiled['m'].as_text() != compiled['f'].as_text()
  scale = max(float(np.max(np.abs(l))) for l in jax.tree.leaves(want))
  for fn in compiled.values():
    total, rows = fn(*inputs)
    got = np.asarray(rows.norm, np.float64)
    assert np.all(got >= norms * (1 - 2e-5)), (got, norms)
    np.testing.assert_allclose(got, norms, rtol=2e-4)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale), total, want
    )
  seconds = whole_step.time_programs(compiled, inputs, repeats=1)
  assert set(seconds) == {'m', 'f'} and min(seconds.values()) > 0


def test_slow_programs_are_timed_in_fewer_rounds(monkeypatch):
  """The timing's cost is bounded: rounds are cut to BUDGET_S / (the warm-up calls' time),
  at least one; fast programs get all REPEATS rounds of several calls each."""
  ran = []

  def program(name):
    def fn(x):
      ran.append(name)
      return x

    return fn

  clock = iter(np.arange(0, 1e4, 6.0))  # Every call and sample takes 6 s by this clock.
  monkeypatch.setattr(whole_step.time, 'perf_counter', lambda: float(next(clock)))
  whole_step.time_programs({'a': program('a'), 'b': program('b')}, (np.zeros(1),))
  assert ran == ['a', 'b'] + ['a', 'b'] * 1  # Warm-up (12 s), then 20 // 12 = 1 round.
  ran.clear()
  clock = iter(np.arange(0, 1e4, 1e-3))
  monkeypatch.setattr(whole_step.time, 'perf_counter', lambda: float(next(clock)))
  whole_step.time_programs({'a': program('a'), 'b': program('b')}, (np.zeros(1),))
  rounds_calls = (len(ran) - 2) / (2 * whole_step.REPEATS)  # Every round: 50 ms of 1 ms calls.
  assert rounds_calls in (50, 51)
  c = int(rounds_calls)
  assert ran[2 : 2 + 2 * c] == ['a'] * c + ['b'] * c  # Interleaved: a sample of each in turn.


def test_random_inputs_have_the_steps_shapes_and_no_data():
  """The timed inputs: the step's shapes and dtypes; weights 1, integer inputs 0, parameters
  N(0, 1/fan-in) (scales 1, biases 0): nothing of the arguments' values."""
  params = {'Dense': {'kernel': jnp.full((4, 3), 7.0), 'bias': jnp.full((3,), 7.0)}}
  params['GroupNorm'] = {'scale': jnp.full((3,), 7.0)}
  examples = {'x': jnp.full((5, 4), 7.0), 'y': jnp.full((5,), 7, jnp.int32)}
  step = whole_step.WholeStep(None, None, params, examples, jnp.full((5,), 0.5))
  p, ex, w = step.random_inputs()
  assert jax.tree.map(np.shape, (p, ex, w)) == jax.tree.map(np.shape, (params, examples, w))
  assert ex['y'].dtype == np.int32 and not ex['y'].any() and (w == 1).all()
  assert (p['Dense']['bias'] == 0).all() and (p['GroupNorm']['scale'] == 1).all()
  assert abs(np.std(p['Dense']['kernel']) - 0.5) < 0.4 and not (ex['x'] == 7).any()
