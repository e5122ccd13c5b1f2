"""The measured forms checked on the whole clipped sum: kept only if that program runs faster.

`form_timing` times each layer's two forms alone; what the step runs is one program in which
XLA fuses across layers, and the sum of the layers' differences is not the step's (on the CPU,
WRN-16-4's measured forms ran at 0.89x the FLOP rule's). So, when the per-layer winners differ
from the FLOP rule's (Bu et al. 2022, "Scalable and Efficient Training of Large Convolutional
Neural Networks with Differential Privacy"), the whole clipped-sum program
`(params, examples, weights) -> (Σ_i w_i clip_C(g_i), rows)` is compiled with each
assignment and timed: interleaved repeats (load on the machine affects both alike), medians;
the measured assignment is kept only if its median is below the FLOP rule's by more than
`TIE`, so the choice is never slower than the FLOP rule's beyond the timing noise.

Cost, once per (device, shapes, model) (the verdict is cached with `form_timing`'s): two
compilations of the clipped sum besides the step's own, a warm-up call of each, and at most
`REPEATS` interleaved pairs of samples of max(`MIN_SAMPLE_S`, one call), fewer when the
warm-up says they would take over `BUDGET_S` (at least one pair). Measured on the loaded
2-core CPU (scripts/results/bench_clipping_forms_wrn_against_cpu.json, before the budget):
WRN-16-4 at P = 16 with per-layer winners opposite to the FLOP rule's, 14.3 s against 4.2 s
per call, rejected; the check took 239 s, of which 5 rounds ~92 s (now 1 round) and two
compilations with a warm-up call each the rest.

Nothing here reads the private data: the inputs are random of the step's shapes and dtypes
(parameters N(0, 1/fan-in), float inputs N(0, 1), integer inputs 0, weights 1), so the verdict
depends only on the device, the shapes and the program. Both assignments compute the same
norms and clipped sum up to float rounding (each row clipped at C).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import hashlib
import re
import time

import jax
import numpy as np

from dpjax.privacy.ghost_clipping import mixed

REPEATS = 5  # Timed samples per assignment (medians).
MIN_SAMPLE_S = 0.05  # Shortest timed sample: several calls for fast programs.
BUDGET_S = 20.0  # Timed samples beyond the warm-up: fewer repeats past this (slow programs).
TIE = 0.02  # The measured assignment must be faster than the FLOP rule's by more than this.


@dataclasses.dataclass(frozen=True)
class WholeStep:
  """The clipped sum `fn(params, examples, weights)` of the step, and its arguments (arrays or
  tracers: only shapes and dtypes are read); `loss_fn(params, example)` identifies the model."""

  fn: Callable
  loss_fn: Callable
  params: object
  examples: object
  weights: object

  def key(self) -> str:
    """A digest of the per-example loss's jaxpr (addresses removed) and the arguments' shapes:
    two models with the same layers of choice but other activations, heads or losses get
    their own verdicts."""
    aval = lambda l: jax.ShapeDtypeStruct(l.shape, l.dtype)
    one = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape[1:], l.dtype), self.examples)
    jaxpr = jax.make_jaxpr(self.loss_fn)(jax.tree.map(aval, self.params), one)
    text = re.sub(r'0x[0-9a-f]+', '', str(jaxpr))
    shapes = str(jax.tree.map(aval, (self.params, self.examples, self.weights)))
    return hashlib.sha256((text + shapes).encode()).hexdigest()[:32]

  def random_inputs(self) -> tuple:
    """(params, examples, weights) of the step's shapes, random (see the module doc)."""
    rng = np.random.default_rng(0)

    def param(path, leaf):
      dtype = np.dtype(leaf.dtype)
      if len(leaf.shape) < 2:  # Biases 0 and (normalisation) scales 1: their initial values.
        scale = str(getattr(path[-1], 'key', '')) == 'scale'
        return (np.ones if scale else np.zeros)(leaf.shape, dtype)
      fan_in = int(np.prod(leaf.shape[:-1]))
      return (rng.normal(size=leaf.shape) / np.sqrt(fan_in)).astype(dtype)

    def example(leaf):
      dtype = np.dtype(leaf.dtype)
      if np.issubdtype(dtype, np.inexact):
        return rng.normal(size=leaf.shape).astype(dtype)
      return np.zeros(leaf.shape, dtype)  # Labels and token ids: 0 is valid for any range.

    return (
      jax.tree_util.tree_map_with_path(param, self.params),
      jax.tree.map(example, self.examples),
      np.ones(self.weights.shape, np.dtype(self.weights.dtype)),
    )


def compile_with(step: WholeStep, table: dict, inputs: tuple):
  """The clipped sum compiled with the forms of `table` ({}: the FLOP rule's). A fresh function
  per call: jit's trace cache does not see `mixed.chosen_forms`."""
  with mixed.chosen_forms(table):
    return jax.jit(lambda *a: step.fn(*a)).lower(*inputs).compile()


def time_programs(programs: dict, inputs: tuple, repeats: int = REPEATS) -> dict[str, float]:
  """Median seconds per call {name: s} of compiled programs of the same arguments, timed in
  interleaved samples of equal call counts (set by the first program's warm-up call): at most
  `repeats` rounds, fewer if the warm-up calls say the rounds would take over `BUDGET_S`."""
  warm = []
  for fn in programs.values():
    start = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    warm.append(time.perf_counter() - start + 1e-9)
  calls = max(1, int(np.ceil(MIN_SAMPLE_S / warm[0])))
  repeats = max(1, min(repeats, int(BUDGET_S / (calls * sum(warm)))))
  times = {name: [] for name in programs}
  for _ in range(repeats):
    for name, fn in programs.items():
      start = time.perf_counter()
      for _ in range(calls):
        out = fn(*inputs)
      jax.block_until_ready(out)
      times[name].append((time.perf_counter() - start) / calls)
  return {name: float(np.median(t)) for name, t in times.items()}


def keep_measured(seconds: dict[str, float]) -> bool:
  """Whether the measured assignment's median beats the FLOP rule's by more than `TIE`."""
  return seconds['measured'] < (1 - TIE) * seconds['flops']


def verdict(step: WholeStep, measured: dict) -> dict:
  """{'seconds': {'measured': s, 'flops': s}, 'kept': 'measured' | 'flops'}: the whole clipped
  sum timed with the measured forms `measured` ({layer key: ghost?}) and the FLOP rule's."""
  inputs = step.random_inputs()
  programs = {
    'measured': compile_with(step, measured, inputs),
    'flops': compile_with(step, {}, inputs),
  }
  seconds = time_programs(programs, inputs)
  return {'seconds': seconds, 'kept': 'measured' if keep_measured(seconds) else 'flops'}
