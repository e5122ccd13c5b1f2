"""Every sampled index is checked against the source's rows before it is gathered.

Found on the way in issue 35: with the audit canaries counted twice the sampler drew
indices up to 1837 from a source of 1637 rows and training finished without an error. An
out-of-range gather is no error on the device (jnp.take fills the row with the dtype's
extreme: a uint8 image of 255s, the label INT_MIN) and numpy wraps a negative index to the
last row, so the trainer's data path (`chunks.make_chunks` → `device.index_buffer` /
`host_buffer`) must refuse before the gather. On da06065 the device path below trains
silently and the host path raises numpy's IndexError (or wraps, for a negative index).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.data import arrays
from dpjax.data import device as device_data
from dpjax.data import preprocess
from dpjax.privacy import batching
from dpjax.privacy import samplers
from dpjax.privacy import sharding
from dpjax.privacy.auditing import canaries
from dpjax.trainer.loop import chunks

ROWS = 6  # The source's rows.


def _source() -> arrays.ArraySource:
  images = (np.arange(ROWS * 4, dtype=np.uint8) * 7).reshape(ROWS, 2, 2, 1)
  return arrays.ArraySource(
    images, np.arange(ROWS) % 3, preprocess.Preprocessor(255.0, (0.0,), (1.0,), 'int', 3)
  )


class _GatherSpy:
  """`source` whose gathers are recorded (nothing may be gathered after a refusal)."""

  def __init__(self, source):
    self.source, self.gathered = source, []

  def __len__(self):
    return len(self.source)

  def gather(self, indices):
    self.gathered.append(np.array(indices))
    return self.source.gather(indices)


@dataclasses.dataclass(frozen=True)
class _Planted(samplers.FixedSizeSampler):
  """A sampler whose every step is the batch `planted` (a sampler bug, planted)."""

  planted: tuple[int, ...] = ()

  def indices(self, step):
    return np.asarray(self.planted, np.int64)


def _batches(batcher, dataset, source, serial=False):
  """The trainer's data path for steps 0, 1 (one call of 2 steps)."""
  stream = chunks.make_chunks([(0, 2)], batcher, source, dataset, sharding.make_mesh(1), 2, serial)
  with stream as prepared:
    return [chunk for _, chunk in prepared]


def test_counted_twice_sampler_is_refused_on_the_device_path():
  """N = 2·rows (the rows counted twice): refused before the device's clamped gather.

  Fails on da06065: there the chunk is built and the step trains on fill rows."""
  source = _source()
  sampler = samplers.make('fixed_size', 2 * ROWS, ROWS, seed=1)
  assert sampler.indices(0).max() >= ROWS  # The bug draws rows that do not exist.
  dataset = device_data.put_on_device(source)
  # Why the check is needed: the device gathers an absent row without a word.
  out = dataset.gather(jnp.asarray([ROWS], jnp.int32))
  assert int(out['y'][0]) not in set(source.labels.tolist())
  with pytest.raises(ValueError, match=rf'index \d+ is outside \[0, {ROWS}\)') as e:
    _batches(batching.Batcher(sampler, 2, ROWS), dataset, source)
  assert '\n' not in str(e.value) and 'step 0' in str(e.value)


def test_canaries_counted_twice_are_refused_on_the_host_path():
  """The issue's case: m canaries added to N twice (N + 2m) over a source of N + m rows.

  Fails on da06065: the canary source maps an index past its rows to a canary id ≥ m and
  gathers it without a word."""
  m = 2
  source = _GatherSpy(canaries.CanarySource(_source(), m))
  sampler = samplers.make('fixed_size', ROWS + 2 * m, ROWS + m, seed=0)
  assert sampler.indices(0).max() >= ROWS + m
  with pytest.raises(ValueError, match=rf'outside \[0, {ROWS + m}\)'):
    _batches(batching.Batcher(sampler, 2, ROWS + m), None, source, serial=True)
  assert not source.gathered


@pytest.mark.parametrize('serial', [False, True])  # Prefetched on a thread, or inline.
@pytest.mark.parametrize('bad', [ROWS, ROWS + 200, -1])
def test_out_of_range_index_is_refused_before_the_host_gather(serial, bad):
  """Nothing is gathered: an index ≥ rows fails on da06065 with numpy's IndexError, not this
  refusal, and -1 is gathered there as the last row."""
  source = _GatherSpy(_source())
  batcher = batching.Batcher(
    _Planted(num_examples=ROWS + 300, batch_size=2, seed=0, planted=(0, bad)), 2, 2
  )
  with pytest.raises(ValueError, match=rf'index {bad} is outside \[0, {ROWS}\)'):
    _batches(batcher, None, source, serial)
  assert not source.gathered


def test_indices_at_the_edges_of_the_source_are_gathered():
  """0 and rows − 1 pass (no off-by-one), padding rows (index 0) included; the chunk holds them."""
  source = _GatherSpy(_source())
  batcher = batching.Batcher(
    _Planted(num_examples=ROWS, batch_size=3, seed=0, planted=(0, ROWS - 1, 2)), 2, 4
  )
  (chunk,) = _batches(batcher, None, source, serial=True)
  np.testing.assert_array_equal(chunk.buffer['index'][0, :2].ravel(), [0, ROWS - 1, 2, 0])
  np.testing.assert_array_equal(chunk.buffer['weight'][0, :2].ravel(), [1, 1, 1, 0])
  (device_chunk,) = _batches(batcher, device_data.put_on_device(_source()), _source())
  np.testing.assert_array_equal(device_chunk.buffer['index'], chunk.buffer['index'])
