"""Data-parallel training on 4 forced CPU devices against the 1-device run.

JAX fixes the device count when it starts its backend, so the checks run in processes of
their own, forked together from one interpreter that imported their modules but started no
backend (tests/forked_cli.py --together), each with its own device count:

* a worker with XLA_FLAGS=--xla_force_host_platform_device_count=4 (this file:
  `python -m tests.privacy.test_sharding OUTDIR`) runs the digits MLP for 6 steps on 4
  devices and on 1 (`config.num_devices`), resumes a 4-device checkpoint on 4
  devices and on 1, and writes what it saw;
* a 2-host job on localhost: two `python -m dpjax.train --distributed`
  processes with 2 devices each, the same run over 4 devices in 2 processes.

Parity tolerance: 1e-5 absolute on every parameter. 4 devices sum each
physical batch's clipped gradients in 4 partial sums reduced across devices
instead of one sum, so float32 rounding differs (measured: 3e-8 max, one ulp
at |p| ~ 0.35). Any real sharding bug moves parameters by far more: noise
added on each device or with another key, or a shard of the batch dropped,
changes the update by ~σC/b = 1/128 ~ 8e-3 per step.
"""

import collections
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from dpjax.privacy import prng
from dpjax.trainer.loop import training_loop
from dpjax.utils.child_env import child_env
from tests import independent

pytestmark = pytest.mark.slow  # Whole trainings or child processes (`make test-unit` skips).

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_DEVICES = 4
NUM_STEPS = 6
PARITY_ATOL = 1e-5
GLOO_LINE = (
  '[Gloo] Rank 1 is connected to 1 peer ranks. '  # What process 1 may print.
  'Expected number of connected peer ranks is : 1'
)
RUN = {  # configs/digits_mlp.py with these fields, for every run here.
  'seed': 0,  # Fixed: runs on different device counts are compared bit for bit.
  'num_epochs': 0,
  'num_steps': NUM_STEPS,
  'sampler.batch_size': 128,
  'sampler.physical_batch_size': 32,  # 8 rows per device on 4 devices.
  'privacy.target_epsilon': 0.0,
  'privacy.noise_multiplier': 1.0,
  'log_every_steps': 3,
  'eval_every_steps': 100,  # Evaluated at steps 0 and 6 only.
  'checkpoint_every_steps': 3,
}


def _config(**overrides):
  from dpjax.configs import digits_mlp  # pylint: disable=g-import-not-at-top

  config = digits_mlp.get_config()
  config.update_from_flattened_dict({**RUN, **overrides})
  return config


def _flat(tree):
  import jax  # pylint: disable=g-import-not-at-top

  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def _resume_from_step_3(outdir, source, name, num_devices, train):
  """Copy a finished run, drop its last checkpoint, rerun: it resumes at step 3."""
  workdir = os.path.join(outdir, name)
  shutil.copytree(os.path.join(outdir, source), workdir)
  shutil.rmtree(os.path.join(workdir, 'checkpoints', str(NUM_STEPS)))
  return train.train_and_evaluate(_config(num_devices=num_devices), workdir)


def _train_step_parity(arrays):
  """The fused logical step (`DPStep.train_step`, [K_max, P] index buffer over the dataset
  on the device) for 2 steps: on 1 device, and with the buffer's rows split over the 4
  devices (dataset replicated) by the device loop and by the host loop. Moved here from
  tests/privacy/test_dp_step.py, whose own 4-device child process it was."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from dpjax.privacy import batching  # pylint: disable=g-import-not-at-top
  from dpjax.data import sources as data  # pylint: disable=g-import-not-at-top
  from dpjax.data import device as device_data  # pylint: disable=g-import-not-at-top
  from dpjax.privacy import dp_step  # pylint: disable=g-import-not-at-top
  from dpjax.models import factory as models  # pylint: disable=g-import-not-at-top
  from dpjax.trainer.planning import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from dpjax.privacy import sharding  # pylint: disable=g-import-not-at-top
  from dpjax.configs import digits_mlp  # pylint: disable=g-import-not-at-top

  config = digits_mlp.get_config()  # Its default sampler, not RUN's.
  train_source, _ = data.make_sources(config.data)
  sampler = plan_lib.make_sampler(config, len(train_source))
  batcher = batching.Batcher(sampler, 64, 512)
  model = models.make_model(config.model, train_source.num_classes, train_source.input_shape)
  replicated = []
  for name, mesh in (('one', None), ('four', sharding.make_mesh(4))):
    for loop in ('device', 'host') if mesh else ('device',):
      step = dp_step.DPStep.for_model(
        model,
        optax.sgd(0.5),
        clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=sampler.expected_batch_size,
        mesh=mesh,
        physical_loop=loop,
        seed=4,
      )
      dataset = device_data.put_on_device(train_source, mesh and sharding.replicated(mesh))
      params = prng.init_params(model, 0, train_source.input_shape)
      state = (params, step.optimizer.init(params))
      arrays['train_step_init'] = _flat(params)
      for t in range(2):
        buf, k = device_data.index_buffer(batcher.logical_batch(t), 8, num_rows=len(dataset))
        *state, _ = step.train_step(*state, buf, k, np.uint32(t), dataset)
      arrays[f'train_step_{name}_{loop}'] = _flat(state[0])
      if mesh is not None:
        replicated.append(all(l.sharding.is_fully_replicated for l in jax.tree.leaves(state[0])))
  return replicated


def _worker(outdir):
  """Runs in the 4-device subprocess; writes results.json and params.npz."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from dpjax import train
  from dpjax.trainer.workdir import checkpoints
  from dpjax.data import sources as data
  from dpjax.privacy import dp_step
  from dpjax.models import factory as models
  from dpjax.trainer.planning import optimizers
  from dpjax.privacy import sharding  # pylint: disable=g-import-not-at-top
  from dpjax.privacy import ema as ema_lib  # pylint: disable=g-import-not-at-top

  # Every run builds its own accountant: the resumed runs' ε is theirs, checked against
  # dp_accounting by the tests (a shared accountant made a resume compare ε with itself).
  out = {'device_count': jax.device_count()}
  # (b) Bad P or device count: a clear error before anything is written.
  for name, overrides in (
    ('bad_p', {'sampler.physical_batch_size': 30}),
    ('bad_devices', {'num_devices': 5}),
  ):
    try:
      train.train_and_evaluate(_config(**overrides), os.path.join(outdir, name))
      out[name] = None
    except ValueError as e:
      out[name] = str(e)
    out[name + '_wrote'] = os.path.exists(os.path.join(outdir, name, 'checkpoints'))

  # The compiled accumulate step reduces the clipped sums across the 4 devices.
  mesh = sharding.make_mesh()
  config = _config()
  source, _ = data.make_sources(config.data)
  model = models.make_model(config.model, source.num_classes, source.input_shape)
  step = dp_step.DPStep.for_model(
    model, optax.sgd(1.0), clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=128, mesh=mesh
  )
  host_params = jax.device_get(prng.init_params(model, 0, source.input_shape))
  host_batch = source.gather(np.arange(32))
  host_batch['weight'] = np.ones(32, np.float32)
  params = sharding.replicate(mesh, host_params)
  batch = jax.device_put(host_batch, sharding.batch_sharding(mesh))
  out['batch_rows_per_device'] = sorted(s.data.shape[0] for s in batch['x'].addressable_shards)
  hlo = step.accumulate.lower(params, step.init_accumulator(params), batch).compile().as_text()
  out['accumulate_has_all_reduce'] = 'all-reduce' in hlo
  # The per-example-gradient clipping (the runs below use ghost clipping) gives the same sums.
  sums = {}
  one_device = lambda tree: jax.device_put(tree, jax.devices()[0])
  for name, mesh_, p, b in (
    ('vmap4', mesh, params, batch),
    ('vmap1', None, one_device(host_params), one_device(host_batch)),
  ):
    vmap_step = dp_step.DPStep.for_model(
      model,
      optax.sgd(1.0),
      clip_norm=0.1,
      noise_multiplier=1.0,
      expected_batch_size=128,
      clipping='vmap',
      mesh=mesh_,
    )
    acc = vmap_step.accumulate(p, vmap_step.init_accumulator(p), b)
    out[name + '_devices'] = len(jax.tree.leaves(acc.grad_sum)[0].sharding.device_set)
    sums[name] = _flat(acc.grad_sum)
    out[name + '_num_clipped'] = int(acc.stats.num_clipped)
  out['vmap_max_abs_diff'] = float(np.max(np.abs(sums['vmap4'] - sums['vmap1'])))

  # (a) 4 devices vs 1 device, same config.
  arrays = {}
  for name, num_devices in (('full4', 0), ('full1', 1)):
    result = train.train_and_evaluate(_config(num_devices=num_devices), os.path.join(outdir, name))
    arrays[name] = _flat(result['params'])
    out[name] = {
      'epsilon': result['privacy']['epsilon'],
      'compilations': result['compilations'],
      'param_devices': len(jax.tree.leaves(result['params'])[0].sharding.device_set),
    }

  # (c) Resume a 4-device checkpoint on 4 devices (exact) and on 1 device.
  for name, num_devices in (('resume4', 0), ('resume1', 1)):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
      result = _resume_from_step_3(outdir, 'full4', name, num_devices, train)
    arrays[name] = _flat(result['params'])
    out[name] = {
      'epsilon': result['privacy']['epsilon'],
      'resumed_from_3': 'Resuming from step 3' in stdout.getvalue(),
      'checkpoint_epsilons': [
        row['privacy']['epsilon'] for row in checkpoints.read_metadata(os.path.join(outdir, name))
      ],
    }
  out['full4_checkpoint_epsilons'] = [
    row['privacy']['epsilon'] for row in checkpoints.read_metadata(os.path.join(outdir, 'full4'))
  ]
  # The saved step-3 state restores bit for bit onto a 1-device mesh.
  optimizer = optimizers.make_optimizer(config.optimizer, config.num_steps)
  manager = checkpoints.make_manager(os.path.join(outdir, 'full4'), 3, read_only=True)
  for name, mesh_ in (('restored_on_1', sharding.make_mesh(1)), ('restored_on_4', mesh)):
    target = sharding.replicate(
      mesh_,
      training_loop.TrainState(
        step=np.int32(0),
        params=host_params,
        opt_state=optimizer.init(host_params),
        num_truncated=np.int32(0),
        ema=ema_lib.init(host_params),
      ),
    )
    state = manager.restore(
      3, args=checkpoints.ocp.args.Composite(state=checkpoints.ocp.args.StandardRestore(target))
    )['state']
    arrays[name] = _flat(state.params)
    out[name + '_devices'] = len(jax.tree.leaves(state.params)[0].sharding.device_set)
  out['train_step_four_replicated'] = _train_step_parity(arrays)
  np.savez(os.path.join(outdir, 'params.npz'), **arrays)
  with open(os.path.join(outdir, 'results.json'), 'w') as f:
    json.dump(out, f)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _device_count_flags(count: int) -> dict:
  """A forked child's XLA_FLAGS (read when its jax starts the backend, after the fork): `count`
  CPU devices."""
  flags_ = f'{os.environ.get("XLA_FLAGS", "")} --xla_force_host_platform_device_count={count}'
  return {'XLA_FLAGS': flags_.strip()}


def _run_both(outdir):
  """Runs the 2-host job and the 4-device worker together into outdir; waits for both.

  All three processes are forked at once from one interpreter that imported what they import
  (tests/forked_cli.py --together): `python -m dpjax.train --distributed` twice and `python -m
  tests.privacy.test_sharding OUTDIR`, each with its own device count; two interpreters'
  imports (~4 s of CPU each) spared. One still running after 600 s gets SIGABRT and prints
  every thread's stack (PYTHONFAULTHANDLER=1): a hang fails with them."""
  outdir = pathlib.Path(outdir)
  port = _free_port()
  flags_ = [f'--config.{key}={value}' for key, value in RUN.items()]
  hosts = [
    {
      'module': 'dpjax.train',
      'argv': [
        f'--config={REPO}/configs/digits_mlp.py',
        f'--workdir={outdir / "multihost"}',
        *flags_,
        '--distributed',
        f'--coordinator_address=localhost:{port}',
        '--num_processes=2',
        f'--process_id={i}',
      ],
      'cwd': REPO,
      'env': _device_count_flags(2),
    }
    for i in range(2)
  ]
  worker = {
    'module': 'tests.privacy.test_sharding',
    'argv': [str(outdir)],
    'cwd': REPO,
    'env': _device_count_flags(NUM_DEVICES),
  }
  # (The worker writes results.json and params.npz; the forked processes' own go beside them.)
  (outdir / 'forked_cases.json').write_text(json.dumps([worker, *hosts]))
  subprocess.run(
    [sys.executable, '-m', 'tests.forked_cli', '-', 'forked_cases.json', 'forked_results.json']
    + ['--together', '600'],
    cwd=outdir,
    env=child_env(JAX_PLATFORMS='cpu', PYTHONFAULTHANDLER='1'),
    timeout=900,
    check=True,
  )
  proc, *host_out = json.loads((outdir / 'forked_results.json').read_text())
  if any(result['timed_out'] for result in host_out):
    stacks = [result['stderr'][-20000:] for result in host_out]
    pytest.fail('the 2-process run did not finish; its threads:\n' + '\n'.join(stacks))
  assert proc['returncode'] == 0, proc['stderr'][-5000:]
  for host in host_out:
    assert host['returncode'] == 0, host['stderr'][-5000:]
  with open(outdir / 'host_stdout.json', 'w') as f:
    json.dump([host['stdout'] for host in host_out], f)


@pytest.fixture(scope='module')
def runs(shared_setup):
  """The runs' results, once per test session (pytest-xdist workers share them): the tests
  here only read them."""
  outdir = pathlib.Path(shared_setup('sharding', _run_both))
  with open(outdir / 'results.json') as f:
    results = json.load(f)
  with open(outdir / 'host_stdout.json') as f:
    results['host_stdout'] = json.load(f)
  return results, dict(np.load(outdir / 'params.npz')), outdir


@pytest.fixture(scope='module')
def worker(runs):
  return runs[:2]


def test_four_devices_match_one_device_and_report_the_same_epsilon(worker):
  results, params = worker
  assert results['device_count'] == NUM_DEVICES
  # The work really is spread: 8 rows per device, a cross-device reduction, state on 4 devices.
  assert results['batch_rows_per_device'] == [8] * NUM_DEVICES
  assert results['accumulate_has_all_reduce']
  assert results['full4']['param_devices'] == NUM_DEVICES and results['full1']['param_devices'] == 1
  np.testing.assert_allclose(params['full4'], params['full1'], rtol=0, atol=PARITY_ATOL)
  assert not np.allclose(
    params['full4'], params['restored_on_1'], atol=1e-3
  )  # Training moved them.
  assert results['full4']['epsilon'] == results['full1']['epsilon']
  assert results['full4']['compilations'] == {'train_steps': 1}


def test_vmap_clipping_sums_match_across_device_counts(worker):
  results, _ = worker
  assert (results['vmap4_devices'], results['vmap1_devices']) == (NUM_DEVICES, 1)
  assert results['vmap4_num_clipped'] == results['vmap1_num_clipped'] > 0  # C = 0.1 clips.
  assert results['vmap_max_abs_diff'] <= PARITY_ATOL


def test_two_hosts_train_like_one_and_only_process_0_writes(runs):
  from dpjax.trainer.workdir import checkpoints  # pylint: disable=g-import-not-at-top

  results, params, outdir = runs
  workdir = str(outdir / 'multihost')
  process0, process1 = results['host_stdout']
  assert '4 device(s) on 2 process(es), 16 rows of each physical batch gathered here' in process0
  assert 'Final: step 6' in process0
  # Process 1 prints nothing of dpjax's. Gloo's connection log is not ours, and its threads'
  # writes interleave anywhere, even inside a word ('[Gloo] Rank [Gloo] Rank 2 is ... 3 is ...'
  # was seen). So the characters are counted: digits and white space aside, the output must be
  # whole copies of Gloo's line, one per '[Gloo]', and nothing else.
  gloo = collections.Counter(re.sub(r'[\d\s]', '', GLOO_LINE))
  seen = collections.Counter(re.sub(r'[\d\s]', '', process1))
  assert seen == collections.Counter({c: n * seen['G'] for c, n in gloo.items()}), process1
  state = checkpoints.read_state(workdir, NUM_STEPS)
  np.testing.assert_allclose(_flat(state['params']), params['full4'], rtol=0, atol=PARITY_ATOL)
  rows = checkpoints.read_metadata(workdir)
  assert [row['privacy']['epsilon'] for row in rows] == results['full4_checkpoint_epsilons']
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    assert [json.loads(line)['step'] for line in f] == [0, 3, 6]  # Written once, by process 0.


def test_physical_batch_not_a_multiple_of_the_device_count_is_refused(worker):
  results, _ = worker
  message = results['bad_p']
  assert message is not None
  assert (
    'sampler.physical_batch_size = 30' in message
    and 'hold different examples (4 = data × fsdp' in message
  )
  assert 'num_devices' in results['bad_devices'] and '[0, 4]' in results['bad_devices']
  assert not results['bad_p_wrote'] and not results['bad_devices_wrote']


def test_resume_on_the_same_device_count_is_exact(worker):
  results, params = worker
  assert results['resume4']['resumed_from_3']
  np.testing.assert_array_equal(params['resume4'], params['full4'])
  assert results['resume4']['checkpoint_epsilons'] == results['full4_checkpoint_epsilons']


def test_every_run_and_resume_reports_the_epsilon_of_dp_accounting(runs):
  """Each checkpoint's ε, of the 4-device, 1-device, 2-host and resumed runs, against
  dp_accounting's PLD called directly for that step count (q = b/N, σ/(1 + η) with η from
  its closed form): the resumed runs' ε used to be compared only with the full run's, whose
  accountant the worker handed them, so nothing a resumed run's own accounting did was seen
  (planted, in `plan_lib` on resume: a 0.05 PLD grid gave ε(6) = 2.2760 vs dp_accounting's
  2.2690, here a failure, and the shared accountant hid it; an RDP accountant on resume was
  even refused by the run's own fingerprint check once each run built its own).
  """
  from dpjax.trainer.workdir import checkpoints  # pylint: disable=g-import-not-at-top

  _, _, outdir = runs
  q = RUN['sampler.batch_size'] / 1437  # sklearn's digits: 1,437 training rows.
  expected = {}
  for name in ('full4', 'full1', 'multihost', 'resume4', 'resume1'):
    rows = checkpoints.read_metadata(str(outdir / name))
    assert [row['step'] for row in rows] == [3, 6], name
    for row in rows:
      fp = row['fingerprint']
      assert (fp['sampler.num_examples'], fp['privacy.noise_multiplier']) == (1437, 1.0)
      assert fp['privacy.rounding_eta'] == pytest.approx(
        independent.float32_eta(fp['sampler.max_batch_size']), rel=1e-9
      )
      key = (row['step'], fp['privacy.delta'], fp['privacy.rounding_eta'])
      if key not in expected:
        expected[key] = independent.poisson_gaussian_epsilon(q, 1.0, *key)
      assert row['privacy']['steps'] == row['step'], name
      assert row['privacy']['epsilon'] == pytest.approx(expected[key], rel=1e-3), name


def test_restore_on_one_device_continues_the_four_device_run(worker):
  results, params = worker
  # The replicated state restores onto any mesh, bit for bit.
  assert results['restored_on_1_devices'] == 1 and results['restored_on_4_devices'] == NUM_DEVICES
  np.testing.assert_array_equal(params['restored_on_1'], params['restored_on_4'])
  assert results['resume1']['resumed_from_3']
  np.testing.assert_allclose(params['resume1'], params['full4'], rtol=0, atol=PARITY_ATOL)
  assert results['resume1']['epsilon'] == results['full4']['epsilon']
  assert results['resume1']['checkpoint_epsilons'] == results['full4_checkpoint_epsilons']


def test_train_step_on_four_devices_equals_one_device(worker):
  """The [K_max, P] buffer split over 4 devices (rows), dataset replicated: the same params
  as on one device, by the device loop and by the host loop (moved from test_dp_step.py)."""
  results, params = worker
  assert results['train_step_four_replicated'] == [True, True]
  ref = params['train_step_one_device']
  for name in ('train_step_four_device', 'train_step_four_host'):
    np.testing.assert_allclose(params[name], ref, rtol=0, atol=PARITY_ATOL, err_msg=name)
  assert not np.allclose(ref, params['train_step_init'], atol=1e-3)  # The steps moved them.


if __name__ == '__main__':
  _worker(sys.argv[1])
