"""The workdir lock, with real processes holding it: refusal, stale takeover, release."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from dpjax.trainer.workdir import workdir_lock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLD = (
  'import sys, time\n'
  'from dpjax.trainer.workdir import workdir_lock\n'
  'with workdir_lock.WorkdirLock(sys.argv[1]):\n'
  '  print("locked", flush=True)\n'
  '  time.sleep(float(sys.argv[2]))\n'
)


def start_holder(workdir, seconds=120):
  """A process that takes the lock, says so, then sleeps holding it."""
  proc = subprocess.Popen(
    [sys.executable, '-c', HOLD, str(workdir), str(seconds)],
    cwd=REPO,
    stdout=subprocess.PIPE,
    text=True,
  )
  assert proc.stdout.readline().strip() == 'locked'
  return proc


@pytest.mark.slow
def test_second_run_is_refused_naming_host_and_pid_then_stale_lock_is_taken_over(tmp_path, capsys):
  holder = start_holder(tmp_path)
  try:
    with pytest.raises(workdir_lock.WorkdirInUseError) as refused:
      workdir_lock.WorkdirLock(str(tmp_path)).acquire()
    message = str(refused.value)
    assert f'PID {holder.pid} on host {socket.gethostname()}' in message
    assert '\n' not in message and isinstance(refused.value, ValueError)
    # Another process is refused too (flock is per open file, across processes).
    other = subprocess.run(
      [sys.executable, '-c', HOLD, str(tmp_path), '0'], cwd=REPO, capture_output=True, text=True
    )
    assert other.returncode != 0 and f'PID {holder.pid}' in other.stderr
    assert 'locked' not in other.stdout
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  # The killed holder left its body behind: taken over with a warning naming it.
  assert json.load(open(tmp_path / workdir_lock.LOCK_FILE))['pid'] == holder.pid
  capsys.readouterr()
  with workdir_lock.WorkdirLock(str(tmp_path)) as lock:
    assert f'stale lock of {tmp_path} left by PID {holder.pid}' in capsys.readouterr().err
    assert json.load(open(lock.path))['pid'] == os.getpid()
  # A clean release leaves an empty file: the next run takes it without a warning.
  assert open(tmp_path / workdir_lock.LOCK_FILE).read() == ''
  with workdir_lock.WorkdirLock(str(tmp_path)):
    assert capsys.readouterr().err == ''


def test_lock_is_exclusive_within_one_process_and_released_on_exit(tmp_path):
  with workdir_lock.WorkdirLock(str(tmp_path)):
    with pytest.raises(workdir_lock.WorkdirInUseError, match=f'PID {os.getpid()}'):
      workdir_lock.WorkdirLock(str(tmp_path)).acquire()
  with workdir_lock.WorkdirLock(str(tmp_path)):  # Released by the context manager.
    pass
  with pytest.raises(RuntimeError):
    with workdir_lock.WorkdirLock(str(tmp_path)):
      raise RuntimeError('the loop failed')
  workdir_lock.WorkdirLock(str(tmp_path)).acquire()  # Released on an exception too.


def test_only_the_primary_process_locks(tmp_path):
  with workdir_lock.WorkdirLock(str(tmp_path)):
    with workdir_lock.WorkdirLock(str(tmp_path), primary=False):  # Process > 0: no-op.
      pass
  assert not os.path.exists(tmp_path / 'other' / workdir_lock.LOCK_FILE)
  with workdir_lock.WorkdirLock(str(tmp_path / 'other'), primary=False):
    assert not os.path.exists(tmp_path / 'other')


def test_lock_left_by_another_host_is_not_taken_over(tmp_path):
  path = tmp_path / workdir_lock.LOCK_FILE
  path.write_text(json.dumps({'host': 'node-17.cluster', 'pid': 4242, 'start_time': 0}))
  with pytest.raises(
    workdir_lock.WorkdirInUseError,
    match=r'PID 4242 on host node-17.cluster since 1970-01-01.*delete',
  ):
    workdir_lock.WorkdirLock(str(tmp_path)).acquire()
  assert json.loads(path.read_text())['pid'] == 4242  # Untouched.


def test_unusable_workdir_is_one_line_value_error(tmp_path):
  (tmp_path / 'file').write_text('x')
  with pytest.raises(ValueError, match=r'--workdir .*file is not a directory'):
    workdir_lock.WorkdirLock(str(tmp_path / 'file')).acquire()
  with pytest.raises(ValueError, match=r'--workdir .*file/sub is not a directory'):
    workdir_lock.WorkdirLock(str(tmp_path / 'file' / 'sub')).acquire()
