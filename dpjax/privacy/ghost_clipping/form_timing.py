"""Each layer's clipping form chosen by timing both forms on the device that runs them.

The mixed rule (Bu et al. 2022, "Scalable and Efficient Training of Large Convolutional Neural
Networks with Differential Privacy"; `mixed.use_ghost`) takes a layer's ghost form when
S²(m + c) < S·m·c: a FLOP count, which is not time (memory traffic, fusion, the device's
matmul units; issue 35 measured ghost / non-private 0.27 on an H100 for the tanh CNN).
`choose_forms` times, for every covered layer whose rule has two forms at its shapes, what the
step runs for that layer in each form: its norm and its share of the clipped sum
(`backward.layer_norms` + `backward.layer_weighted_sum`), compiled alone, on random inputs of
the layer's shapes at the physical batch P. Per layer, not per whole step: the forward and
activation-backward pass are the same in both forms, so the layers' own programs would be the
whole difference but for fusion across layers, and L layers cost 2L small compilations instead
of 2^L (or L + 1 greedy) compilations of the whole step. Layers of equal shapes are timed once.
Measured on the CPU the fusion is not negligible: WRN-16-4's layers timed alone show ghost ≈
materialised, while the whole step is 3.8x slower all-ghost, and the per-layer choice ran at
0.89x the FLOP rule's. Hence, when the per-layer winners differ from the FLOP rule's, the
whole clipped sum is timed with both assignments and the measured one is kept only if faster
(`whole_step`, given the step's program); when they agree, nothing more is timed.
Each time is the median of interleaved repeats after a warm-up; the faster form is chosen
unless the two are within `TIE` of each other, where the FLOP rule's choice stands.

Nothing here reads the private data: the inputs are random, so the choice depends only on the
device and the shapes, and both forms compute the same norms and clipped sum up to float
rounding (each row clipped at C, the rounding paid for in ε as for the FLOP rule's forms).

The decisions (and the whole-step verdict) are cached as JSON beside jax's persistent
compilation cache (`<jax_compilation_cache_dir>/clipping_forms/<key>.json`) and in memory,
keyed by the backend, device kind, jax version, matmul precision, P, every layer of choice's
shapes and dtypes, and (with a whole step) the model's loss and the step's argument shapes.
Timing is skipped (the FLOP rule decides) when no layer has a choice; if it fails, the FLOP
rule decides and the reason is among the lines logged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time

import jax
import numpy as np

from dpjax.privacy.ghost_clipping import backward
from dpjax.privacy.ghost_clipping import mixed
from dpjax.privacy.ghost_clipping import whole_step as whole_step_lib
from dpjax.privacy.ghost_clipping.coverage import Coverage
from dpjax.privacy.ghost_clipping.coverage import Layer

FORM_RULES = ('flops', 'measured')  # How each layer's form is chosen.
FORMS = {'ghost': True, 'materialised': False}
TIE = 0.05  # Relative difference under which the FLOP rule's choice stands.
REPEATS = 5  # Timed samples per form (medians).
MIN_SAMPLE_S = 2e-3  # Shortest timed sample: several calls for fast layers.
CACHE_SUBDIR = 'clipping_forms'
_MEMO: dict[str, dict] = {}  # Cache key -> decisions, for this process.


@dataclasses.dataclass(frozen=True)
class FormChoice:
  """The measured forms: `ghost` {layer key: True (ghost) / False}, for `mixed.chosen_forms`;
  `lines` say what was chosen from which times; `timed` is False when the decisions were read
  from a cache (or nothing needed timing); `seconds`: what timing took (compiling included)."""

  ghost: dict
  lines: tuple[str, ...]
  timed: bool
  seconds: float = 0.0


def check_form_rule(rule: str) -> str:
  """'flops' or 'measured'; ValueError otherwise."""
  if rule not in FORM_RULES:
    raise ValueError(f'forms={rule!r}; valid: {FORM_RULES}.')
  return rule


def has_choice(layer: Layer) -> bool:
  """Whether the layer's rule takes a different form when forced ghost than materialised."""
  if layer.rule.form is None:
    return False
  forms = set()
  for ghost in FORMS.values():
    with mixed.forced_form(ghost):
      forms.add(layer.rule.form(layer))
  return len(forms) > 1


def flops_ghost(layer: Layer) -> bool:
  """The FLOP rule's form for the layer (True: ghost), read from its form text."""
  return layer.rule.form(layer).startswith('ghost')


def signature(layer: Layer, theta: dict) -> str:
  """The layer's rule, class, input, output and parameter shapes and dtypes, as text."""

  def aval(v) -> str:
    return f'{jax.numpy.dtype(v.dtype).name}{list(v.shape)}'

  params = ','.join(f'{k}:{aval(v)}' for k, v in sorted(theta.items()))
  return (
    f'{layer.rule.name}/{type(layer.module).__name__} in {aval(layer.in_aval)} '
    f'out {aval(layer.out_aval)} {params}'
  )


def cache_key(signatures: list[str], batch_size: int, program: str | None = None) -> dict:
  """What the decisions depend on besides the code: device, precision, P, layer shapes, and
  `program` (`WholeStep.key`: the model and the step's shapes) when the whole step is timed."""
  device = jax.devices()[0]
  return {
    'format': 2,  # Decisions and the whole step's verdict.
    'program': program,
    'backend': jax.default_backend(),
    'device_kind': device.device_kind,
    'jax': jax.__version__,
    'matmul_precision': str(jax.config.jax_default_matmul_precision),
    'physical_batch_size': int(batch_size),
    'layers': sorted(set(signatures)),
  }


def cache_dir() -> str | None:
  """`clipping_forms` under jax's persistent compilation cache directory, or None if off."""
  root = jax.config.jax_compilation_cache_dir
  if not (jax.config.jax_enable_compilation_cache and root):
    return None
  return os.path.join(root, CACHE_SUBDIR)


def _random_inputs(layer: Layer, theta: dict, n: int):
  """(theta, a, d, factor, keep) of the layer's shapes at n rows (random; no data)."""
  rng = np.random.default_rng(0)
  normal = lambda shape, dtype: rng.normal(size=shape).astype(dtype)
  shape, dtype = (n, *layer.in_aval.shape), np.dtype(layer.in_aval.dtype)
  if np.issubdtype(dtype, np.integer):  # Token ids (Embed).
    a = rng.integers(0, getattr(layer.module, 'num_embeddings', 2), shape).astype(dtype)
  else:
    a = normal(shape, dtype)
  return (
    {k: normal(v.shape, np.dtype(v.dtype)) for k, v in theta.items()},
    a,
    normal((n, *layer.out_aval.shape), np.dtype(layer.out_aval.dtype)),
    rng.uniform(size=n).astype(np.float32),
    np.ones(n, bool),
  )


def time_layer(layer: Layer, theta: dict, n: int, repeats: int = REPEATS) -> dict[str, float]:
  """Median seconds {form: s} of the layer's norm and clipped-sum share in each form."""
  args = _random_inputs(layer, theta, n)

  def program(theta, a, d, factor, keep):
    part = backward.layer_norms(layer, theta, a, d)
    return part[0], backward.layer_weighted_sum(layer, theta, a, d, part, factor, keep)

  compiled = {}
  for form, ghost in FORMS.items():
    with mixed.forced_form(ghost):  # A fresh function: jit's trace cache ignores the form.
      compiled[form] = jax.jit(lambda *a: program(*a)).lower(*args).compile()
  calls = {}
  for form, fn in compiled.items():  # Warm-up, and the calls per sample.
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls[form] = max(1, int(np.ceil(MIN_SAMPLE_S / (time.perf_counter() - start + 1e-9))))
  times = {form: [] for form in compiled}
  for _ in range(repeats):  # Interleaved: load on the machine affects both forms alike.
    for form, fn in compiled.items():
      start = time.perf_counter()
      for _ in range(calls[form]):
        out = fn(*args)
      jax.block_until_ready(out)
      times[form].append((time.perf_counter() - start) / calls[form])
  return {form: float(np.median(t)) for form, t in times.items()}


def decide(seconds: dict[str, float], flops_choice: bool) -> bool:
  """True (ghost) if ghost is faster by more than `TIE`, False if materialised is; else the
  FLOP rule's choice."""
  ghost, mat = seconds['ghost'], seconds['materialised']
  if abs(ghost - mat) <= TIE * min(ghost, mat):
    return flops_choice
  return ghost < mat


def _read(path: str, key: dict) -> dict | None:
  try:
    with open(path, encoding='utf-8') as f:
      stored = json.load(f)
  except (OSError, ValueError):
    return None
  return stored['decisions'] if stored.get('key') == key else None


def _write(path: str, key: dict, decisions: dict) -> None:
  """Atomically (a temporary file renamed): a concurrent reader sees all of it or nothing."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix='.tmp-')
    with os.fdopen(fd, 'w', encoding='utf-8') as f:
      json.dump({'key': key, 'decisions': decisions}, f, indent=1)
    os.replace(tmp, path)
  except OSError:  # A read-only cache: the decisions stay in memory.
    pass


def _time_all(layers: list[tuple[Layer, dict]], sigs: list[str], batch_size: int) -> dict:
  """{signature: {'ghost': the choice, 'seconds': {form: s}, 'flops_ghost': ...}}."""
  decisions = {}
  for (l, t), sig in zip(layers, sigs):
    if sig not in decisions:
      seconds = time_layer(l, t, batch_size)
      decisions[sig] = {
        'ghost': decide(seconds, flops_ghost(l)),
        'seconds': seconds,
        'flops_ghost': flops_ghost(l),
      }
  return decisions


def _timed(layers, sigs: list[str], batch_size: int, step) -> dict:
  """{'layers': `_time_all`'s decisions, 'whole_step': `whole_step.verdict` or None (no step
  given, or the per-layer winners are the FLOP rule's)}."""
  decisions = _time_all(layers, sigs, batch_size)
  measured = {l.key: decisions[s]['ghost'] for (l, _), s in zip(layers, sigs)}
  differs = any(d['ghost'] != d['flops_ghost'] for d in decisions.values())
  whole = whole_step_lib.verdict(step, measured) if step is not None and differs else None
  return {'layers': decisions, 'whole_step': whole}


def _lines(layers, sigs: list[str], stored: dict) -> list[str]:
  """What was chosen from which times: per layer, then the whole step's verdict."""
  decisions, whole = stored['layers'], stored['whole_step']
  form = lambda ghost: 'ghost' if ghost else 'materialised'
  lines = [
    f'{"/".join(l.param_path)}: {form(decisions[s]["ghost"])} '
    f'(measured: ghost {decisions[s]["seconds"]["ghost"] * 1e3:.3g} ms, materialised '
    f'{decisions[s]["seconds"]["materialised"] * 1e3:.3g} ms; FLOP rule: '
    f'{form(decisions[s]["flops_ghost"])})'
    for (l, _), s in zip(layers, sigs)
  ]
  if whole is not None:
    sec = whole['seconds']
    lines.append(
      f"whole clipped sum: measured forms {sec['measured'] * 1e3:.3g} ms, FLOP rule's "
      f'{sec["flops"] * 1e3:.3g} ms: '
      + (
        'the measured forms run'
        if whole['kept'] == 'measured'
        else "the FLOP rule's forms run (the measured ones are not faster on the whole step)"
      )
    )
  return lines


def choose_forms(
  coverage: Coverage,
  thetas: list[dict],
  batch_size: int,
  directory: str | None = None,
  whole_step: whole_step_lib.WholeStep | None = None,
) -> FormChoice:
  """Each layer's form, timed on this device (see the module doc).

  Args:
    coverage: a complete ghost-clipping coverage of the model.
    thetas: each covered layer's parameters (arrays or tracers: only shapes are read).
    batch_size: P, the rows of the physical batch the step runs.
    directory: where decisions are cached (default `cache_dir()`; None there: memory only).
    whole_step: the step's clipped sum: the measured forms run only if it is faster with them
      than with the FLOP rule's (`whole_step.verdict`); None: the per-layer winners run.
  """
  layers = [(l, t) for l, t in zip(coverage.layers, thetas) if has_choice(l)]
  if not layers or batch_size < 1:
    return FormChoice({}, (), False)
  start = time.perf_counter()
  sigs = [signature(l, t) for l, t in layers]
  try:
    key = cache_key(sigs, batch_size, whole_step and whole_step.key())
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    directory = cache_dir() if directory is None else directory
    path = directory and os.path.join(directory, digest + '.json')
    stored = _MEMO.get(digest) or (path and _read(path, key))
    timed = stored is None
    if timed:
      stored = _timed(layers, sigs, batch_size, whole_step)
  except Exception as e:  # pylint: disable=broad-except  # Any failure: the FLOP rule.
    return FormChoice(
      {}, (f'timing the forms failed ({type(e).__name__}: {e}); the FLOP rule decides',), False
    )
  if timed and path:
    _write(path, key, stored)
  _MEMO[digest] = stored
  keep = stored['whole_step'] is None or stored['whole_step']['kept'] == 'measured'
  ghost = {l.key: stored['layers'][s]['ghost'] for (l, _), s in zip(layers, sigs)} if keep else {}
  return FormChoice(ghost, tuple(_lines(layers, sigs, stored)), timed, time.perf_counter() - start)
