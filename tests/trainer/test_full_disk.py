"""A full disk on every write path: one line, nothing partial left (issue 34).

A real full file system: a 1 MiB tmpfs mounted for each test (the suite runs as root; the
tests skip where mounting is not allowed), filled to its last byte by a filler file. On
da06065 a full disk ended a run in orbax, TensorBoard and lock tracebacks (one run printed 177
lines), TensorBoard's writer thread died and left half-written event records, and config.json
was written in place.
"""

import json
import os
import subprocess

import pytest

from dpjax.trainer.workdir import checkpoints
from dpjax.trainer.loop import metrics
from dpjax.trainer.workdir import run_seed
from dpjax.trainer.workdir import workdir_lock
from tests.trainer.test_checkpoints import assert_state
from tests.trainer.test_checkpoints import metadata_at
from tests.trainer.test_checkpoints import state_at
from tests.trainer.test_checkpoints import write_run

pytestmark = pytest.mark.slow  # Whole trainings or child processes (`make test-unit` skips).


@pytest.fixture
def disk(tmp_path):
  """A mounted 1 MiB tmpfs (unmounted afterwards)."""
  mount = tmp_path / 'disk'
  mount.mkdir()
  proc = subprocess.run(
    ['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', str(mount)],
    capture_output=True,
    text=True,
    check=False,
  )
  if proc.returncode:
    pytest.skip(f'cannot mount a tmpfs here: {proc.stderr.strip()}')
  try:
    yield mount
  finally:
    subprocess.run(['umount', '-l', str(mount)], capture_output=True, check=False)


def fill(disk, leave: int = 0):
  """Fills the file system with disk/filler until `leave` bytes are free (0: a 1-byte write
  fails)."""
  free = lambda: os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
  with open(disk / 'filler', 'ab', buffering=0) as f:
    for size in (1 << 16, 4096, 64, 1):
      try:
        while free() >= leave + size and f.write(b'\0' * size):
          pass
      except OSError:
        pass


def one_line_write_error(error, *starts):
  """The error is a WriteError (a CheckpointSaveError is one) of one line, starting so."""
  message = str(error)
  assert 'WriteError' in [c.__name__ for c in type(error).__mro__], repr(error)
  assert '\n' not in message and message.startswith(starts), message
  assert 'no space left on device' in message, message


def test_small_files_lock_and_seed_keep_their_old_content(disk):
  """config.json, the seed and the lock: WriteError (one line) on a full disk, the old content
  kept, no temporary file left. Fails on da06065: a bare OSError (a traceback from the
  command line) on each."""
  from dpjax.trainer.workdir.atomic_write import write_text_atomically  # pylint: disable=import-outside-toplevel

  work = disk / 'w'
  work.mkdir()
  (work / 'config.json').write_text('{"old": 1}')
  fill(disk)
  with pytest.raises(Exception) as info:
    write_text_atomically(str(work / 'config.json'), 'x' * 10_000)
  one_line_write_error(info.value, 'cannot write config.json')
  assert (work / 'config.json').read_text() == '{"old": 1}'
  with pytest.raises(Exception) as info:
    run_seed.store_seed(str(work), run_seed.RunSeed(12345, 'drawn'))
  one_line_write_error(info.value, 'cannot write the run seed')
  assert run_seed.stored_seed(str(work)) is None
  with pytest.raises(Exception) as info:
    workdir_lock.WorkdirLock(str(work)).acquire()
  one_line_write_error(info.value, 'cannot write the lock file')
  assert (work / 'lock.json').read_text() == ''  # Empty: a free lock, nothing partial.
  assert sorted(p.name for p in work.rglob('*')) == ['config.json', 'lock.json', 'private']


def test_metrics_are_cut_back_to_the_last_flush(disk):
  """Rows and TensorBoard events written after the disk filled: WriteError, and both files
  back to their size at the last flush (what the latest checkpoint covers), every record
  whole; later writes are no-ops. Fails on da06065 by hanging: TensorBoard's writer thread
  died with a traceback and the next writes blocked on its full queue."""
  writer = metrics.MetricWriter(str(disk), None)
  for step in range(3):
    writer.write(step, {'nonprivate_train_loss': 1.0, 'epsilon': 0.1 * step})
  writer.flush()
  files = [disk / metrics.METRICS_FILE, *(disk / metrics.TENSORBOARD_DIR).iterdir()]
  sizes = [os.path.getsize(f) for f in files]
  fill(disk)
  with pytest.raises(Exception) as info:
    for step in range(3, 100_000):
      writer.write(step, {'nonprivate_train_loss': 1.0, 'epsilon': 0.1 * step})
      if step % 50 == 0:
        writer.flush()
  one_line_write_error(info.value, 'cannot write the metrics')
  assert [os.path.getsize(f) for f in files] == sizes
  assert [row['step'] for row in metrics.read_rows(str(files[0]))] == [0, 1, 2]
  from tests.trainer.test_metrics import tb_scalars  # pylint: disable=import-outside-toplevel

  assert [s for s, tag, _ in tb_scalars(disk)[0] if tag == 'epsilon'] == [0, 1, 2]
  writer.write(7, {'epsilon': 1.0})
  writer.close()  # No-ops after the failure.


def test_a_checkpoint_on_a_full_disk_keeps_the_previous_one(disk):
  """A real full disk (the monkeypatched one: tests/trainer/test_checkpoints.py): one line,
  no temporary directory, checkpoint 1 restores. Fails on da06065: tensorstore's ValueError
  escaped (orbax's writer thread re-raised it while the failed save was cleaned up)."""
  manager = write_run(disk, [1])
  fill(disk)
  with pytest.raises(Exception) as info:
    checkpoints.save(manager, 2, state_at(2), metadata_at(2))
    checkpoints.wait_until_finished(manager)
  one_line_write_error(info.value, 'checkpoint at step 2 could not be written')
  assert sorted(os.listdir(checkpoints.checkpoint_dir(str(disk)))) == ['1']
  os.remove(disk / 'filler')  # Space freed: the rerun (a new manager) restores checkpoint 1.
  step, state, _ = checkpoints.restore_latest(checkpoints.make_manager(str(disk), 3), state_at(0))
  assert step == 1
  assert_state(state, 1)


def test_a_run_whose_disk_fills_up_ends_in_one_line_and_its_export_too(disk, tmp_path, monkeypatch):
  """`python -m dpjax.train` with 200 KiB free (one checkpoint of this run is ~130 KiB): exit 1
  and one line on stderr (besides the accountant's warnings), checkpoint 2 intact, no
  temporary files, every metrics row whole; exporting onto the full disk then fails in one
  line and leaves nothing. Fails on da06065: the export's OSError; the run itself printed
  tensorstore's 'Event loop is closed' tracebacks, dozens of lines, in some runs (a race)."""
  import sys  # pylint: disable=import-outside-toplevel
  from dpjax import export  # pylint: disable=import-outside-toplevel

  fill(disk, leave=200 << 10)
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  work = disk / 'w'
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'dpjax.train',
      '--config=digits_mlp',
      f'--workdir={work}',
      '--config.seed=0',
      '--config.num_epochs=0',
      '--config.num_steps=4',
      '--config.sampler.batch_size=128',
      '--config.sampler.physical_batch_size=32',
      '--config.privacy.target_epsilon=0',
      '--config.privacy.noise_multiplier=1',
      '--config.checkpoint_every_steps=2',
      '--config.eval_every_steps=100',
    ],
    cwd=repo,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
    env=dict(os.environ, JAX_PLATFORMS='cpu'),
  )
  lines = [line for line in proc.stderr.splitlines() if not line.startswith('WARNING')]
  assert proc.returncode == 1 and len(lines) == 1, proc.stderr
  assert lines[0].startswith('dpjax.train: error: ') and 'no space left on device' in lines[0]
  assert [row['step'] for row in checkpoints.read_metadata(str(work))] == [2]
  assert checkpoints.temporary_checkpoints(str(work)) == []
  assert not [p for p in work.rglob('*') if '.tmp' in p.name]
  rows = [json.loads(line) for line in open(work / metrics.METRICS_FILE)]  # Each one whole.
  assert rows[0]['step'] == 0
  monkeypatch.setenv('DPJAX_STATE_DIR', str(tmp_path / 'state'))
  fill(disk)
  before = sorted(os.listdir(disk))
  with pytest.raises(Exception) as info:
    export.export(str(work), str(disk / 'out'))
  one_line_write_error(info.value, 'cannot write the export')
  assert sorted(os.listdir(disk)) == before


def test_the_planners_json_on_a_full_disk_is_one_line(disk, capsys):
  """`python -m dpjax.planner --json` on a full disk: exit 1 with one line naming --json, the
  table printed and no file left. Failed after the merges: d-userrors made the write atomic
  (a WriteError), which the planner did not catch (a traceback)."""
  from dpjax import planner  # pylint: disable=import-outside-toplevel

  fill(disk)
  with pytest.raises(SystemExit) as info:
    planner.main(
      [
        '--num_examples',
        '1000',
        '--epsilon',
        '2',
        '--delta',
        '1e-5',
        '--epochs',
        '1',
        '--batch_sizes',
        '1000',
        '--json',
        str(disk / 'plan.json'),
      ]
    )
  assert info.value.code == 1
  out, err = capsys.readouterr()
  assert 'σ·C/b' in out
  lines = err.strip().splitlines()
  assert lines[-1].startswith('python -m dpjax.planner: error: cannot write --json'), err
  assert 'no space left on device' in lines[-1]
  assert sorted(p.name for p in disk.iterdir()) == ['filler']
