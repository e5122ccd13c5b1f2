"""The sampler block of a training config: how logical batches are drawn (b, P, B).

The accountant reads the same fields (q = b/N for Poisson; truncation at B is accounted).
"""

from dpjax.privacy import samplers
from dpjax.trainer.configuration.field_spec import Field

FIELDS: tuple[Field, ...] = (
  Field(
    'sampler.name',
    'str',
    'poisson',
    'the sampler; the accountant reads the same fields',
    choices=samplers.SAMPLER_NAMES,
    accounting=True,
  ),
  Field(
    'sampler.batch_size',
    'int',
    256,
    'b, the expected logical batch size (q = b/N)',
    1,
    accounting=True,
  ),
  Field(
    'sampler.num_groups',
    'int',
    1,
    'cyclic_poisson: k groups, step t draws from group t mod k (each member with '
    'probability b*k/N); 1 for the other samplers',
    1,
    accounting=True,
  ),
  Field(
    'sampler.physical_batch_size',
    'int',
    64,
    'P, rows per compiled call (static shape); 0 = the largest that fits the device',
    0,
    accounting=True,
  ),
  Field(
    'sampler.max_batch_size',
    'int',
    0,
    'B, the cap on a logical batch (a multiple of P; truncation is accounted); 0 = automatic',
    0,
    accounting=True,
  ),
)
