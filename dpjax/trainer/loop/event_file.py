"""TensorBoard scalars written in the caller's thread, to one event file.

tensorboardX's `SummaryWriter` writes on a thread of its own: on a full disk that thread died
with a traceback, later events blocked on its full queue, and an atexit hook printed another
traceback. `EventFile` writes the same TFRecord-framed `Event` protos (tensorboardX's
`RecordWriter`, `summary.scalar`) synchronously, so a failed write raises where the run can
report it (`dpjax.trainer.workdir.write_errors`), and `flush` makes the events durable (fsync).
"""

from __future__ import annotations

import os
import socket
import time

from tensorboardX import record_writer
from tensorboardX import summary
from tensorboardX.proto import event_pb2


class EventFile:
  """A new event file in `directory`; `purge_step`: TensorBoard hides this run's earlier
  events from that step on (a resume recomputes them)."""

  def __init__(self, directory: str, purge_step: int | None = None):
    os.makedirs(directory, exist_ok=True)
    # A unique name per writer: the timestamp in it has one-second resolution.
    self.path = os.path.join(
      directory,
      f'events.out.tfevents.{int(time.time())}.'
      f'{socket.gethostname()}.{os.getpid()}.{time.time_ns()}',
    )
    self._records = record_writer.RecordWriter(self.path)
    self._event(file_version='brain.Event:2')
    if purge_step is not None:
      self._event(
        step=purge_step, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)
      )

  def _event(self, **fields) -> None:
    self._records.write(event_pb2.Event(wall_time=time.time(), **fields).SerializeToString())

  def scalar(self, tag: str, value: float, step: int) -> None:
    self._event(step=step, summary=summary.scalar(tag, value))

  def flush(self) -> None:
    """Writes the buffered events and fsyncs the file."""
    self._records.flush()

  def close(self) -> None:
    self._records.close()
