"""The trainer with its state split over a mesh (issue 37): FSDP runs, resumes across layouts,
a 2-process FSDP job, the start line's bytes and the refusal of a state that cannot fit.

JAX fixes the device count when it starts its backend, so the checks run in processes of their
own, forked together from one interpreter that imported their modules (tests/forked_cli.py
--together):

* a worker with 8 forced CPU devices (`python -m tests.trainer.test_sharded_training OUTDIR`)
  trains `configs/digits_transformer.py:runlocal` (3 steps, seed 7, σ = 1) with mesh.fsdp = 4
  (data = 2), with mesh.fsdp = 1 (data = 8) and on one device; resumes the fsdp = 4 run on
  data = 8 and that one on one device, the one-device run on fsdp = 4, and the fsdp = 4 run on
  fsdp = 4; checks the bad mesh fields and a state too large for a (fake) device;
* a 2-process job on localhost: two `python -m dpjax.train --distributed` processes with 4
  devices each, mesh.fsdp = 4.

Parity tolerance: 1e-5 of each parameter array's largest entry. The layouts differ only in
how float32 sums are split over devices (measured: 3e-8 absolute). A sharding bug moves
parameters by far more: noise drawn per shard with the wrong key or added twice, a shard of
an FSDP-split Adam state restored onto the wrong devices, or a dropped example group each
change an update by ~lr = 3e-3.
"""

import contextlib
import io
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from dpjax.utils.child_env import child_env

pytestmark = pytest.mark.slow  # Whole trainings in child processes.

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_DEVICES = 8
RTOL = 1e-5
RUN_STEPS = 3  # runlocal's.
RUN = {  # configs/digits_transformer.py:runlocal (3 steps) with these fields, for every run.
  'seed': 7,
  'model.num_layers': 1,  # Half of runlocal's: a trace of the ghost-clipped step is per layer.
  'sampler.batch_size': 64,
  'sampler.physical_batch_size': 32,  # 4 rows per example group on data × fsdp = 8.
  'privacy.target_epsilon': 0.0,
  'privacy.noise_multiplier': 1.0,
  'log_every_steps': 3,
  'eval_every_steps': 100,  # Evaluated at steps 0 and 3 only.
  'checkpoint_every_steps': 1,
}
LAYOUTS = {'f4': {'mesh.fsdp': 4}, 'd8': {}, 'one': {'num_devices': 1}}
# (name, the run it resumes, the checkpoint it resumes from, the layout it resumes on).
RESUMES = (
  ('f4_to_d8', 'f4', 1, 'd8'),
  ('d8_to_one', 'f4_to_d8', 2, 'one'),
  ('one_to_f4', 'one', 1, 'f4'),
  ('f4_to_f4', 'f4', 2, 'f4'),
)


def _config(**overrides):
  from dpjax.configs import digits_transformer  # pylint: disable=g-import-not-at-top

  config = digits_transformer.get_config('runlocal')
  config.update_from_flattened_dict({**RUN, **overrides})
  return config


def _leaves(tree) -> dict:
  import jax  # pylint: disable=g-import-not-at-top

  return {
    jax.tree_util.keystr(path): np.asarray(leaf, np.float64)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def _train(outdir, name, overrides, train):
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    result = train.train_and_evaluate(_config(**overrides), os.path.join(outdir, name))
  return result, stdout.getvalue()


def _refusals(outdir, train, out):
  """Bad mesh fields, and a state larger than a (fake) 32 kB device: one line each, nothing
  written."""
  from dpjax.trainer.planning import physical_batch  # pylint: disable=g-import-not-at-top

  cases = {
    'bad_fsdp': {'mesh.fsdp': 3},
    'zero_fsdp': {'mesh.fsdp': 0},
    'bad_p': {'mesh.fsdp': 4, 'sampler.physical_batch_size': 12},
  }
  real = physical_batch.device_memory_bytes
  for name, overrides in (*cases.items(), ('too_big', {'mesh.fsdp': 4})):
    physical_batch.device_memory_bytes = (lambda device=None: 32_000) if name == 'too_big' else real
    try:
      _train(outdir, name, overrides, train)
      out[name] = None
    except ValueError as e:
      out[name] = str(e)
    finally:
      physical_batch.device_memory_bytes = real
    out[name + '_wrote'] = os.path.exists(os.path.join(outdir, name, 'checkpoints'))


def _worker(outdir):
  """Runs in the 8-device subprocess; writes results.json and params.npz."""
  import jax  # pylint: disable=g-import-not-at-top
  from dpjax import train  # pylint: disable=g-import-not-at-top
  from dpjax.trainer.workdir import checkpoints  # pylint: disable=g-import-not-at-top

  out, arrays = {'device_count': jax.device_count()}, {}
  _refusals(outdir, train, out)
  for name, overrides in LAYOUTS.items():
    start = time.process_time()
    result, stdout = _train(outdir, name, overrides, train)
    leaves = jax.tree.leaves(result['params'])
    out[name] = {
      'cpu_s': time.process_time() - start,
      'epsilon': result['privacy']['epsilon'],
      'stdout': stdout,
      'specs': [str(leaf.sharding.spec) for leaf in leaves],
      'shard_shapes': [list(leaf.addressable_shards[0].data.shape) for leaf in leaves],
      'shapes': [list(leaf.shape) for leaf in leaves],
      'layouts': [row.get('layout') for row in checkpoints.read_metadata(f'{outdir}/{name}')],
    }
    arrays.update({f'{name}{k}': v for k, v in _leaves(result['params']).items()})
  for name, source, step, layout in RESUMES:
    shutil.copytree(os.path.join(outdir, source), os.path.join(outdir, name))
    for later in range(step + 1, RUN_STEPS + 1):
      shutil.rmtree(os.path.join(outdir, name, 'checkpoints', str(later)))
    start = time.process_time()
    result, stdout = _train(outdir, name, LAYOUTS[layout], train)
    out[name] = {
      'cpu_s': time.process_time() - start,
      'epsilon': result['privacy']['epsilon'],
      'resumed': f'Resuming from step {step}' in stdout,
    }
    arrays.update({f'{name}{k}': v for k, v in _leaves(result['params']).items()})
  first = checkpoints.read_state(f'{outdir}/one', 1)['params']
  arrays.update({f'step1{k}': v for k, v in _leaves(first).items()})
  np.savez(os.path.join(outdir, 'params.npz'), **arrays)
  with open(os.path.join(outdir, 'results.json'), 'w') as f:
    json.dump(out, f)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _device_count_flags(count: int) -> dict:
  """A forked child's XLA_FLAGS (read when its jax starts the backend): `count` CPU devices."""
  flags_ = f'{os.environ.get("XLA_FLAGS", "")} --xla_force_host_platform_device_count={count}'
  return {'XLA_FLAGS': flags_.strip()}


def _run_all(outdir):
  """The 8-device worker and the 2-process job, forked together; waits for both."""
  outdir = pathlib.Path(outdir)
  port = _free_port()
  flags_ = [f'--config.{key}={value}' for key, value in {**RUN, 'mesh.fsdp': 4}.items()]
  hosts = [
    {
      'module': 'dpjax.train',
      'argv': [
        f'--config={REPO}/configs/digits_transformer.py:runlocal',
        f'--workdir={outdir / "multihost"}',
        *flags_,
        '--distributed',
        f'--coordinator_address=localhost:{port}',
        '--num_processes=2',
        f'--process_id={i}',
      ],
      'cwd': REPO,
      'env': _device_count_flags(4),
    }
    for i in range(2)
  ]
  worker = {
    'module': 'tests.trainer.test_sharded_training',
    'argv': [str(outdir)],
    'cwd': REPO,
    'env': _device_count_flags(NUM_DEVICES),
  }
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
  assert proc['returncode'] == 0, proc['stderr'][-5000:]
  for host in host_out:
    assert host['returncode'] == 0 and not host['timed_out'], host['stderr'][-5000:]
  (outdir / 'host_stdout.json').write_text(json.dumps([host['stdout'] for host in host_out]))


@pytest.fixture(scope='module')
def runs(shared_setup):
  outdir = pathlib.Path(shared_setup('sharded_training', _run_all))
  results = json.loads((outdir / 'results.json').read_text())
  results['host_stdout'] = json.loads((outdir / 'host_stdout.json').read_text())
  return results, dict(np.load(outdir / 'params.npz')), outdir


def _assert_equal_params(params, name, reference='one', rtol=RTOL):
  keys = [k[len(reference) :] for k in params if k.startswith(reference + '[')]
  assert keys
  for key in keys:
    want, got = params[reference + key], params[name + key]
    assert np.max(np.abs(got - want)) <= rtol * np.max(np.abs(want)), (name, key)


def test_fsdp_data_parallel_and_one_device_train_the_same_parameters_and_epsilon(runs):
  """fsdp = 4 (data = 2), data = 8 and one device: final parameters within 1e-5 of each
  array's scale, the identical ε. Catches noise drawn per shard from the wrong key, a shard
  lost or summed twice, or a layout entering the accountant."""
  results, params, _ = runs
  assert results['device_count'] == NUM_DEVICES
  for name in ('f4', 'd8'):
    _assert_equal_params(params, name)
  moved = [k for k in params if k.startswith('one[')]
  assert any(np.max(np.abs(params[k] - params['step1' + k[3:]])) > 1e-3 for k in moved)
  assert results['f4']['epsilon'] == results['d8']['epsilon'] == results['one']['epsilon']


def test_fsdp_splits_the_large_arrays_and_the_checkpoints_record_the_layout(runs):
  """With fsdp = 4 every array of >= 1024 elements with a dimension divisible by 4 is held in
  quarters (its shard on a device), others whole; data = 8 keeps all whole. Catches a trainer
  that still replicates its state, or metadata without the layout."""
  results, _, _ = runs
  f4 = results['f4']
  for spec, shard, shape in zip(f4['specs'], f4['shard_shapes'], f4['shapes'], strict=True):
    split = np.prod(shape) >= 1024 and any(n % 4 == 0 for n in shape)
    assert ('fsdp' in spec) == split, (spec, shape)
    assert np.prod(shard) * (4 if split else 1) == np.prod(shape)
  assert any('fsdp' in spec for spec in f4['specs'])
  assert all(spec == 'P()' for spec in results['d8']['specs'])
  assert f4['layouts'] == [{'data': 2, 'fsdp': 4, 'tensor': 1}] * RUN_STEPS
  assert results['one']['layouts'] == [{'data': 1, 'fsdp': 1, 'tensor': 1}] * RUN_STEPS


def test_resume_across_layouts_both_ways_and_bit_identical_on_the_same(runs):
  """fsdp = 4 → data = 8 → one device, and one device → fsdp = 4: the uninterrupted run's
  parameters within 1e-5 and its ε; fsdp = 4 → fsdp = 4 bit for bit. Catches a checkpoint
  restored onto the shardings it was saved with (fails on another mesh) or shards of the Adam
  state put back in the wrong order."""
  results, params, _ = runs
  for name, _, _, _ in RESUMES:
    assert results[name]['resumed'], name
    assert results[name]['epsilon'] == results['one']['epsilon'], name
    _assert_equal_params(params, name)
  for key in [k for k in params if k.startswith('f4[')]:
    np.testing.assert_array_equal(params['f4_to_f4' + key[2:]], params[key])


def test_two_processes_of_four_devices_train_like_one(runs):
  """2 processes × 4 devices, fsdp = 4: every process saves its shards (orbax); the final
  checkpoint equals the single-process fsdp = 4 run's parameters."""
  from dpjax.trainer.workdir import checkpoints  # pylint: disable=g-import-not-at-top

  _, params, outdir = runs
  state = checkpoints.read_state(str(outdir / 'multihost'), RUN_STEPS)
  for key, value in _leaves(state['params']).items():
    want = params['f4' + key]
    assert np.max(np.abs(value - want)) <= RTOL * np.max(np.abs(want)), key
  rows = checkpoints.read_metadata(str(outdir / 'multihost'))
  assert rows[-1]['layout'] == {'data': 2, 'fsdp': 4, 'tensor': 1}


def _state_bytes_fsdp4(params) -> int:
  """Independently: float32 parameters at fsdp = 4, a quarter of each array of >= 1024
  elements with a dimension divisible by 4."""
  total = 0
  for key, value in params.items():
    if key.startswith('one['):
      n = value.size
      total += 4 * (n // 4 if n >= 1024 and any(d % 4 == 0 for d in value.shape) else n)
  return total


def test_the_start_line_states_the_mesh_and_the_bytes_per_device(runs):
  """'mesh data=2 fsdp=4 tensor=1: FSDP over 4 ...' and the bytes per device of the parameters
  and the EMA equal to the independent count, Adam's μ and ν twice that (beside its counters).
  Catches bytes of the replicated layout reported for a split one."""
  from dpjax.trainer.loop import state_layout  # pylint: disable=g-import-not-at-top

  results, params, _ = runs
  stdout = results['f4']['stdout']
  assert 'mesh data=2 fsdp=4 tensor=1: FSDP over 4 (arrays >= 1024).' in stdout
  line = next(l for l in stdout.splitlines() if l.startswith('Per device:'))
  expected = _state_bytes_fsdp4(params)
  size = state_layout.size
  assert line.startswith(f'Per device: parameters {size(expected)}, optimizer state ')
  assert f', EMA {size(expected + 4)}, temporary buffers of the step ' in line
  optimizer = float(re.search(r'optimizer state ([0-9.]+) KiB', line).group(1)) * 2**10
  assert 2 * expected - 52 <= optimizer <= 2 * expected + 2**10  # ± the rounding, + counters.


def test_bad_mesh_fields_and_a_state_too_large_are_refused_before_anything_is_written(runs):
  """One line naming the field or with the numbers, nothing written: fsdp not dividing 8,
  fsdp = 0, P not a multiple of data × fsdp, and a state over 90 % of a 32 kB device."""
  from dpjax.trainer.loop import state_layout  # pylint: disable=g-import-not-at-top

  results, params, _ = runs
  assert (
    'mesh.fsdp × mesh.tensor = 3 × 1 must divide the number of devices (8)' in (results['bad_fsdp'])
  )
  assert results['zero_fsdp'].startswith('mesh.fsdp = 0: must be an integer >= 1')
  assert (
    'sampler.physical_batch_size = 12' in results['bad_p']
    and '8 = data × fsdp' in (results['bad_p'])
  )
  expected = state_layout.size(_state_bytes_fsdp4(params))
  assert results['too_big'].startswith('the training state needs ')
  assert f'per device (parameters {expected}, optimizer state ' in results['too_big']
  assert "more than 90% of the device's 31.2 KiB: raise mesh.fsdp" in results['too_big']
  names = ('bad_fsdp', 'zero_fsdp', 'bad_p', 'too_big')
  assert not any(results[name + '_wrote'] for name in names)


if __name__ == '__main__':
  _worker(sys.argv[1])
