"""Checkpoint integrity (manifests), failed saves (disk full), and the listing CLI."""

import errno
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from dpjax.trainer.workdir import manifest as checkpoint_manifest
from dpjax import checkpoints as checkpoints_cli
from dpjax.trainer.workdir import checkpoints

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NON_PRIVATE = {
  'epsilon': None,
  'bound': 'none (non-private run)',
  'accountant': None,
  'delta': None,
}


def state_at(step):
  """A small state whose values identify the step (float64: bit-exact comparisons)."""
  return {
    'params': {
      'w': np.arange(4096, dtype=np.float64).reshape(64, 64) * step,
      'b': np.full(8, step, np.float64),
    },
    'step': np.array(step, np.int32),
  }


def metadata_at(step, privacy=None):
  return {
    'step': step,
    'privacy': privacy
    or {'epsilon': 0.5 * step, 'delta': 1e-5, 'bound': 'upper', 'accountant': 'pld'},
    'sampler': {'name': 'poisson'},
  }


def write_run(workdir, steps, keep=3, privacy=None):
  manager = checkpoints.make_manager(str(workdir), keep)
  for step in steps:
    checkpoints.save(manager, step, state_at(step), metadata_at(step, privacy))
  checkpoints.wait_until_finished(manager)
  return manager


def assert_state(restored, step):
  np.testing.assert_array_equal(restored['params']['w'], state_at(step)['params']['w'])
  np.testing.assert_array_equal(restored['params']['b'], state_at(step)['params']['b'])


def hashed_files(step_dir):
  with open(os.path.join(step_dir, checkpoint_manifest.MANIFEST)) as f:
    return sorted(json.load(f)['files'])


def flip_byte(path, offset=None):
  with open(path, 'r+b') as f:
    data = f.read()
    offset = len(data) // 2 if offset is None else offset
    f.seek(offset)
    f.write(bytes([data[offset] ^ 0x01]))


def test_manifest_covers_every_file_of_state_and_metadata(tmp_path):
  write_run(tmp_path, [1, 2])
  step_dir = os.path.join(checkpoints.checkpoint_dir(str(tmp_path)), '2')
  files = hashed_files(step_dir)
  on_disk = sorted(
    os.path.relpath(os.path.join(root, name), step_dir)
    for root, _, names in os.walk(step_dir)
    for name in names
  )
  assert sorted(set(on_disk) - set(files)) == sorted(checkpoint_manifest.UNHASHED)
  assert 'metadata/metadata' in files and any(f.startswith('state/') for f in files)
  assert checkpoint_manifest.verify_checkpoint(step_dir) is True
  assert checkpoints.temporary_checkpoints(str(tmp_path)) == []


def test_a_flipped_byte_in_any_file_is_detected(tmp_path):
  write_run(tmp_path, [1])
  step_dir = os.path.join(checkpoints.checkpoint_dir(str(tmp_path)), '1')
  for relative in hashed_files(step_dir):
    copy = tmp_path / 'copy'
    shutil.copytree(step_dir, copy)
    flip_byte(copy / relative)
    with pytest.raises(checkpoint_manifest.CheckpointCorruptError, match=relative):
      checkpoint_manifest.verify_checkpoint(str(copy))
    shutil.rmtree(copy)
  os.remove(os.path.join(step_dir, 'metadata', 'metadata'))
  with pytest.raises(
    checkpoint_manifest.CheckpointCorruptError, match='metadata/metadata is missing'
  ):
    checkpoint_manifest.verify_checkpoint(step_dir)


def test_flipped_array_byte_falls_back_to_the_previous_checkpoint(tmp_path, capsys):
  manager = write_run(tmp_path, [1, 2])
  step_dir = os.path.join(checkpoints.checkpoint_dir(str(tmp_path)), '2')
  # The largest file holds the bytes of `w`; orbax itself does not notice a flip there.
  data = max(hashed_files(step_dir), key=lambda f: os.path.getsize(os.path.join(step_dir, f)))
  flip_byte(os.path.join(step_dir, data))
  silently = manager.restore(
    2, args=ocp.args.Composite(state=ocp.args.StandardRestore(state_at(0)))
  )['state']
  assert not np.array_equal(silently['params']['w'], state_at(2)['params']['w'])
  capsys.readouterr()
  step, state, metadata = checkpoints.restore_latest(manager, state_at(0))
  assert step == 1 and metadata['step'] == 1
  assert_state(state, 1)
  err = capsys.readouterr().err
  assert f'checkpoint 2 is unreadable (CheckpointCorruptError: {data} differs' in err
  names = os.listdir(checkpoints.checkpoint_dir(str(tmp_path)))
  assert '2' not in names and any(name.startswith('2.unreadable-') for name in names)


def test_no_readable_checkpoint_is_refused_not_restarted_from_step_0(tmp_path, capsys):
  """The only checkpoints are corrupt: one line naming what to do, nothing moved. Fails on
  da06065: each was moved aside with "falling back to the previous one" when there was none,
  and the resume returned no checkpoint, so the trainer silently trained from step 0."""
  from tests.run_configs import tree_digest  # pylint: disable=import-outside-toplevel

  manager = write_run(tmp_path, [1, 2])
  for step in ('1', '2'):
    step_dir = os.path.join(checkpoints.checkpoint_dir(str(tmp_path)), step)
    flip_byte(
      os.path.join(
        step_dir,
        max(hashed_files(step_dir), key=lambda f: os.path.getsize(os.path.join(step_dir, f))),
      )
    )
  before = tree_digest(tmp_path)
  with pytest.raises(
    ValueError,
    match=r'checkpoint 2 in .* is unreadable \(CheckpointCorruptError: .*\) and no '
    r'earlier checkpoint is readable \(steps \[1, 2\]\), so the run cannot '
    r'resume. To train it again from step 0, move the checkpoints',
  ) as info:
    checkpoints.restore_latest(manager, state_at(0))
  assert '\n' not in str(info.value)
  assert tree_digest(tmp_path) == before
  assert 'falling back' not in capsys.readouterr().err


def test_checkpoint_without_manifest_is_restored_unverified(tmp_path, capsys):
  manager = write_run(tmp_path, [1])
  os.remove(
    os.path.join(checkpoints.checkpoint_dir(str(tmp_path)), '1', checkpoint_manifest.MANIFEST)
  )
  capsys.readouterr()
  step, state, _ = checkpoints.restore_latest(manager, state_at(0))
  assert step == 1
  assert_state(state, 1)
  assert 'checkpoint 1 has no dpjax_manifest.json' in capsys.readouterr().err


def test_read_state_refuses_a_corrupt_checkpoint(tmp_path):
  write_run(tmp_path, [3])
  assert_state(checkpoints.read_state(str(tmp_path), 3), 3)
  flip_byte(os.path.join(checkpoints.checkpoint_dir(str(tmp_path)), '3', 'metadata', 'metadata'))
  with pytest.raises(checkpoint_manifest.CheckpointCorruptError, match='metadata/metadata differs'):
    checkpoints.read_state(str(tmp_path), 3)


def full_disk_json_write(monkeypatch):
  """orbax's JSON item write fails half way with ENOSPC, as on a full disk."""

  async def save_fn(self, item, directory):
    path = directory / self._filename  # pylint: disable=protected-access
    path.write_text(json.dumps(item)[:5])
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

  monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, '_save_fn', save_fn)


@pytest.mark.parametrize('keep', [1, 2])
def test_disk_full_during_save_is_one_line_and_keeps_the_previous_checkpoint(
  tmp_path, monkeypatch, keep
):
  manager = write_run(tmp_path, [1], keep=keep)
  full_disk_json_write(monkeypatch)
  with pytest.raises(checkpoints.CheckpointSaveError) as failed:
    checkpoints.save(manager, 2, state_at(2), metadata_at(2))
    checkpoints.wait_until_finished(manager)  # The failure surfaces here (async save) ...
  message = str(failed.value)
  assert '\n' not in message
  assert message.startswith('checkpoint at step 2 could not be written (no space left on device')
  assert 'the checkpoint at step 1 is intact' in message
  assert checkpoints.temporary_checkpoints(str(tmp_path)) == []
  assert sorted(os.listdir(checkpoints.checkpoint_dir(str(tmp_path)))) == ['1']
  monkeypatch.undo()
  # ... and the run goes on: the previous checkpoint restores, the next save works.
  step, state, _ = checkpoints.restore_latest(manager, state_at(0))
  assert step == 1
  assert_state(state, 1)
  checkpoints.save(manager, 3, state_at(3), metadata_at(3))
  checkpoints.wait_until_finished(manager)
  assert checkpoint_manifest.verify_checkpoint(
    os.path.join(checkpoints.checkpoint_dir(str(tmp_path)), '3')
  )


def test_failed_save_surfaces_at_the_next_save_too(tmp_path, monkeypatch):
  manager = write_run(tmp_path, [1])
  full_disk_json_write(monkeypatch)
  checkpoints.save(manager, 2, state_at(2), metadata_at(2))
  monkeypatch.undo()
  with pytest.raises(checkpoints.CheckpointSaveError, match='step 2 could not be written'):
    checkpoints.save(manager, 3, state_at(3), metadata_at(3))
  assert checkpoints.temporary_checkpoints(str(tmp_path)) == []


def test_crash_before_the_manifest_leaves_no_checkpoint(tmp_path, monkeypatch):
  """The manifest is written before orbax renames the step into place: no manifest, no step."""
  manager = write_run(tmp_path, [1])

  def crash(path, text):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

  monkeypatch.setattr(checkpoint_manifest, 'write_text_atomically', crash)
  with pytest.raises(checkpoints.CheckpointSaveError, match='no space left on device'):
    checkpoints.save(manager, 2, state_at(2), metadata_at(2))
    checkpoints.wait_until_finished(manager)
  assert sorted(os.listdir(checkpoints.checkpoint_dir(str(tmp_path)))) == ['1']


def test_leftover_temporary_checkpoints_are_removed(tmp_path):
  write_run(tmp_path, [1])
  directory = checkpoints.checkpoint_dir(str(tmp_path))
  left = os.path.join(directory, '2' + checkpoints.TMP_MARKER)
  os.makedirs(os.path.join(left, 'state'))
  assert checkpoints.remove_temporary_checkpoints(str(tmp_path)) == [left]
  assert sorted(os.listdir(directory)) == ['1']
  os.makedirs(left)  # A new manager (a new run) removes them at start.
  checkpoints.make_manager(str(tmp_path), 2)
  assert sorted(os.listdir(directory)) == ['1']


def test_cli_lists_a_non_private_run_and_refuses_bad_workdirs(tmp_path, capsys):
  """In-process (`main(argv)`); test_cli_is_quiet_when_the_reader_leaves runs the real process."""
  write_run(tmp_path / 'w', [2, 4], privacy=NON_PRIVATE)
  assert checkpoints_cli.main([str(tmp_path / 'w'), '--verify']) == 0
  listing = capsys.readouterr()
  rows = listing.out.splitlines()[1:]
  assert [row.split()[0] for row in rows] == ['2', '4'] and listing.err == ''
  assert all('non-private, ε = ∞' in row and row.rstrip().endswith('ok') for row in rows)
  assert checkpoints_cli.main([str(tmp_path / 'nope')]) == 2
  missing = capsys.readouterr()
  assert missing.out == ''
  assert missing.err.strip().splitlines() == [
    f'python -m dpjax.checkpoints: error: workdir {tmp_path / "nope"} does not exist.'
  ]


@pytest.mark.slow
def test_cli_is_quiet_when_the_reader_leaves(tmp_path):
  """`... | head -1`: the pipe closes before the listing is written; no traceback."""
  write_run(tmp_path, [1, 2, 3])
  proc = subprocess.Popen(
    [sys.executable, '-m', 'dpjax.checkpoints', str(tmp_path)],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  proc.stdout.close()  # Closed long before the child has imported jax and writes.
  err = proc.stderr.read()
  assert proc.wait() == 128 + 13
  assert err == ''


def test_cli_in_process_workdir_is_a_file_and_corrupt_integrity(tmp_path, capsys):
  (tmp_path / 'file').write_text('x')
  assert checkpoints_cli.main([str(tmp_path / 'file')]) == 2
  assert capsys.readouterr().err.strip() == (
    f'python -m dpjax.checkpoints: error: workdir {tmp_path / "file"} is not a directory.'
  )
  write_run(tmp_path / 'w', [1])  # ε = 0.5 in the metadata; a flipped bit makes it 0.4.
  path = os.path.join(checkpoints.checkpoint_dir(str(tmp_path / 'w')), '1', 'metadata', 'metadata')
  text = open(path).read()
  assert text.count('0.5') == 1
  with open(path, 'w') as f:
    f.write(text.replace('0.5', '0.4'))
  assert checkpoints_cli.main([str(tmp_path / 'w'), '--verify']) == 0
  row = capsys.readouterr().out.splitlines()[1]
  assert '0.4000' in row and 'CORRUPT: metadata/metadata differs' in row


def test_a_temporary_checkpoint_recreated_after_its_removal_is_removed_again(tmp_path):
  """After a failed save, a write still queued in tensorstore's threads may recreate the
  temporary directory after it was removed; it is removed again (the full-disk test found
  `2.orbax-checkpoint-tmp` left behind under load, on 1700e6f)."""
  import threading  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  tmp = os.path.join(checkpoints.checkpoint_dir(str(tmp_path)), '2' + checkpoints.TMP_MARKER)
  os.makedirs(tmp)

  def late_write():  # Waits for the removal, then writes a file as a queued write would.
    while os.path.exists(tmp):
      time.sleep(0.01)
    os.makedirs(tmp, exist_ok=True)
    open(os.path.join(tmp, 'late'), 'w').close()

  writer = threading.Thread(target=late_write)
  writer.start()
  checkpoints.remove_temporary_checkpoints_until_gone(str(tmp_path), time.time() + 10)
  writer.join()
  assert checkpoints.temporary_checkpoints(str(tmp_path)) == []
