"""Clipping forms chosen by measurement (`ghost_clipping.form_timing`): the forms change speed
only, the decisions are cached on disk keyed by device and shapes, a failure falls back to the
FLOP rule, and the step's log says what was chosen from which times."""

from collections.abc import Callable
import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.privacy import clipping
from dpjax.privacy import dp_step
from dpjax.privacy import ghost_clipping
from dpjax.privacy.ghost_clipping import form_timing
from dpjax.privacy.ghost_clipping import whole_step
from tests.privacy.ghost_clipping import harness

C = 1.0


class ThreeChoices(nn.Module):
  """A conv (materialised by the FLOP rule), a dense over positions (ghost) and an embedding
  (ghost), each with two forms; a rank-1 head with one."""

  width: int = 16
  act: Callable = jnp.tanh

  @nn.compact
  def __call__(self, x):
    n = x.shape[0]
    tokens = jnp.floor(jnp.abs(x[:, :, 0, 0]) * 2).astype(jnp.int32)  # [n, 6], repeats.
    conv = nn.Conv(4, (3, 3), strides=2)(x)  # S=9, m=27, c=4: materialised.
    dense = nn.Dense(self.width)(x.reshape(n, 6, 18))  # S=6, m=18, c=16: ghost.
    embed = nn.Embed(50, 4)(tokens)  # V=50 > T=6: ghost.
    h = jnp.concatenate([self.act(b).reshape(n, -1) for b in (conv, dense, embed)], -1)
    return nn.Dense(harness.K)(h)


def _setup(model=None, n=8):
  model = model or ThreeChoices()
  x, y = harness.inputs((6, 6, 3), n, seed=3)
  params = harness.init(model, x, seed=4)
  loss_fn = lambda p, ex: -jax.nn.log_softmax(model.apply({'params': p}, ex['x'][None])[0])[ex['y']]
  return loss_fn, params, {'x': x, 'y': y}


def _coverage(loss_fn, params, examples):
  one = jax.tree.map(lambda l: l[0], examples)
  return ghost_clipping.analyse_coverage(clipping.with_aux(loss_fn, False), params, one)


def _fake_timing(monkeypatch, against_flops: bool = False, seconds=None, whole=None):
  """time_layer replaced by a counter whose times make the FLOP rule's form win (or the other
  one, against_flops), or that returns `seconds`; the whole clipped sum is not compiled, and
  its timing returns `whole` (default: the measured forms 2x faster). Returns the layers'
  calls; `calls.whole` the whole-step timings' {name: program}."""
  calls = _Calls()
  monkeypatch.setattr(whole_step, 'compile_with', lambda step, table, inputs: dict(table))

  def fake_whole(programs, inputs, repeats=whole_step.REPEATS):
    calls.whole.append(programs)
    return dict(whole or {'measured': 1e-3, 'flops': 2e-3})

  monkeypatch.setattr(whole_step, 'time_programs', fake_whole)

  def fake(layer, theta, n, repeats=form_timing.REPEATS):
    del theta, repeats
    calls.append((layer.key, n))
    if seconds is not None:
      return dict(seconds)
    ghost_wins = form_timing.flops_ghost(layer) != against_flops
    return {'ghost': 1e-3 if ghost_wins else 2e-3, 'materialised': 2e-3 if ghost_wins else 1e-3}

  monkeypatch.setattr(form_timing, 'time_layer', fake)
  monkeypatch.setattr(form_timing, '_MEMO', {})
  return calls


class _Calls(list):
  def __init__(self):
    super().__init__()
    self.whole = []


@pytest.mark.slow  # Compiles a four-layer convnet three ways (12-17 s cold).
def test_forms_opposite_to_the_flop_rule_give_the_same_clipped_sum_and_bound_a_neighbour(
  monkeypatch, tmp_path
):
  """Measurement that makes every layer take the form the FLOP rule would not: the step runs
  those forms (its log says so), its clipped sum equals per-example gradients' (vmap) to float
  rounding, and removing one record moves the sum by at most C(1 + η)."""
  monkeypatch.setattr(form_timing, 'cache_dir', lambda: str(tmp_path))
  _fake_timing(monkeypatch, against_flops=True)
  loss_fn, params, examples = _setup()
  w = np.ones(len(examples['y']), np.float32)
  measured = clipping.clipped_grad(loss_fn, C, method='ghost', forms='measured')
  reference = clipping.clipped_grad(loss_fn, C, method='vmap')
  without = w * (np.arange(len(w)) != 5)  # D minus record 5 (its weight 0).
  run = jax.jit(measured)  # One program: the weights are an argument.
  (got, _), (neighbour, _) = run(params, examples, w), run(params, examples, without)
  want, rows = jax.jit(reference)(params, examples, w)
  norms = rows.norm
  forms = measured.choice[measured.choice.index('all layers:') + 1 :]
  flop_forms = _coverage(loss_fn, params, examples).layer_forms()  # The FLOP rule's.
  assert len(forms) == len(flop_forms) == 4
  assert sum(l not in flop_forms for l in forms) == 3, measured.choice
  assert any('Conv_0: conv ghost' in l for l in forms)  # The FLOP rule: materialised.
  assert any('Dense_0: dense materialised' in l for l in forms)  # The FLOP rule: ghost.
  assert any('Embed_0: embed materialised' in l for l in forms)
  scale = max(float(np.max(np.abs(l))) for l in jax.tree.leaves(want))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * scale), got, want
  )
  diff = np.sqrt(
    sum(
      np.sum(np.square(np.float64(a) - np.float64(b)))
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(neighbour))
    )
  )
  assert norms[5] > C and C * (1 - 1e-5) < diff <= C * (1 + 1e-5), (norms, diff)


def test_the_cache_is_read_on_a_second_call_and_keyed_by_shapes(monkeypatch, tmp_path):
  """Timed once per (device, P, layer shapes): a second choice reads the JSON on disk (with
  the in-memory copy cleared) and times nothing; another P or another width times again."""
  calls = _fake_timing(monkeypatch)
  loss_fn, params, examples = _setup()
  coverage = _coverage(loss_fn, params, examples)
  thetas = [ghost_clipping.coverage.subtree(params, l.param_path) for l in coverage.layers]
  first = form_timing.choose_forms(coverage, thetas, 8, str(tmp_path))
  assert first.timed and len(calls) == 3 and len(first.ghost) == 3
  (path,) = tmp_path.iterdir()
  stored = json.loads(path.read_text())
  assert stored['key']['device_kind'] == jax.devices()[0].device_kind
  assert stored['key']['physical_batch_size'] == 8
  monkeypatch.setattr(form_timing, '_MEMO', {})
  second = form_timing.choose_forms(coverage, thetas, 8, str(tmp_path))
  assert not second.timed and len(calls) == 3 and second.ghost == first.ghost
  assert second.lines == first.lines
  form_timing.choose_forms(coverage, thetas, 16, str(tmp_path))  # Another P.
  assert len(calls) == 6 and all(n == 16 for _, n in calls[3:])
  loss_fn, params, examples = _setup(ThreeChoices(width=24))  # Another dense width.
  coverage = _coverage(loss_fn, params, examples)
  thetas = [ghost_clipping.coverage.subtree(params, l.param_path) for l in coverage.layers]
  form_timing.choose_forms(coverage, thetas, 8, str(tmp_path))
  assert len(calls) == 9 and len(list(tmp_path.iterdir())) == 3


def test_a_tie_keeps_the_flop_rule_and_a_clear_winner_takes_it():
  assert form_timing.decide({'ghost': 1.0, 'materialised': 1.04}, False) is False
  assert form_timing.decide({'ghost': 1.04, 'materialised': 1.0}, True) is True
  assert form_timing.decide({'ghost': 1.0, 'materialised': 1.2}, False) is True
  assert form_timing.decide({'ghost': 1.2, 'materialised': 1.0}, True) is False


def test_a_failed_timing_falls_back_to_the_flop_rule_and_says_so(monkeypatch, tmp_path):
  def broken(*args, **kwargs):
    raise RuntimeError('out of memory')

  monkeypatch.setattr(form_timing, 'time_layer', broken)
  monkeypatch.setattr(form_timing, '_MEMO', {})
  loss_fn, params, examples = _setup()
  coverage = _coverage(loss_fn, params, examples)
  thetas = [ghost_clipping.coverage.subtree(params, l.param_path) for l in coverage.layers]
  choice = form_timing.choose_forms(coverage, thetas, 8, str(tmp_path))
  assert choice.ghost == {} and not choice.timed
  assert choice.lines == (
    'timing the forms failed (RuntimeError: out of memory); the FLOP rule decides',
  )
  assert not list(tmp_path.iterdir())  # Nothing cached: the next run times again.


def test_timing_runs_both_forms_of_a_layer_on_this_device():
  """The real timer: both forms compiled and run (positive medians), and they are different
  programs (forcing a form changes what the layer computes)."""
  loss_fn, params, examples = _setup(n=4)
  coverage = _coverage(loss_fn, params, examples)
  (dense,) = [l for l in coverage.layers if l.param_path == ('Dense_0',)]
  seconds = form_timing.time_layer(
    dense, ghost_clipping.coverage.subtree(params, ('Dense_0',)), 4, repeats=2
  )
  assert set(seconds) == {'ghost', 'materialised'} and min(seconds.values()) > 0
  assert form_timing.has_choice(dense)
  (head,) = [l for l in coverage.layers if l.param_path == ('Dense_1',)]
  assert not form_timing.has_choice(head)  # S = 1: rank-1 in both forms.


def test_the_step_logs_the_measured_choice_and_times(monkeypatch, tmp_path):
  """DPStep(clipping_forms='measured'): the trainer's start line ('Clipping: ' + these lines)
  names each layer's measured form, both times and the FLOP rule's choice."""
  monkeypatch.setattr(form_timing, 'cache_dir', lambda: str(tmp_path))
  _fake_timing(monkeypatch, seconds={'ghost': 3e-3, 'materialised': 1e-3})
  model = ThreeChoices()
  x, y = harness.inputs((6, 6, 3), 4, seed=3)
  params = harness.init(model, x, seed=4)
  step = dp_step.DPStep.for_model(
    model,
    optax.sgd(0.1),
    clip_norm=C,
    noise_multiplier=1.0,
    expected_batch_size=4,
    clipping_forms='measured',
  )
  batch = {'x': x, 'y': y, 'weight': np.ones(4, np.float32)}
  step.accumulate.lower(params, step.init_accumulator(params), batch)  # Traced, not compiled.
  lines = step.clipping_choice
  assert re.fullmatch(
    r'ghost clipping, per layer, forms measured on this device \(timed now '
    r'in \d+\.\d s\):',
    lines[0],
  ), lines[0]
  assert (
    'Dense_0: materialised (measured: ghost 3 ms, materialised 1 ms; FLOP rule: ghost)' in lines
  ), lines
  assert 'Dense_0: dense materialised (S=6, m=18, c=16)' in lines
  with pytest.raises(ValueError, match=r"forms='fast'; valid: \('flops', 'measured'\)"):
    dp_step.DPStep.for_model(
      model,
      optax.sgd(0.1),
      clip_norm=C,
      noise_multiplier=1.0,
      expected_batch_size=4,
      clipping_forms='fast',
    )
