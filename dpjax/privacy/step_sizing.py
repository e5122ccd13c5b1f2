"""The device memory of a compiled step, from XLA's analysis of the program (nothing runs).

bytes = arguments + outputs + temporaries − donated (aliased) bytes: what the program holds
on one device while it runs (with a mesh, the SPMD program's per-device share). Used to
choose the physical batch size P (`dpjax.trainer.planning.physical_batch`); sizing is not part of
what the step releases.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def abstract(tree: Any) -> Any:
  """The tree's shapes, dtypes and, for arrays, shardings (`jax.ShapeDtypeStruct` leaves)."""
  return jax.tree.map(
    lambda v: (
      v
      if isinstance(v, jax.ShapeDtypeStruct)
      else jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v), sharding=_sharding(v))
    ),
    tree,
  )


def _sharding(value: Any):
  """A jax.Array's sharding on a mesh (a sharded state is sized per device), else None."""
  where = getattr(value, 'sharding', None)
  return where if isinstance(where, jax.sharding.NamedSharding) else None


def signature(*trees: Any) -> tuple:
  """A hashable key of the trees' structure, shapes and dtypes."""
  leaves, structure = jax.tree.flatten(abstract(trees))
  return str(structure), tuple((tuple(l.shape), str(l.dtype), str(l.sharding)) for l in leaves)


class StepSizing:
  """Memory analyses of one step's program, by argument shapes (each compiled once)."""

  def __init__(self):
    self.compiles = 0  # Programs compiled only for their memory analysis.
    self._bytes: dict[tuple, int] = {}
    self._temporaries: dict[tuple, int] = {}
    self.last_temporaries: int | None = None  # temp_size_in_bytes of the last `bytes_of`.

  def bytes_of(self, program, params, opt_state, logical, dataset, keys) -> int:
    """Bytes of jitted `program(params, opt_state, logical, K, t, dataset, keys)`; `logical`
    may hold `jax.ShapeDtypeStruct`s. ValueError if the backend reports no analysis. Its
    largest temporary buffers' bytes are then `last_temporaries`."""
    key = signature(params, opt_state, logical) + (dataset is None,)
    if key not in self._bytes:
      compiled = program.lower(
        abstract(params),
        abstract(opt_state),
        logical,
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.uint32),
        dataset,
        keys,
      ).compile()
      self.compiles += 1
      m = compiled.memory_analysis()
      if m is None:
        raise ValueError(
          'this backend reports no memory analysis; set sampler.physical_batch_size > 0.'
        )
      self._bytes[key] = int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
      )
      self._temporaries[key] = int(m.temp_size_in_bytes)
    self.last_temporaries = self._temporaries[key]
    return self._bytes[key]
