"""What a model family declares to `dpjax.models.factory`, and the checks families share.

A family module (`mlp`, `cnn`, `wrn`, `transformer`, `vit`) holds its linen network, its
Flax NNX twin where one exists, and a `FAMILY` entry: the normalisations it supports, the
`config.model` fields it reads (each with its default and a comment) and `build`, which
checks those fields against the input shape and returns the network. The factory checks
what every family shares (name, unknown fields, BatchNorm, normalisation, activation,
framework, num_classes, input_shape) before it calls `build`.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import ml_collections

from dpjax.models import functional


class Family(NamedTuple):
  """A model family as the factory's registry holds it."""

  # The normalisations it supports (`config.model.normalization`); never BatchNorm.
  normalizations: tuple[str, ...]
  # Declares the family's fields on a ConfigDict, with their defaults and meaning.
  add_fields: Callable[[ml_collections.ConfigDict], None]
  # (config with every field, num_classes, input_shape) -> a module with linen's init/apply.
  build: Callable[[ml_collections.ConfigDict, int, tuple[int, ...]], Any]
  nnx: bool = False  # Also written in Flax NNX (`config.model.framework = 'nnx'`).


def check_positive(name: str, value, field: str) -> None:
  """Raises ValueError unless `value`, the field `field` of model `name`, is an int > 0."""
  if not isinstance(value, int) or value <= 0:
    raise ValueError(
      f'config.model.{field} must be a positive int for model {name!r}, got {value!r}.'
    )


def check_positive_fields(name: str, cfg: ml_collections.ConfigDict, fields: Sequence[str]) -> None:
  """`check_positive` of each of `fields`, in order."""
  for field in fields:
    check_positive(name, cfg[field], field)


def as_linen(name: str, make: Callable[..., Any]) -> functional.NNXModule:
  """The NNX network `make(rngs)` with linen's init/apply, so the trainer takes it unchanged."""
  return functional.NNXModule(make, name=f'{name} (nnx)')
