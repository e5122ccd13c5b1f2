"""Training throughput: dpjax DP-SGD against non-private JAX, a naive JAX DP-SGD
that recompiles for every batch shape, and Opacus (PyTorch), on the CPU.

Question (issue 6, benchmark 1; seed 002, Beltran et al., "Towards Efficient
and Scalable Implementation of Differentially Private Deep Learning"): how
many training examples per second does each implementation process on the
same machine, at the same expected (logical) batch size b and physical batch
size P, with proper Poisson sampling, and what does recompiling for every
new batch size cost over one epoch?

Every method trains on the same Poisson logical batches (dpjax's
`PoissonSampler`, q = b/N, same seed) of the same synthetic 28x28x1 examples
(`dpjax.data.synthetic.SyntheticSource`, gathered once into memory), with the same
σ, C and SGD step:

- jax_nonprivate: `dp_step.DPStep.for_model(private=False)`, the dpjax pipeline
  without clipping or noise.
- dpjax_vmap, dpjax_ghost: `DPStep(clipping='vmap' / 'ghost')`, masked
  DP-SGD: K = ceil(n/P) padded physical batches of static shape [P, ...],
  one compilation.
- naive_jax: seed 002's naive JAX baseline. The same jitted vmap-clipped
  `accumulate`, fed the logical batch split as Opacus splits it
  (`np.array_split` into ceil(n/P) chunks) at the chunks' real shapes, so it
  compiles once per new chunk size.
- torch_nonprivate: the same PyTorch model, plain SGD, same chunks, gradients
  accumulated over the chunks.
- opacus: Opacus `PrivacyEngine.make_private` (per-sample gradients by hooks,
  flat clipping, its own noise and accountant hook), the same chunks driven
  as its `BatchMemoryManager` does (`signal_skip_step`).

Per epoch including compilation (first): one epoch (ceil(N/b) Poisson steps)
of each JAX method from a cold start (new jit objects, no persistent
compilation cache); wall time and number of XLA compilations (traces of the
jitted functions, cross-checked against the jit cache size).

Steady-state throughput (then, on the warm JAX runners; the PyTorch ones are
warmed on the same steps): the first S logical steps of the epoch per repeat
(real examples / wall time, the last step's result fetched before the clock
stops); the methods are timed round-robin (order rotated every repeat) so
that load from other users of the shared machine falls on all of them alike;
the median over repeats is reported. No timed repeat compiles (asserted), so
naive_jax's steady state excludes compilation; it pads nothing, so it is an
upper bound on what the naive code reaches.

Same computation, checked: the PyTorch twins have the same parameter count
and, with the flax weights copied in, the same logits (max |diff| < 1e-4);
Opacus's clipped sum on one chunk equals dpjax's (relative diff < 1e-4).

Both frameworks get the same cores (`--threads`, default all): the process is
pinned to that many CPUs, which sizes XLA's thread pool, and PyTorch runs with
torch.set_num_threads(threads). On a shared machine whose other users keep
the cores busy, PyTorch's per-op thread parallelism suffers most (its threads
wait for each other at every op); `--threads 1` compares one core each. The
JSON records the load average before and after each phase and `git rev-parse
HEAD` (plus whether dpjax/ had uncommitted changes).

Backends: JAX runs where `jax.default_backend()` is (install jax[cuda12] for
a GPU); PyTorch and Opacus run on CUDA when `torch.cuda.is_available()`
(TF32 allowed, as the issue's PyTorch baseline), else on the CPU; the JSON
records both device names. The `bench` extra pins torch 2.13.0 from PyPI (the
CPU build here); on a GPU machine install the CUDA build of that version
first, from the index of the CUDA release its driver supports (cuXYZ, e.g.
cu126); `.[bench]` then keeps it (2.13.0+cuXYZ satisfies ==2.13.0):
  pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cuXYZ
  pip install -c constraints.txt -e '.[bench]'

Run (the PyTorch methods need the optional `bench` extra: a CPU build of torch
pinned to 2.13.0, and opacus):
  pip install -c constraints.txt -e '.[bench]'
  python scripts/bench_throughput.py             # ~7 min on 2 shared cores
  python scripts/bench_throughput.py --threads 1 --out \
      scripts/results/throughput_1thread         # one core each
  python scripts/bench_throughput.py --full      # N = 60000, more repeats
Writes scripts/results/throughput.json and throughput.png (or --out).
"""

import argparse
import json
import math
import os
import platform
import sys
import time

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_clipping
from dpjax.privacy import batching
from dpjax.data import synthetic
from dpjax.privacy import dp_step
from dpjax_bench import provenance
from dpjax.privacy import samplers
from dpjax.privacy import losses
from dpjax.privacy import prng

MODELS = ('mlp', 'cnn')
JAX_METHODS = ('jax_nonprivate', 'dpjax_vmap', 'dpjax_ghost', 'naive_jax')
TORCH_METHODS = ('torch_nonprivate', 'opacus')
LABELS = {
  'jax_nonprivate': 'JAX non-private (dpjax, private=False)',
  'dpjax_vmap': 'dpjax DP-SGD, vmap clipping',
  'dpjax_ghost': 'dpjax DP-SGD, ghost clipping',
  'naive_jax': 'naive JAX DP-SGD (variable shapes, steady state)',
  'torch_nonprivate': 'PyTorch non-private',
  'opacus': 'Opacus DP-SGD',
}
SEED = 0
LEARNING_RATE = 0.1
TORCH_DEVICE = 'cpu'  # 'cuda' when torch sees a GPU (set in main).


_load = provenance.load_average
_git_state = provenance.git_state


# -----------------------------------------------------------------------------
# The workload shared by every method: data, Poisson batches, chunks.
# -----------------------------------------------------------------------------
class Workload:
  """N synthetic examples in memory and the Poisson logical batches over them."""

  def __init__(
    self, num_examples: int, batch_size: int, physical_batch_size: int, input_shape=(28, 28, 1)
  ):
    source = synthetic.SyntheticSource(num_examples, tuple(input_shape), 10, seed=SEED)
    arrays = source.gather(np.arange(num_examples))
    self.x, self.y = arrays['x'], arrays['y']
    self.x_nchw = np.ascontiguousarray(np.moveaxis(self.x, -1, 1))
    self.physical_batch_size = physical_batch_size
    self.sampler = samplers.PoissonSampler(
      num_examples=num_examples, batch_size=batch_size, seed=SEED
    )
    self.steps_per_epoch = self.sampler.steps_per_epoch
    cap = batching.resolve_max_batch_size(
      self.sampler, physical_batch_size, num_steps=self.steps_per_epoch, delta=1e-5
    )
    self.batcher = batching.Batcher(self.sampler, physical_batch_size, cap)
    self._indices = {}

  def indices(self, step: int) -> np.ndarray:
    if step not in self._indices:
      self._indices[step] = self.sampler.indices(step)
    return self._indices[step]

  def chunks(self, step: int) -> list[np.ndarray]:
    """Opacus's BatchSplittingSampler: ceil(n/P) near-equal chunks."""
    idx = self.indices(step)
    if not len(idx):
      return []
    return np.array_split(idx, math.ceil(len(idx) / self.physical_batch_size))

  def num_examples(self, steps) -> int:
    return int(sum(len(self.indices(t)) for t in steps))


# -----------------------------------------------------------------------------
# JAX methods. Each runner does `steps` logical steps and returns the state.
# -----------------------------------------------------------------------------
class JaxMethod:
  """dpjax's DPStep driven masked (static shapes) or naive (real shapes)."""

  def __init__(self, name: str, model_name: str, wl: Workload, sigma: float, clip_norm: float):
    self.name, self.wl = name, wl
    model, shape, _ = bench_clipping._model(model_name)
    self.params = prng.init_params(model, SEED, shape)
    optimizer = optax.sgd(LEARNING_RATE)
    self.opt_state = optimizer.init(self.params)
    clipping = {'dpjax_ghost': 'ghost'}.get(name, 'vmap')
    self.step = dp_step.DPStep.for_model(
      model,
      optimizer,
      clip_norm=clip_norm,
      noise_multiplier=sigma,
      expected_batch_size=wl.sampler.expected_batch_size,
      private=name != 'jax_nonprivate',
      clipping=clipping,
      allow_repeated_steps=True,
    )  # Timed repeats rerun steps 0..S-1; nothing is released.
    self.num_params = int(sum(p.size for p in jax.tree.leaves(self.params)))

  def _physical_batches(self, step: int):
    if self.name == 'naive_jax':
      for chunk in self.wl.chunks(step):
        yield {
          'x': self.wl.x[chunk],
          'y': self.wl.y[chunk],
          'weight': np.ones(len(chunk), np.float32),
        }
    else:
      for idx, w in self.wl.batcher.logical_batch(step).physical_batches():
        yield {'x': self.wl.x[idx], 'y': self.wl.y[idx], 'weight': w}

  def run(self, steps) -> None:
    params, opt_state = self.params, self.opt_state
    for t in steps:
      acc = self.step.init_accumulator(params)
      for batch in self._physical_batches(t):
        acc = self.step.accumulate(params, acc, batch)
      params, opt_state, _ = self.step.apply(params, opt_state, acc, t)
    self.params, self.opt_state = jax.block_until_ready((params, opt_state))

  def compilations(self) -> dict[str, int]:
    return {
      'accumulate': self.step.compile_count('accumulate'),
      'apply': self.step.compile_count('apply'),
      'accumulate_jit_cache_size': self.step.accumulate._cache_size(),
    }


# -----------------------------------------------------------------------------
# PyTorch methods: identical architectures (parameter counts asserted equal).
# -----------------------------------------------------------------------------
def _torch_model(flax_model, input_shape):
  """PyTorch twin of a dpjax MLP or CNN, read off the flax module's fields.

  Same layers, sizes and activation (tanh). Flax's 'SAME' padding of a
  stride-s conv pads (ceil(H/s) - 1)·s + k - H rows in total, low half first;
  for the CNN's 8x8/2 conv on 28x28 that is 3 on each side, which PyTorch's
  symmetric padding reproduces (checked: output 14x14).
  """
  import torch

  nn = torch.nn
  if flax_model.activation != 'tanh':
    raise ValueError(f'activation {flax_model.activation!r}: only tanh twins.')
  classes = flax_model.num_classes
  if type(flax_model).__name__ == 'MLP':
    layers, width = [nn.Flatten()], math.prod(input_shape)
    for h in flax_model.hidden_sizes:
      layers += [nn.Linear(width, h), nn.Tanh()]
      width = h
    return nn.Sequential(*layers, nn.Linear(width, classes))
  size, channels, layers = input_shape[0], input_shape[-1], []
  for f, k, s, p in zip(
    flax_model.features, flax_model.kernel_sizes, flax_model.strides, flax_model.paddings
  ):
    if p == 'SAME':
      out = -(-size // s)
      total = max((out - 1) * s + k - size, 0)
      if total % 2:
        raise ValueError(f'asymmetric SAME padding {total} has no twin.')
      pad = total // 2
    else:
      out, pad = (size - k) // s + 1, 0
    layers += [
      nn.Conv2d(channels, f, k, stride=s, padding=pad),
      nn.Tanh(),
      nn.MaxPool2d(2, stride=1),
    ]
    size, channels = out - 1, f
  return nn.Sequential(
    *layers,
    nn.Flatten(),
    nn.Linear(channels * size * size, flax_model.hidden_size),
    nn.Tanh(),
    nn.Linear(flax_model.hidden_size, classes),
  )


def _torch_layout(tree, torch_model) -> list[tuple[np.ndarray, np.ndarray]]:
  """(weight, bias) per layer of a flax parameter tree (or a gradient with its
  structure) in the twin's layout: kernels transposed, and the first Dense
  after the convs permuted from flax's (H, W, C) flatten order to PyTorch's
  (C, H, W)."""
  import torch

  order = lambda k: (not k.startswith('Conv'), int(k.rsplit('_', 1)[1]))
  flax_layers = [tree[k] for k in sorted(tree, key=order)]
  torch_layers = [
    m for m in torch_model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))
  ]
  if len(flax_layers) != len(torch_layers):
    raise AssertionError(f'{len(flax_layers)} flax vs {len(torch_layers)} torch layers')
  out, channels = [], None
  for fl, tl in zip(flax_layers, torch_layers):
    k = np.asarray(fl['kernel'])
    if isinstance(tl, torch.nn.Conv2d):
      w, channels = k.transpose(3, 2, 0, 1), k.shape[-1]
    else:
      w = k.T
      if channels is not None:  # First Dense after the convs.
        side = math.isqrt(w.shape[1] // channels)
        w = w.reshape(-1, side, side, channels).transpose(0, 3, 1, 2)
        w, channels = w.reshape(w.shape[0], -1), None
    out.append((np.array(w), np.array(fl['bias'])))
  return out


def _load_flax_params(torch_model, params) -> None:
  """Copies flax parameters into the twin: every method starts alike."""
  import torch

  layers = [m for m in torch_model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
  with torch.no_grad():
    for layer, (w, b) in zip(layers, _torch_layout(params, torch_model)):
      layer.weight.copy_(torch.from_numpy(w))
      layer.bias.copy_(torch.from_numpy(b))


def check_same_clipped_sum(model_name: str, wl: Workload, clip_norm: float) -> float:
  """max |Opacus − dpjax| / max |dpjax| of Σ_i clip_C(g_i) on one chunk.

  Opacus's DPOptimizer (told to skip the step, so it only clips and sums
  into p.summed_grad) against dpjax's vmap clipped sum, same weights, same
  examples: the methods timed compute the same thing. Opacus clips by
  C / (‖g_i‖ + 1e-6), dpjax by C / ‖g_i‖, hence a tolerance of 1e-4.
  """
  import opacus
  import torch
  from dpjax.privacy import clipping

  flax_model, shape, _ = bench_clipping._model(model_name)
  params = prng.init_params(flax_model, SEED, shape)
  chunk = wl.chunks(0)[0]
  want, _ = clipping.per_example_clipped_sum(
    losses.make_loss_fn(flax_model),
    params,
    {'x': wl.x[chunk], 'y': wl.y[chunk], 'weight': np.ones(len(chunk), np.float32)},
    clip_norm,
  )
  model = _torch_model(flax_model, shape)
  _load_flax_params(model, params)
  model = opacus.GradSampleModule(model.to(TORCH_DEVICE))
  optimizer = opacus.optimizers.DPOptimizer(
    torch.optim.SGD(model.parameters(), lr=LEARNING_RATE),
    noise_multiplier=0.0,
    max_grad_norm=clip_norm,
    expected_batch_size=len(chunk),
  )
  optimizer.signal_skip_step(do_skip=True)
  loss = torch.nn.CrossEntropyLoss()(
    model(torch.from_numpy(wl.x_nchw[chunk]).to(TORCH_DEVICE)),
    torch.from_numpy(wl.y[chunk]).long().to(TORCH_DEVICE),
  )
  loss.backward()
  optimizer.step()  # Skipped: clip and accumulate only.
  got = [p.summed_grad.cpu().numpy() for p in model.parameters()]
  ref = [a for wb in _torch_layout(want, model._module) for a in wb]
  scale = max(float(np.max(np.abs(r))) for r in ref)
  diff = max(float(np.max(np.abs(g - r))) for g, r in zip(got, ref)) / scale
  if not diff < 1e-4:
    raise AssertionError(
      f'{model_name}: Opacus and dpjax clipped sums differ by {diff:.2e} (relative)'
    )
  return diff


class TorchMethod:
  """Plain PyTorch SGD or Opacus DP-SGD over the workload's chunks."""

  def __init__(self, name: str, model_name: str, wl: Workload, sigma: float, clip_norm: float):
    import torch

    self.torch, self.name, self.wl = torch, name, wl
    torch.manual_seed(SEED)
    flax_model, shape, _ = bench_clipping._model(model_name)
    model = _torch_model(flax_model, shape)
    params = prng.init_params(flax_model, SEED, shape)
    _load_flax_params(model, params)
    model = model.to(TORCH_DEVICE)
    # Same function, not just the same parameter count: equal logits.
    x = wl.x[:8]
    with jax.default_matmul_precision('highest'):  # Not TF32: compared at 1e-4.
      want = np.asarray(flax_model.apply({'params': params}, x))
    got = model(torch.from_numpy(wl.x_nchw[:8]).to(TORCH_DEVICE)).detach().cpu().numpy()
    self.logits_max_abs_diff = float(np.max(np.abs(want - got)))
    if not self.logits_max_abs_diff < 1e-4:
      raise AssertionError(
        f'{model_name}: PyTorch twin differs from the flax model by {self.logits_max_abs_diff:.2e}'
      )
    self.num_params = int(sum(p.numel() for p in model.parameters()))
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    b = wl.sampler.expected_batch_size
    if name == 'opacus':
      import opacus

      dataset = torch.utils.data.TensorDataset(
        torch.from_numpy(wl.x_nchw), torch.from_numpy(wl.y).long()
      )
      loader = torch.utils.data.DataLoader(dataset, batch_size=int(round(b)))
      engine = opacus.PrivacyEngine()
      # The loader only fixes q = b/N (expected_batch_size = b); the batches
      # themselves are the workload's Poisson batches, shared by all methods.
      model, optimizer, _ = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=clip_norm,
        poisson_sampling=True,
      )
      # Opacus derives q = 1/len(loader) (b = 250 for N = 10000, b = 256);
      # divide by the same b as dpjax (only the update's scale depends on it).
      optimizer.expected_batch_size = int(round(b))
      self.criterion = torch.nn.CrossEntropyLoss()  # Mean; Opacus rescales.
    else:
      # Σ_i loss_i / b over the chunks: the same update as DPStep(private=False).
      ce = torch.nn.CrossEntropyLoss(reduction='sum')
      self.criterion = lambda logits, y: ce(logits, y) / b
    self.model, self.optimizer = model, optimizer

  def run(self, steps) -> None:
    torch, wl = self.torch, self.wl
    private = self.name == 'opacus'
    for t in steps:
      chunks = wl.chunks(t)
      for k, chunk in enumerate(chunks):
        if private:  # As BatchMemoryManager: step only after the last chunk.
          self.optimizer.signal_skip_step(do_skip=k < len(chunks) - 1)
        x = torch.from_numpy(wl.x_nchw[chunk]).to(TORCH_DEVICE, non_blocking=True)
        y = torch.from_numpy(wl.y[chunk]).long().to(TORCH_DEVICE, non_blocking=True)
        self.criterion(self.model(x), y).backward()
        if private:
          self.optimizer.step()
          self.optimizer.zero_grad()
      if not private:
        self.optimizer.step()
        self.optimizer.zero_grad()
    if TORCH_DEVICE == 'cuda':  # The clock stops after the GPU finishes.
      torch.cuda.synchronize()

  def compilations(self) -> dict[str, int]:
    return {}  # Eager PyTorch: nothing is compiled.


# -----------------------------------------------------------------------------
# Measurements.
# -----------------------------------------------------------------------------
def epoch_with_compilation(
  model_name: str, wl: Workload, repeats: int, sigma: float, clip_norm: float
):
  """One epoch of Poisson steps per JAX method from a cold start (new jit
  objects), compilation included; round-robin over `repeats` cold starts.

  Returns (result dict, the last runner of each method: warm, and for
  naive_jax compiled for every chunk shape of the epoch)."""
  steps = range(wl.steps_per_epoch)
  examples = wl.num_examples(steps)
  res, runners = {n: [] for n in JAX_METHODS}, {}
  for r in range(repeats):
    for name in JAX_METHODS[r % 4 :] + JAX_METHODS[: r % 4]:
      runners[name] = JaxMethod(name, model_name, wl, sigma, clip_norm)
      start = time.perf_counter()
      runners[name].run(steps)
      res[name].append((time.perf_counter() - start, runners[name].compilations()))
  chunk_sizes = {len(c) for t in steps for c in wl.chunks(t)}
  out = {
    'steps': len(steps),
    'examples': examples,
    'repeats': repeats,
    'distinct_naive_chunk_sizes': len(chunk_sizes),
    'padded_rows_fraction_masked': 1
    - examples / sum(wl.batcher.logical_batch(t).indices.size for t in steps),
    'methods': {},
  }
  for name in JAX_METHODS:
    sec = float(np.median([t for t, _ in res[name]]))
    comp = res[name][0][1]
    out['methods'][name] = {
      'seconds': sec,
      'all_seconds': [t for t, _ in res[name]],
      'examples_per_second': examples / sec,
      'compilations': comp,
    }
    print(
      f'{model_name:4s} epoch {name:15s} {sec:7.1f} s incl. compilation '
      f'({examples / sec:7.0f} ex/s), compilations {comp}',
      flush=True,
    )
  return out, runners


def steady_state(
  model_name: str,
  wl: Workload,
  methods,
  runners: dict,
  steps_per_repeat: int,
  repeats: int,
  sigma: float,
  clip_norm: float,
) -> dict:
  """Examples/s per method: medians over round-robin repeats of S steps.

  `runners` holds warm JAX runners (from the epoch); missing ones are made
  and warmed here on the same S steps (naive_jax then compiles every chunk
  shape among them), so no timed repeat compiles (asserted)."""
  steps = range(steps_per_repeat)
  examples = wl.num_examples(steps)
  warmup = {}
  for name in methods:
    if name in runners:
      continue
    cls = JaxMethod if name in JAX_METHODS else TorchMethod
    runners[name] = cls(name, model_name, wl, sigma, clip_norm)
    start = time.perf_counter()
    runners[name].run(steps)
    warmup[name] = time.perf_counter() - start
  counts = {n: runners[n].num_params for n in methods}
  if len(set(counts.values())) != 1:
    raise AssertionError(f'{model_name}: parameter counts differ: {counts}')
  before = {n: runners[n].compilations() for n in methods}
  times = {n: [] for n in methods}
  order = list(methods)
  for r in range(repeats):
    for name in order[r % len(order) :] + order[: r % len(order)]:
      start = time.perf_counter()
      runners[name].run(steps)
      times[name].append(time.perf_counter() - start)
  out = {
    'num_params': counts[methods[0]],
    'steps_per_repeat': steps_per_repeat,
    'examples_per_repeat': examples,
    'methods': {},
  }
  twin = [r.logits_max_abs_diff for r in runners.values() if hasattr(r, 'logits_max_abs_diff')]
  if twin:
    out['torch_twin_logits_max_abs_diff'] = max(twin)
  if 'opacus' in methods:
    out['opacus_vs_dpjax_clipped_sum_rel_diff'] = check_same_clipped_sum(model_name, wl, clip_norm)
    print(
      f'{model_name:4s} Opacus vs dpjax clipped sum on one chunk: '
      f'relative difference {out["opacus_vs_dpjax_clipped_sum_rel_diff"]:.1e}',
      flush=True,
    )
  for name in methods:
    comp = runners[name].compilations()
    if comp != before[name]:
      raise AssertionError(f'{name} compiled during the timed repeats: {before[name]} -> {comp}')
    sec = float(np.median(times[name]))
    out['methods'][name] = {
      'examples_per_second': examples / sec,
      'seconds_per_repeat_median': sec,
      'seconds_per_repeat': times[name],
      'compilations': comp,
    }
    if name in warmup:
      out['methods'][name]['warmup_seconds'] = warmup[name]
    print(
      f'{model_name:4s} {name:17s} {examples / sec:9.0f} ex/s '
      f'(median of {repeats} x {steps_per_repeat} steps, '
      f'{sec * 1e3:7.0f} ms) {comp or ""}',
      flush=True,
    )
  return out


def ratios(model: dict) -> dict:
  m = {k: v['examples_per_second'] for k, v in model['steady']['methods'].items()}
  r = {}
  for dp in ('dpjax_vmap', 'dpjax_ghost'):
    r[f'{dp}_over_jax_nonprivate'] = m[dp] / m['jax_nonprivate']
    if 'opacus' in m:
      r[f'{dp}_over_opacus'] = m[dp] / m['opacus']
  if 'opacus' in m:
    r['opacus_over_torch_nonprivate'] = m['opacus'] / m['torch_nonprivate']
    r['jax_nonprivate_over_torch_nonprivate'] = m['jax_nonprivate'] / m['torch_nonprivate']
  r['naive_jax_steady_over_dpjax_vmap'] = m['naive_jax'] / m['dpjax_vmap']
  e = model.get('epoch', {}).get('methods', {})
  for masked in ('dpjax_vmap', 'dpjax_ghost'):
    if masked in e and 'naive_jax' in e:
      # Throughput ratio per epoch incl. compilation = naive time / masked time.
      r[f'epoch_{masked}_over_naive_jax'] = e['naive_jax']['seconds'] / e[masked]['seconds']
  for name, v in e.items():
    # Epoch time beyond what the steady state would take: ~ compilation.
    r[f'epoch_{name}_seconds_beyond_steady_state'] = (
      v['seconds'] - model['epoch']['examples'] / m[name]
    )
  return r


# -----------------------------------------------------------------------------
# Plot.
# -----------------------------------------------------------------------------
def plot(result: dict, path: str) -> None:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  models = list(result['models'])
  fig, axes = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={'width_ratios': [3, 2]})
  ax = axes[0]
  methods = [
    m
    for m in (*JAX_METHODS, *TORCH_METHODS)
    if m in result['models'][models[0]]['steady']['methods']
  ]
  colors = dict(
    zip(
      (*JAX_METHODS, *TORCH_METHODS),
      ('#7f7f7f', '#1f77b4', '#2ca02c', '#ff7f0e', '#c7c7c7', '#d62728'),
    )
  )
  width = 0.8 / len(methods)
  for i, name in enumerate(methods):
    vals = [result['models'][m]['steady']['methods'][name]['examples_per_second'] for m in models]
    xs = np.arange(len(models)) + (i - (len(methods) - 1) / 2) * width
    bars = ax.bar(xs, vals, width, label=LABELS[name], color=colors[name])
    ax.bar_label(bars, [f'{v:.0f}' for v in vals], fontsize=7, rotation=90, padding=2)
  ax.set_yscale('log')
  ax.set_xticks(np.arange(len(models)))
  ax.set_xticklabels(
    [f'{m.upper()} ({result["models"][m]["steady"]["num_params"]:,} params)' for m in models]
  )
  ax.set_ylabel('training examples / s (steady state, median)')
  c = result['config']
  ax.set_title(
    f'Steady-state throughput, CPU ({result["threads"]} threads), '
    f'b={c["batch_size"]}, P={c["physical_batch_size"]}'
  )
  ax.legend(fontsize=7, loc='upper right')
  ax.set_ylim(top=ax.get_ylim()[1] * 8)
  ax = axes[1]
  epoch_methods = [
    m
    for m in JAX_METHODS
    if 'epoch' in result['models'][models[0]]
    and m in result['models'][models[0]]['epoch']['methods']
  ]
  width = 0.8 / max(len(epoch_methods), 1)
  for i, name in enumerate(epoch_methods):
    e = [result['models'][m]['epoch']['methods'][name] for m in models]
    xs = np.arange(len(models)) + (i - (len(epoch_methods) - 1) / 2) * width
    label = {'naive_jax': 'naive JAX DP-SGD (recompiles)', 'jax_nonprivate': LABELS[name]}.get(
      name, LABELS[name] + ' (masked, static shapes)'
    )
    bars = ax.bar(xs, [v['seconds'] for v in e], width, label=label, color=colors[name])
    ax.bar_label(
      bars,
      [f'{v["seconds"]:.1f} s\n{v["compilations"]["accumulate"]} comp.' for v in e],
      fontsize=7,
    )
  ax.set_xticks(np.arange(len(models)))
  ax.set_xticklabels([m.upper() for m in models])
  ax.set_ylabel('seconds for one epoch, compilation included')
  ax.set_title(f'One epoch of Poisson batches, N={c["num_examples"]:,}')
  ax.set_ylim(top=ax.get_ylim()[1] * 1.2)
  ax.legend(fontsize=7, loc='upper left')
  fig.suptitle(
    f'dpjax {result["git"]["head"][:8]}, jax {result["versions"]["jax"]}'
    f', torch {result["versions"].get("torch")}, opacus '
    f'{result["versions"].get("opacus")}; load avg '
    f'{result["load_average_start"][0]}-{result["load_average_end"][0]}',
    fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=120)


# -----------------------------------------------------------------------------
# Main.
# -----------------------------------------------------------------------------
def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--models', nargs='+', default=list(MODELS), choices=MODELS)
  parser.add_argument(
    '--full', action='store_true', help='N = 60000, 9 repeats, 3 cold epochs (~30 min, estimated)'
  )
  parser.add_argument(
    '--num-examples', type=int, default=None, help='N (default 10000, --full 60000)'
  )
  parser.add_argument('--batch-size', type=int, default=256, help='expected logical batch size b')
  parser.add_argument('--physical-batch-size', type=int, default=64)
  parser.add_argument('--steps-per-repeat', type=int, default=None)
  parser.add_argument('--repeats', type=int, default=None)
  parser.add_argument('--epoch-repeats', type=int, default=None)
  parser.add_argument('--noise-multiplier', type=float, default=1.0)
  parser.add_argument('--clip-norm', type=float, default=1.0)
  parser.add_argument(
    '--threads',
    type=int,
    default=len(os.sched_getaffinity(0)),
    help='cores for both frameworks: the process is pinned '
    'to this many CPUs (XLA sizes its pool from them) and '
    'torch.set_num_threads(threads); default all',
  )
  parser.add_argument(
    '--no-torch', action='store_true', help='skip PyTorch / Opacus (without the bench extra)'
  )
  parser.add_argument('--no-epoch', action='store_true')
  parser.add_argument(
    '--out',
    default=os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'throughput'),
  )
  args = parser.parse_args()
  n = args.num_examples or (60_000 if args.full else 10_000)
  s = args.steps_per_repeat or (10 if args.full else 6)
  repeats = args.repeats or (9 if args.full else 5)
  epoch_repeats = args.epoch_repeats or (3 if args.full else 1)
  for field, v, lo in (
    ('--num-examples', n, 2),
    ('--batch-size', args.batch_size, 1),
    ('--physical-batch-size', args.physical_batch_size, 1),
    ('--steps-per-repeat', s, 1),
    ('--repeats', repeats, 1),
    ('--epoch-repeats', epoch_repeats, 1),
    ('--threads', args.threads, 1),
  ):
    if v < lo:
      raise ValueError(f'{field} must be >= {lo}, got {v}.')
  if not args.batch_size < n:
    raise ValueError(f'--batch-size must be < N = {n}, got {args.batch_size}.')
  cpus = sorted(os.sched_getaffinity(0))
  if args.threads > len(cpus):
    raise ValueError(f'--threads must be <= {len(cpus)} (CPUs available), got {args.threads}.')
  # Before the first JAX computation: XLA's CPU client reads the affinity
  # when it is created.
  os.sched_setaffinity(0, cpus[: args.threads])
  if jax.config.jax_compilation_cache_dir:
    raise ValueError(
      'a persistent XLA compilation cache is set; compile times '
      'would be cache hits. Unset jax_compilation_cache_dir.'
    )

  versions = {'jax': jax.__version__, 'numpy': np.__version__, 'python': platform.python_version()}
  methods = list(JAX_METHODS)
  torch_device_name = None
  if not args.no_torch:
    import opacus
    import torch

    global TORCH_DEVICE
    TORCH_DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
    torch_device_name = (
      torch.cuda.get_device_name(0)
      if TORCH_DEVICE == 'cuda'
      else platform.processor() or platform.machine()
    )
    if TORCH_DEVICE == 'cuda':
      torch.backends.cuda.matmul.allow_tf32 = (
        True  # PyTorch non-private TF32, as issue 14 compares.
      )
      torch.backends.cudnn.allow_tf32 = True
    torch.set_num_threads(args.threads)
    versions.update(
      torch=torch.__version__, opacus=opacus.__version__, torch_threads=torch.get_num_threads()
    )
    methods += list(TORCH_METHODS)
  import warnings

  warnings.filterwarnings('ignore', category=UserWarning)  # Opacus / hooks.

  wl = Workload(n, args.batch_size, args.physical_batch_size)
  if not args.no_epoch and s > wl.steps_per_epoch:
    raise ValueError(
      f'--steps-per-repeat must be <= {wl.steps_per_epoch} (steps per epoch), got {s}.'
    )
  result = {
    'question': 'training examples/s of dpjax DP-SGD vs non-private JAX, '
    'naive recompiling JAX DP-SGD and Opacus, same batches',
    'command': ' '.join(['python', 'scripts/bench_throughput.py', *sys.argv[1:]]),
    'git': _git_state(),
    'versions': versions,
    'backend': jax.default_backend(),
    'device': jax.devices()[0].device_kind,
    'torch_device': TORCH_DEVICE,
    'torch_device_name': torch_device_name,
    'cpu_count': os.cpu_count(),
    'threads': args.threads,
    'machine': platform.machine(),
    'config': {
      'num_examples': n,
      'batch_size': args.batch_size,
      'physical_batch_size': args.physical_batch_size,
      'max_batch_size': wl.batcher.max_batch_size,
      'sampling_probability': wl.sampler.sampling_probability,
      'noise_multiplier': args.noise_multiplier,
      'clip_norm': args.clip_norm,
      'optimizer': f'sgd({LEARNING_RATE})',
      'steps_per_repeat': s,
      'repeats': repeats,
      'epoch_repeats': epoch_repeats,
      'seed': SEED,
      'data': 'dpjax.data.synthetic.SyntheticSource 28x28x1, 10 classes',
    },
    'load_average_start': _load(),
    'models': {},
  }
  print(
    f'N={n} b={args.batch_size} P={args.physical_batch_size} '
    f'B={wl.batcher.max_batch_size} {wl.steps_per_epoch} steps/epoch; '
    f'load {result["load_average_start"]}; {versions}',
    flush=True,
  )
  start = time.perf_counter()
  for name in args.models:
    model, runners = {'load_average_before': _load()}, {}
    if not args.no_epoch:
      model['epoch'], runners = epoch_with_compilation(
        name, wl, epoch_repeats, args.noise_multiplier, args.clip_norm
      )
      model['load_average_after_epoch'] = _load()
    model['steady'] = steady_state(
      name, wl, methods, runners, s, repeats, args.noise_multiplier, args.clip_norm
    )
    model['load_average_after_steady'] = _load()
    model['ratios'] = ratios(model)
    print(name, {k: round(v, 3) for k, v in model['ratios'].items()}, flush=True)
    result['models'][name] = model
  result['load_average_end'] = _load()
  result['wall_seconds'] = time.perf_counter() - start
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out + '.json', 'w') as f:
    json.dump(result, f, indent=1)
  plot(result, args.out + '.png')
  print(f'wrote {args.out}.json and .png ({result["wall_seconds"]:.0f} s)')


if __name__ == '__main__':
  main()
