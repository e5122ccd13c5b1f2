"""How the DP step runs on the devices: its options and its programs' shardings.

None of this changes what a step releases (tests/privacy/test_dp_step.py holds the 'device'
and 'host' loops, and a mesh and none, to the same updates): a new parallel layout is a new
sharding rule here, not a new program in `dpjax.privacy.dp_step`.
"""

import dataclasses

import jax

from dpjax.privacy import param_sharding
from dpjax.privacy import sharding

PHYSICAL_LOOPS = ('auto', 'device', 'host')


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """How the step runs, not what it releases.

  mesh: the device mesh ('data', 'fsdp', 'tensor'; `sharding.make_mesh`): batches are split
    over 'data' × 'fsdp' (P must be a multiple of that), and the state (params, optimiser
    state, accumulator) stays where `rules` puts it: each program takes it in the layout it
    comes in and returns it in the same (`param_sharding.constrain`). None: run where the
    inputs are. The same programs either way.
  rules: how parameters are placed over 'fsdp' and 'tensor' (`param_sharding.ShardingRules`);
    with fsdp = tensor = 1 everything but the batch is replicated.
  physical_loop: how `train_step` loops over the K physical batches: 'device' (one program, a
    while loop inside: one dispatch per logical step), 'host' (K dispatches of the physical
    batch's program, then the release's: the same result), or 'auto' = 'host' on the CPU
    backend for models with convolution kernels (XLA:CPU runs convolution weight gradients
    inside a while loop far slower than at top level), else 'device'.
  clipping_forms: 'flops' | 'measured', how ghost clipping picks each layer's form.
  allow_repeated_steps: let `apply` noise a step again (tests comparing two sums under one
    noise; such releases have no guarantee). False: refused, one line.
  """

  mesh: jax.sharding.Mesh | None = None
  rules: param_sharding.ShardingRules = param_sharding.ShardingRules()
  physical_loop: str = 'auto'
  clipping_forms: str = 'flops'
  allow_repeated_steps: bool = False

  def __post_init__(self):
    if self.physical_loop not in PHYSICAL_LOOPS:
      raise ValueError(f'physical_loop={self.physical_loop!r}; valid: {PHYSICAL_LOOPS}.')


def program_shardings(mesh: jax.sharding.Mesh | None, kinds: str) -> dict:
  """`jax.jit`'s sharding arguments of a program over `mesh`: argument j by kinds[j] ('s' state
  in the layout it comes in, a host value replicated; 'b' a physical batch split over the
  example axes, 'l' a logical buffer [K_max, P, ...] split on its row axis, 'c' a chunk of them
  [S, K_max, P, ...]). The outputs' layout is the program's (`param_sharding.constrain`). No
  mesh: none (the program runs where its inputs are)."""
  if mesh is None:
    return {}
  by_kind = {
    's': None,
    'b': sharding.batch_sharding(mesh),
    'l': sharding.logical_batch_sharding(mesh),
    'c': sharding.chunk_sharding(mesh),
  }
  return {'in_shardings': tuple(by_kind[k] for k in kinds)} if kinds else {}


OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(StepOptions))


def loop_mode(physical_loop: str, params) -> str:
  """'device' or 'host' for these params (`StepOptions.physical_loop`; 'auto': 'host' on the
  CPU backend when a parameter is a convolution kernel, of rank >= 3)."""
  if physical_loop != 'auto':
    return physical_loop
  convolutional = any(jax.numpy.ndim(leaf) >= 3 for leaf in jax.tree.leaves(params))
  return 'host' if jax.default_backend() == 'cpu' and convolutional else 'device'
