"""Small helpers shared by the ghost-clipping modules."""

from __future__ import annotations

from collections.abc import Sequence


def as_tuple(value) -> tuple:
  return tuple(value) if isinstance(value, Sequence) else (value,)


def broadcast(value, rank: int) -> tuple[int, ...]:
  """Conv attribute (int, sequence or None) as a tuple of `rank` ints."""
  if value is None:
    value = 1
  if isinstance(value, int):
    return (value,) * rank
  return tuple(value)
