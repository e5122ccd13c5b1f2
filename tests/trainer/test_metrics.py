"""metrics.jsonl and TensorBoard across kills and resumes: each step once, torn lines, flushes."""

import glob
import json
import os
import struct

import pytest
from tensorboardX.proto import event_pb2

from dpjax.trainer.loop import metrics


def rows(workdir):
  with open(workdir / metrics.METRICS_FILE) as f:
    return [json.loads(line) for line in f]


def tb_scalars(workdir):
  """(step, tag, value) of every scalar in the event files, and the purge steps (TFRecord framing:
  length u64, its crc u32, data, data crc u32)."""
  scalars, purges = [], []
  for path in sorted(glob.glob(str(workdir / metrics.TENSORBOARD_DIR / 'events.out.tfevents.*'))):
    data = open(path, 'rb').read()
    offset = 0
    while offset + 12 <= len(data):
      (length,) = struct.unpack('<Q', data[offset : offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
      offset += 12 + length + 4
      if event.HasField('session_log'):
        purges.append(event.step)
      for value in event.summary.value:
        scalars.append((event.step, value.tag, value.simple_value))
  return scalars, purges


def log_run(writer, steps, every=2):
  """A loop that evaluates at step 0 and logs train metrics every `every` steps."""
  for step in steps:
    if step == 0:
      writer.write(0, {'eval_accuracy': 0.1})
    elif step % every == 0:
      writer.write(step, {'nonprivate_train_loss': 1.0 / step, 'epsilon': 0.1 * step})


def test_resume_keeps_rows_up_to_the_checkpoint_and_logs_the_rest_once(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path), None)
  log_run(writer, range(0, 8))  # Killed after logging step 6; the last checkpoint was at 4.
  writer.flush()
  writer = metrics.MetricWriter(str(tmp_path), 4)
  log_run(writer, range(5, 11))
  writer.close()
  assert [row['step'] for row in rows(tmp_path)] == [0, 2, 4, 6, 8, 10]
  assert [row.get('train_window_steps') for row in rows(tmp_path)] == [None, 2, 2, 2, 2, 2]
  scalars, purges = tb_scalars(tmp_path)
  assert purges[-1] == 5  # TensorBoard drops the first run's events from step 5 on.
  assert [step for step, tag, _ in scalars if tag == 'nonprivate/train_loss'] == [2, 4, 6, 6, 8, 10]


def test_kill_before_the_first_checkpoint_logs_step_zero_once(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path), None)
  log_run(writer, range(0, 3))
  writer = metrics.MetricWriter(str(tmp_path), None)  # No checkpoint: the run restarts at 0.
  log_run(writer, range(0, 5))
  writer.close()
  assert [row['step'] for row in rows(tmp_path)] == [0, 2, 4]


def test_torn_last_line_is_dropped_with_a_warning(tmp_path, capsys):
  writer = metrics.MetricWriter(str(tmp_path), None)
  log_run(writer, range(0, 5))
  writer.close()
  with open(tmp_path / metrics.METRICS_FILE, 'a') as f:
    f.write('{"step": 6, "nonprivate_train_lo')  # The kill cut the write of step 6.
  writer = metrics.MetricWriter(str(tmp_path), 6)
  assert 'dropped 1 unreadable line(s) (line 4;' in capsys.readouterr().err
  writer.write(7, {'eval_accuracy': 0.5})
  writer.close()
  assert [row['step'] for row in rows(tmp_path)] == [0, 2, 4, 7]


def test_train_window_after_resume_covers_only_the_steps_since_the_resume(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path), None)
  for step in (0, 10, 20):
    writer.write(step, {'nonprivate_train_loss': 1.0} if step else {'eval_accuracy': 0.1})
  writer.close()
  # Killed at step 27, resumed from the checkpoint at 25: train_loss at 30 averages 26..30.
  writer = metrics.MetricWriter(str(tmp_path), 25)
  assert writer.train_window(30) == {'train_window_steps': 5}
  writer.write(30, {'nonprivate_train_loss': 0.5})
  writer.write(40, {'nonprivate_train_loss': 0.4})
  writer.close()
  assert [(row['step'], row.get('train_window_steps')) for row in rows(tmp_path)] == [
    (0, None),
    (10, 10),
    (20, 10),
    (30, 5),
    (40, 10),
  ]
  # A resume from a checkpoint before the last logged row starts the window there instead.
  writer = metrics.MetricWriter(str(tmp_path), 20)
  assert writer.train_window(30) == {'train_window_steps': 10}


def test_flush_writes_tensorboard_events_and_rows_to_disk(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path), None)
  writer.write(3, {'nonprivate_train_loss': 0.25})
  assert tb_scalars(tmp_path)[0] == []  # Buffered (flush_secs = 120) ...
  writer.flush()  # ... until the checkpoint flush.
  assert tb_scalars(tmp_path)[0] == [
    (3, 'nonprivate/train_loss', 0.25),
    (3, 'train_window_steps', 3.0),
  ]
  assert rows(tmp_path) == [{'step': 3, 'nonprivate_train_loss': 0.25, 'train_window_steps': 3}]
  writer.close()


def test_disabled_writer_writes_nothing_and_bad_resume_step_is_refused(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path), 3, enabled=False)
  writer.write(4, {'nonprivate_train_loss': 1.0})
  writer.flush()
  writer.close()
  assert os.listdir(tmp_path) == []
  with pytest.raises(ValueError, match='resume_step must be None or an integer >= 0'):
    metrics.MetricWriter(str(tmp_path), -1)


def test_every_name_is_covered_by_epsilon_or_labelled_nonprivate(tmp_path):
  """Issue 24 item 6: train_loss, accuracy, non-finite and truncation counts, clip statistics
  and rates sat beside ε unlabelled (one NaN pixel in one record decided membership from
  num_nonfinite_examples); now a name is either covered by ε or says nonprivate_."""
  writer = metrics.MetricWriter(str(tmp_path), None)
  for name in ('train_loss', 'num_nonfinite_examples', 'examples_per_second', 'num_truncated'):
    with pytest.raises(ValueError, match='neither covered by ε'):
      writer.write(1, {name: 1.0})
  writer.write(1, {'epsilon': 1.0, 'eval_accuracy': 0.5, 'nonprivate_num_truncated': 0})
  writer.close()
  assert rows(tmp_path) == [
    {'step': 1, 'epsilon': 1.0, 'eval_accuracy': 0.5, 'nonprivate_num_truncated': 0}
  ]
