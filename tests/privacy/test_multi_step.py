"""dpjax.privacy.multi_step: S logical steps in one call equal S calls of DPStep.train_step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.configs import digits_mlp
from dpjax.trainer.planning import plan as plan_lib
from dpjax.privacy import batching
from dpjax.data import sources as data
from dpjax.data import device as device_data
from dpjax.privacy import dp_step
from dpjax.privacy import ema as ema_lib
from dpjax.models import factory as models
from dpjax.privacy import multi_step
from dpjax.privacy import samplers
from dpjax.privacy import sharding
from dpjax.privacy import prng
from tests import executions

# Every sampler but cyclic_poisson, whose batches are Poisson's (Binomial sizes, the same
# program) and whose step runs in tests/e2e/test_train.py's SIGKILL test (BandMF).
STEP_SAMPLERS = tuple(n for n in samplers.SAMPLER_NAMES if n != 'cyclic_poisson')


def _copy(tree):
  return jax.tree.map(np.array, tree)  # The programs donate their inputs.


# The reference's EMA update in one program per sharding (eagerly, every op and leaf shape of
# `ema_lib.update`, and again for each mesh's shardings, is its own compilation).
_ema_update = jax.jit(ema_lib.update, static_argnums=2)


def _setup(sampler_name='poisson', cap=None):
  """(train, sampler, batcher, model, params) of the digits MLP; the batcher's cap B is the
  sampler's own for two epochs, or `cap`. params: a fresh copy (the programs donate theirs)."""
  train, model, params = _digits()
  sampler, batcher = _batching(sampler_name, cap)
  return train, sampler, batcher, model, _copy(params)


@functools.cache
def _digits():
  """(train, model, params) of the digits MLP, loaded and initialised once for the file."""
  config = digits_mlp.get_config()
  train, _ = data.make_sources(config.data)
  model = models.make_model(config.model, train.num_classes, train.input_shape)
  return train, model, jax.device_get(prng.init_params(model, 0, train.input_shape))


@functools.cache
def _batching(sampler_name, cap):
  """(sampler, batcher) of one sampler and cap, built once (a cap of None is resolved by the
  accountant; the batcher's logical batch is a pure function of the step)."""
  config = digits_mlp.get_config()
  config.sampler.name = sampler_name
  sampler = plan_lib.make_sampler(config, len(_digits()[0]))
  if cap is None:
    cap = _two_epoch_cap(sampler)
  return sampler, batching.Batcher(sampler, 64, cap)


def _two_epoch_cap(sampler):
  return batching.resolve_max_batch_size(
    sampler, 64, 0, num_steps=2 * sampler.steps_per_epoch, delta=1e-5
  )


@functools.cache
def _every_samplers_cap():
  """The largest cap B any sampler of the digits config resolves for two epochs: with it every
  sampler's buffers have one shape (the others get more padding slots)."""
  config = digits_mlp.get_config()
  caps = []
  for name in samplers.SAMPLER_NAMES:
    config.sampler.name = name
    caps.append(_two_epoch_cap(plan_lib.make_sampler(config, 1437)))  # Digits: 1,437 rows.
  return max(caps)


@functools.cache
def _shared_runner(expected_batch_size):
  """One MultiStep(4) per b, shared by the samplers' test (each new runner traces, lowers and
  compiles its program again): a sampler whose chunks needed another program would compile
  it again, which the test counts. Every test runs steps 0, 1, ...: repeated steps allowed (a
  host-side check, not in the program)."""
  step = dp_step.DPStep.for_model(
    _setup()[3],
    optax.sgd(0.5),
    clip_norm=1.0,
    noise_multiplier=1.0,
    expected_batch_size=expected_batch_size,
    allow_repeated_steps=True,
  )
  return step, multi_step.MultiStep(step, 4)


@functools.cache
def _momentum_step(loop, mesh):
  """The DPStep of `test_a_call_of_s_steps_equals_s_train_steps` (its reference path), one per
  (loop, mesh): the cases with and without EMA share its compiled train_step. Both paths run
  the same steps: repeated steps allowed."""
  _, sampler, _, model, _ = _setup()
  return dp_step.DPStep.for_model(
    model,
    optax.sgd(0.5, momentum=0.9),
    clip_norm=1.0,
    noise_multiplier=1.0,
    expected_batch_size=sampler.expected_batch_size,
    seed=3,
    physical_loop=loop,
    mesh=sharding.make_mesh(1) if mesh else None,
    allow_repeated_steps=True,
  )


def _prepared(batcher, first, count):
  out = []
  for t in range(first, first + count):
    logical = batcher.logical_batch(t)
    buffer, k = device_data.index_buffer(
      logical, batcher.max_physical_batches, num_rows=batcher.sampler.rows
    )
    out.append((logical, buffer, k))
  return out


@pytest.mark.slow
@pytest.mark.parametrize(
  'loop,ema_decay,mesh',
  [('device', 0.0, False), ('device', 0.9, False), ('device', 0.9, True), ('host', 0.9, False)],
)
def test_a_call_of_s_steps_equals_s_train_steps(loop, ema_decay, mesh):
  train, sampler, batcher, _, params = _setup()
  dataset = device_data.put_on_device(train)
  step = _momentum_step(loop, mesh)
  mesh = step.mesh
  runner = multi_step.MultiStep(step, 4, ema_decay=ema_decay, mesh=mesh)
  opt_state = step.optimizer.init(params)
  ema0 = ema_lib.init(params) if ema_decay else None
  # On a mesh the trainer replicates its state first (the programs' output sharding).
  _copy = (
    (lambda tree: tree if tree is None else sharding.replicate(mesh, jax.tree.map(np.array, tree)))
    if mesh is not None
    else globals()['_copy']
  )
  # Reference: one train_step (and one EMA update) per logical step, steps 5..10.
  want_p, want_o, want_e, want_m = _copy(params), _copy(opt_state), _copy(ema0), []
  for _, buffer, k in _prepared(batcher, 5, 6):
    t = 5 + len(want_m)
    want_p, want_o, m = step.train_step(want_p, want_o, buffer, k, np.uint32(t), dataset)
    if ema_decay:
      want_e = _ema_update(want_e, want_p, ema_decay)
    want_m.append(jax.device_get(m))
  # Calls of 4, then 2 slots of the same 4-slot program (no recompilation).
  got_p, got_o, got_e, got_m = _copy(params), _copy(opt_state), _copy(ema0), []
  for first, count in ((5, 4), (9, 2)):
    chunk = multi_step.stack(first, _prepared(batcher, first, count), 4)
    got_p, got_o, got_e, m = runner(got_p, got_o, got_e, chunk, dataset)
    m = jax.device_get(m)
    for name, value in m.items():  # Slots past count stay zero.
      assert np.all(value[count:] == 0), name
    got_m += multi_step.rows_of(m, count)
  for a, b in zip(
    jax.tree.leaves((got_p, got_o, got_e)), jax.tree.leaves((want_p, want_o, want_e))
  ):
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
  assert len(got_m) == len(want_m) == 6
  for g, w in zip(got_m, want_m):
    for name in w:
      np.testing.assert_allclose(g[name], w[name], rtol=1e-5, atol=1e-7, err_msg=name)
  if loop == 'device':
    assert runner.compile_count() == 1
  if ema_decay:
    assert int(got_e.count) == 6


def test_count_zero_changes_nothing():
  """The program of the samplers' test (`_shared_runner`), called with count 0."""
  train, sampler, batcher, _, params = _setup(cap=_every_samplers_cap())
  step, runner = _shared_runner(sampler.expected_batch_size)
  chunk = multi_step.stack(0, _prepared(batcher, 0, 1), 4)
  chunk.count = np.int32(0)
  got, _, ema, metrics = runner(
    _copy(params), step.optimizer.init(params), None, chunk, device_data.put_on_device(train)
  )
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), params)
  assert ema is None and all(np.all(np.asarray(v) == 0) for v in metrics.values())


def test_at_most_two_dispatched_calls_are_unfinished():
  """jax dispatches asynchronously: without `CallPacer.dispatched` the loop queued every call
  (here all 8 were unfinished right after dispatch), and a signal waited for all of them."""
  # ~25 ms a call (16 matmuls of 256²), dispatch takes microseconds: 8 chained calls are all
  # queued at once without the pacer.
  slow = jax.jit(lambda x: jax.lax.fori_loop(0, 16, lambda _, y: jnp.tanh(y @ y), x))
  x = slow(jnp.eye(256) * 0.5).block_until_ready()
  queued = [x]
  for _ in range(8):  # Chained, as training steps are: each call waits for the one before.
    queued.append(slow(queued[-1]))
  unbounded = sum(not y.is_ready() for y in queued[1:])
  pacer = multi_step.CallPacer(16, target_seconds=0.5)
  outputs, worst = [x], 0
  for _ in range(8):
    outputs.append(slow(outputs[-1]))
    pacer.dispatched(outputs[-1])
    worst = max(worst, sum(not y.is_ready() for y in outputs))
  jax.block_until_ready(queued)
  assert unbounded > 2 and worst <= 2, (unbounded, worst)


def test_schedule_ends_calls_at_boundaries_and_the_first_step():
  assert list(multi_step.schedule(0, 10, 4, (5,))) == [(0, 1), (1, 4), (5, 4), (9, 1)]
  assert list(multi_step.schedule(3, 7, 16, (0,))) == [(3, 1), (4, 3)]
  pacer = multi_step.CallPacer(16, target_seconds=0.5)
  calls = multi_step.schedule(0, 10**12, 16, (0,), limit=pacer.limit)  # O(1) memory.
  assert [next(calls) for _ in range(2)] == [(0, 1), (1, 1)]  # Until a step is timed.
  pacer.observe(steps=4, seconds=1.0)  # 0.25 s a step: 2 steps make 0.5 s.
  assert next(calls) == (2, 2)
  pacer.observe(steps=1, seconds=30.0)  # A slow model: one step a call.
  assert next(calls) == (4, 1)
  assert list(multi_step.schedule(0, 3, 1, ())) == [(0, 1), (1, 1), (2, 1)]
  assert list(multi_step.schedule(5, 5, 4, (5,))) == []
  for start, stop, size, periods in (
    (2, 100, 7, (10, 25, 0)),
    (0, 50, 16, (1,)),
    (13, 200, 5, (9, 30)),
    (0, 1, 3, (7,)),
  ):
    calls = list(multi_step.schedule(start, stop, size, periods))
    steps = [t for first, count in calls for t in range(first, first + count)]
    assert steps == list(range(start, stop)) and all(1 <= c <= size for _, c in calls)
    # Brute force: every step count a periodic action fires at ends a call.
    ends = {first + count for first, count in calls}
    assert {
      s
      for s in range(start + 1, stop + 1)
      if s == stop or s == start + 1 or any(p and s % p == 0 for p in periods)
    } <= ends


def test_steps_per_call_auto():
  assert multi_step.steps_per_call(0, 'device', True) == multi_step.AUTO_STEPS_PER_CALL
  assert multi_step.steps_per_call(0, 'device', False) == 1
  assert multi_step.steps_per_call(0, 'host', True) == 1
  assert multi_step.steps_per_call(5, 'host', False) == 5


@pytest.mark.slow
@pytest.mark.parametrize('steps_per_call,extra', [(1, 6), (4, 1)])
def test_trainer_executes_one_program_per_call_and_nothing_else_per_step(
  tmp_path, monkeypatch, steps_per_call, extra
):
  """Two runs, 6 and 12 steps, periodic actions only at the last step: the 6 more steps cost
  exactly `extra` executions of compiled programs (6 with one step a call; 1 with four: calls
  1+4+1 vs 1+4+4+3), all of the multi-step program. Nothing else runs per step."""
  from dpjax import train  # pylint: disable=import-outside-toplevel
  from tests.run_configs import small_config  # pylint: disable=import-outside-toplevel

  counts = executions.count_executions(monkeypatch)
  totals = []
  for num_steps in (6, 12):
    counts.clear()
    config = small_config(
      num_steps=num_steps,
      steps_per_call=steps_per_call,
      log_every_steps=1000,
      eval_every_steps=1000,
      checkpoint_every_steps=1000,
    )
    result = train.train_and_evaluate(config, str(tmp_path / str(num_steps)))
    assert result['compilations'] == {'train_steps': 1}
    totals.append(dict(counts))
  assert sum(totals[1].values()) - sum(totals[0].values()) == extra
  assert totals[1]['jit(_steps)'] - totals[0]['jit(_steps)'] == extra
  assert totals[0]['jit(_steps)'] == (6 if steps_per_call == 1 else 3)


@pytest.mark.parametrize('sampler_name', STEP_SAMPLERS)
def test_two_epochs_of_every_sampler_compile_the_multi_step_program_once(sampler_name):
  """K varies per step and the count per call (calls cut at a period of 5): one program, no
  backend compilation after the first call. The samplers with one b share the program
  (`_shared_runner`): it is compiled once for all of them."""
  train, sampler, batcher, model, params = _setup(sampler_name, _every_samplers_cap())
  assert sampler.rows == 1437
  step, runner = _shared_runner(sampler.expected_batch_size)
  dataset = device_data.put_on_device(train)
  opt_state = step.optimizer.init(params)
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: (
      compiles.append(name) if name == '/jax/core/compile/backend_compile_duration' else None
    )
  )
  calls = list(multi_step.schedule(0, 2 * sampler.steps_per_epoch, 4, (5,)))
  assert len({count for _, count in calls}) > 1  # The count really varied.
  for i, (first, count) in enumerate(calls):
    if i == 1:
      compiles.clear()  # The first call compiled the program (and nothing after).
    chunk = multi_step.stack(first, _prepared(batcher, first, count), 4)
    params, opt_state, _, metrics = runner(params, opt_state, None, chunk, dataset)
  jax.block_until_ready(metrics)
  assert runner.compile_count() == 1 and compiles == []
