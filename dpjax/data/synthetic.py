"""A synthetic source: N examples computed from their index, O(1) memory at any N."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
  """N examples computed from their index: O(P) per gather, O(1) memory in N.

  Features are uniform in [-1, 1) (no further preprocessing), from a counter-based hash (SplitMix64) of
  (seed, index, feature); the label is the argmax of a fixed linear teacher
  (class c scores the features j ≡ c mod classes), so the task is learnable. Meant for benchmarks at any scale.
  """

  num_examples: int
  input_shape: tuple[int, ...]
  num_classes: int
  seed: int = 0
  offset: int = 0  # The test split uses indices shifted past the training split.
  one_hot: bool = False

  def __len__(self) -> int:
    return self.num_examples

  def _features(self, indices: np.ndarray) -> np.ndarray:
    dim = int(np.prod(self.input_shape))
    counters = (np.asarray(indices, np.uint64)[:, None] + np.uint64(self.offset)) * np.uint64(
      dim
    ) + np.arange(dim, dtype=np.uint64)[None, :]
    bits = _splitmix64(counters ^ np.uint64(self.seed * 0x9E3779B97F4A7C15 % 2**64))
    uniform = (bits >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)
    return (2 * uniform - 1).reshape((len(indices), *self.input_shape))

  def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    x = self._features(indices)
    # Teacher: class c scores the sum of features j with j ≡ c (mod classes);
    # BLAS-free so gathering stays cheap on a busy machine.
    flat = x.reshape(len(x), -1)
    width = -(-flat.shape[1] // self.num_classes) * self.num_classes
    padded = np.zeros((len(x), width), np.float32)
    padded[:, : flat.shape[1]] = flat
    scores = padded.reshape(len(x), -1, self.num_classes).sum(axis=1)
    y = np.argmax(scores, axis=1).astype(np.int32)
    if self.one_hot:
      return {'x': x, 'y': np.eye(self.num_classes, dtype=np.float32)[y]}
    return {'x': x, 'y': y}


def _splitmix64(z: np.ndarray) -> np.ndarray:
  """SplitMix64's output function (Steele, Lea & Flood 2014), elementwise on uint64."""
  with np.errstate(over='ignore'):
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))
