"""The logical batch as the compiled step reads it: device-resident data or a prefetched buffer.

`DPStep.train_step` takes a whole logical batch as one buffer with a leading
axis K_max = B/P (fixed for the run, so one executable serves every step)
and K, the number of non-empty physical batches, as data. Two ways to fill it:

* The training set fits in device memory (`fits_on_device`, a byte limit):
  `put_on_device` copies the raw arrays once (uint8 stays uint8; 150 MB for
  CIFAR-10) and the host sends only `index_buffer`'s int32 row indices and
  weights, 8 bytes a row. The step gathers each physical batch and normalises
  it, x = (raw / scale − mean) / std and int or one-hot labels, as
  `dpjax.data.preprocess.Preprocessor` does on the host: bit for bit on the CPU; on a GPU,
  whose float32 division XLA does not round correctly, within a few ulp.
* Otherwise `host_buffer` gathers the rows on the host and a `Prefetcher`
  thread builds step t + 1's buffer while the device runs step t (double
  buffering).

The sampler stays on the host (O(b) per step, a pure function of (seed,
step)); only where the rows are gathered moves. Padding rows have weight 0
(index 0, as `batching.Batcher` pads), so they contribute exactly zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
import dataclasses
import queue
import threading
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dpjax.privacy import batching
from dpjax.data import arrays
from dpjax.data import preprocess
from dpjax.data import sources as data
from dpjax.data import synthetic
from dpjax.data import tfds_source

CPU_MAX_BYTES = 1 << 30  # On the CPU the "device" is host RAM: 1 GiB is sane.
ACCELERATOR_MEMORY_FRACTION = 0.25  # Of the device's memory, on GPUs / TPUs.


@flax.struct.dataclass
class DeviceDataset:
  """A raw training split on the device and its preprocessing constants."""

  images: jax.Array  # [N, ...] raw values, their original dtype.
  labels: jax.Array  # [N] int32 labels, [N, d] float32 targets or [N, T] int32 tokens.
  # float32 arrays; see `_divide` for why the divisions are fenced.
  scale: jax.Array  # [].
  mean: jax.Array  # [1] or [channels].
  std: jax.Array  # [1] or [channels].
  label_format: str = flax.struct.field(pytree_node=False)
  num_classes: int = flax.struct.field(pytree_node=False)
  targets: str = flax.struct.field(
    pytree_node=False, default='labels'
  )  # preprocess.Preprocessor's.

  def __len__(self) -> int:
    return self.labels.shape[0]

  @property
  def nbytes(self) -> int:
    return self.images.nbytes + self.labels.nbytes

  def gather(self, indices: jax.Array) -> dict[str, jax.Array]:
    """`DataSource.gather` on the device: {'x': float32 [P, ...], 'y': ...} (tokens: int32)."""
    if self.targets == 'tokens':
      return {
        'x': jnp.take(self.images, indices, axis=0).astype(jnp.int32),
        'y': jnp.take(self.labels, indices, axis=0),
      }
    x = _divide(jnp.take(self.images, indices, axis=0).astype(jnp.float32), self.scale)
    x = _divide(x - self.mean, self.std)
    y = jnp.take(self.labels, indices, axis=0)
    if self.label_format == 'one_hot':
      y = jax.nn.one_hot(y, self.num_classes, dtype=jnp.float32)
    return {'x': x, 'y': y}


def _divide(x: jax.Array, divisor: jax.Array) -> jax.Array:
  """x / divisor, correctly rounded like numpy's float32 division on the CPU.

  XLA rewrites x / broadcast(d) as x * broadcast(1 / d), 1-2 ulp off; dividing
  by a full-shape operand behind an optimization barrier keeps the division. On a GPU the
  division itself is XLA's, a few ulp from numpy's (tests/data/test_device_data.py).
  """
  full = jax.lax.optimization_barrier(jnp.broadcast_to(divisor, x.shape))
  return x / full


def _raw_arrays(source: data.DataSource) -> tuple[np.ndarray, np.ndarray, preprocess.Preprocessor]:
  """(raw images, int labels, preprocessor) of a split, read once."""
  if isinstance(source, arrays.ArraySource):
    return np.asarray(source.images), np.asarray(source.labels), source.preprocess
  if isinstance(source, tfds_source.TfdsSource):
    records = [source.source[i] for i in range(len(source))]
    images = np.stack([r[source.image_key] for r in records])
    labels = np.asarray([r[source.label_key] for r in records])
    return images, labels, source.preprocess
  if isinstance(source, synthetic.SyntheticSource):  # Computed features: already preprocessed.
    label_format = 'one_hot' if source.one_hot else 'int'
    identity = preprocess.Preprocessor(1.0, (0.0,), (1.0,), label_format, source.num_classes)
    batch = dataclasses.replace(source, one_hot=False).gather(np.arange(len(source)))
    return batch['x'], batch['y'], identity
  raise ValueError(f'no device copy for a {type(source).__name__}; use the host buffer.')


def raw_nbytes(source: data.DataSource) -> int | None:
  """Bytes of the raw split on the device, without reading it (None: unknown)."""
  n = len(source)
  if isinstance(source, arrays.ArraySource):
    return int(source.images.nbytes) + 4 * n
  if isinstance(source, synthetic.SyntheticSource):
    return 4 * n * int(np.prod(source.input_shape)) + 4 * n
  if isinstance(source, tfds_source.TfdsSource):
    return n * int(np.prod(source.input_shape)) + 4 * n  # uint8 images, as TFDS stores them.
  return None


def default_max_bytes(device: jax.Device | None = None) -> int:
  """The byte limit for a device copy: 1/4 of an accelerator's memory, 1 GiB on the CPU."""
  device = device or jax.local_devices()[0]
  if device.platform == 'cpu':
    return CPU_MAX_BYTES
  stats = device.memory_stats() or {}
  limit = stats.get('bytes_limit')
  return int(ACCELERATOR_MEMORY_FRACTION * limit) if limit else CPU_MAX_BYTES


def fits_on_device(source: data.DataSource, max_bytes: int | None = None) -> bool:
  """Whether the raw split is a known source of at most `max_bytes` (default above)."""
  if max_bytes is not None and (
    isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0
  ):
    raise ValueError(f'device data byte limit must be an int >= 0 (0 = never), got {max_bytes!r}.')
  limit = default_max_bytes() if max_bytes is None else max_bytes
  size = raw_nbytes(source)
  return size is not None and size <= limit


def put_on_device(
  source: data.DataSource, sharding: jax.sharding.Sharding | None = None
) -> DeviceDataset:
  """The raw split on the device (replicated over a mesh with `sharding`), read once."""
  images, labels, pre = _raw_arrays(source)
  images = np.asarray(images)
  if images.dtype == np.float64:  # The host preprocessor computes in float32 too.
    images = images.astype(np.float32)
  labels = np.asarray(labels)
  labels = (
    labels.astype(np.float32).reshape(len(labels), -1)
    if pre.targets == 'values'
    else labels.astype(np.int32)
  )
  constants = (
    np.float32(pre.scale),
    np.asarray(pre.mean, np.float32),
    np.asarray(pre.std, np.float32),
  )
  images, labels, (scale, mean, std) = jax.device_put((images, labels, constants), sharding)
  return DeviceDataset(
    images=images,
    labels=labels,
    scale=scale,
    mean=mean,
    std=std,
    label_format=pre.label_format,
    num_classes=int(pre.num_classes),
    targets=pre.targets,
  )


def index_buffer(
  logical: batching.LogicalBatch,
  max_physical_batches: int,
  rows: np.ndarray | None = None,
  *,
  num_rows: int,
) -> tuple[dict[str, np.ndarray], np.int32]:
  """({'index': int32 [K_max, rows], 'weight': float32 [K_max, rows]}, K) for a DeviceDataset.

  `num_rows`: the rows of the source the indices will be gathered from; an index outside
  [0, num_rows) is refused here (`LogicalBatch.check_rows`), before any gather.
  """
  logical.check_rows(num_rows)
  k, p = logical.indices.shape
  if k > max_physical_batches:
    raise ValueError(f'logical batch has {k} physical batches > K_max = {max_physical_batches}.')
  rows = np.arange(p) if rows is None else rows
  index = np.zeros((max_physical_batches, len(rows)), np.int32)
  weight = np.zeros((max_physical_batches, len(rows)), np.float32)
  index[:k] = logical.indices[:, rows]
  weight[:k] = logical.weights[:, rows]
  return {'index': index, 'weight': weight}, np.int32(k)


def host_buffer(
  source: data.DataSource,
  logical: batching.LogicalBatch,
  max_physical_batches: int,
  rows: np.ndarray | None = None,
) -> tuple[dict[str, np.ndarray], np.int32]:
  """({'x': [K_max, rows, ...], 'y': ..., 'weight': ..., 'index': ...}, K), gathered on the host.

  One `gather` of the K·rows real and padding rows; batches K.. stay zero.
  """
  index, k = index_buffer(logical, max_physical_batches, rows, num_rows=len(source))
  shape = index['index'].shape
  gathered = source.gather(index['index'][:k].reshape(-1).astype(np.int64))
  out = {}
  for name, value in gathered.items():
    buf = np.zeros(shape + value.shape[1:], value.dtype)
    buf[:k] = value.reshape((int(k), shape[1]) + value.shape[1:])
    out[name] = buf
  out['weight'] = index['weight']
  out['index'] = index['index']  # The rows' example indices (augmult keys views by them).
  return out, k


class Prefetcher:
  """Iterates `make(step)` for `steps`, computed `depth` steps ahead on a thread.

  With depth = 2 (double buffering) the host gathers step t + 1 while the
  device runs step t. An exception in `make` is re-raised by the iteration
  that would have returned its item. `close()` (or leaving a `with` block)
  stops the thread.
  """

  def __init__(self, make: Callable[[int], Any], steps: Iterable[int], depth: int = 2):
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
      raise ValueError(f'prefetch depth must be an int >= 1, got {depth!r}.')
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._fill, args=(make, list(steps)), daemon=True)
    self._thread.start()

  def _fill(self, make, steps):
    for step in steps:
      try:
        item = (step, make(step), None)
      except Exception as e:  # pylint: disable=broad-except
        item = (step, None, e)
      if not self._put(item) or item[2] is not None:
        break
    self._put(None)  # End of the steps.

  def _put(self, item) -> bool:
    """Queues item unless closed first (then False): never blocks a close()."""
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def __iter__(self) -> Iterator[tuple[int, Any]]:
    while True:
      item = self._queue.get()
      if item is None:
        return
      step, value, error = item
      if error is not None:
        self.close()
        raise error
      yield step, value

  def close(self):
    self._stop.set()
    self._thread.join(timeout=5)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
