"""DP LoRA fine-tuning: a pretrained transformer's base frozen and sharded, its adapters private.

The 8x8 digits (embedded in dpjax, no download) as 8 tokens of 8 pixels. The training split
is cut in two: a *public* half pretrains the transformer without privacy (its examples are
treated as public: they enter no ε), and the *private* half fine-tunes it with DP-SGD. The
fine-tuning trains LoRA adapters (Hu et al. 2022) on the attention query/value and MLP kernels
and the classifier head; everything else is the frozen base. The base is data, not a constant:
the DP step takes it as an argument, placed like parameters over the mesh ('fsdp' splits its
large kernels), and it gets no gradient, no clipping and no noise. Ghost clipping covers the
adapters (`dpjax.privacy.ghost_clipping.lora`), so no per-example gradient is formed.

  python examples/finetune_lora.py            # one device
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/finetune_lora.py
                                              # mesh data=2 x fsdp=4 on 8 CPU devices
  python examples/finetune_lora.py --quick    # fewer steps (the test suite)
"""

import argparse
import secrets

import jax
import numpy as np
import optax

import dpjax
from dpjax.data import digits
from dpjax.models import transformer
from dpjax.privacy import batching
from dpjax.privacy import lora
from dpjax.privacy import param_sharding
from dpjax.privacy import prng
from dpjax.privacy import sharding

P = 32  # Rows per physical batch: a multiple of the mesh's example groups (data x fsdp).


def load():
  """(public x, y), (private x, y), (test x, y): digits as [n, 8 tokens, 8 pixels] in [0, 1]."""
  x_train, y_train, x_test, y_test = digits.load_digits_arrays()
  to_tokens = lambda x: (np.asarray(x, np.float32) / 16.0).reshape(-1, 8, 8)
  half = len(x_train) // 2
  return (
    (to_tokens(x_train[:half]), y_train[:half]),
    (to_tokens(x_train[half:]), y_train[half:]),
    (to_tokens(x_test), y_test),
  )


def pretrain(model, x, y, steps: int):
  """The base: Adam on the public half, no privacy (its examples are public)."""
  params = prng.init_params(model, 0, x.shape[1:])
  tx = optax.adam(3e-3)

  @jax.jit
  def update(params, opt_state, xb, yb):
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
      model.apply({'params': p}, xb), yb
    ).mean()
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state)
    return optax.apply_updates(params, updates), opt_state

  if not steps:
    return params
  opt_state, rng = tx.init(params), np.random.default_rng(0)
  for _ in range(steps):
    rows = rng.integers(0, len(x), 64)
    params, opt_state = update(params, opt_state, x[rows], y[rows])
  return params


def main(quick: bool) -> None:
  (x_pub, y_pub), (x_priv, y_priv), (x_test, y_test) = load()
  # model_dim 128: its kernels (>= 2**14 elements) are split over 'fsdp'. --quick: a smaller
  # model whose base is just initialised (no pretraining to compile), replicated.
  width = 32 if quick else 128
  model = transformer.Transformer(
    num_classes=10,
    max_length=8,
    num_layers=1 if quick else 2,
    num_heads=4,
    model_dim=width,
    mlp_dim=2 * width,
  )
  base = pretrain(model, x_pub, y_pub, 0 if quick else 300)
  head = f'Dense_{2 * model.num_layers + 1}'  # Input projection, 2 MLP kernels a layer, head.
  wrapped, adapters = lora.make_finetune(
    model,
    base,
    freeze=(f'^(?!{head}/)',),  # All but the classifier head ...
    lora_rank=4,  # ... which, with the adapters A [in, 4] and B [4, out], trains.
    lora_alpha=8.0,
    lora_targets=(
      r'Attention_\d/(query|value)/kernel',
      rf'Dense_[1-{2 * model.num_layers}]/kernel',
    ),
    seed=secrets.randbits(63),
  )
  devices = len(jax.devices())
  mesh = sharding.make_mesh(fsdp=4 if devices % 8 == 0 else 1)

  sampler = dpjax.PoissonSampler(
    num_examples=len(x_priv), batch_size=128 if quick else 64, seed=secrets.randbits(63)
  )
  steps = (1 if quick else 10) * sampler.steps_per_epoch
  plan = dpjax.PrivacyPlan.create(
    sampler, num_steps=steps, clip_norm=1.0, target_epsilon=4.0, delta=1e-5,
    physical_batch_size=P,
  )  # fmt: skip
  step = dpjax.DPStep.from_plan(wrapped, optax.adam(1e-2), plan, mesh=mesh)
  frozen = step.keys['frozen']  # The base, placed over the mesh once (an argument).
  placed = jax.tree.map(lambda a: a.sharding, frozen)
  print(
    f'{sharding.layout_name(mesh)}: base {param_sharding.bytes_per_device(frozen, placed):,} '
    f'bytes per device of {sum(a.nbytes for a in jax.tree.leaves(frozen)):,}; trainable '
    f'{sum(a.size for a in jax.tree.leaves(adapters)):,} parameters'
  )

  # Placed on the mesh once (host arrays would make the second call compile again).
  adapters = sharding.replicate(mesh, adapters)
  evaluate = jax.jit(lambda a, f, x: wrapped.apply({'params': a, 'frozen': f}, x))
  before = np.argmax(np.asarray(evaluate(adapters, frozen, x_test)), -1)  # B = 0: the base.
  opt_state = sharding.replicate(mesh, step.init_opt_state(adapters))
  batcher = batching.Batcher(plan.sampler, P, plan.max_batch_size)  # B: the plan's cap.
  k_max = batcher.max_physical_batches
  for t in range(steps):  # Steps t = 0..T-1, each once (the step refuses a repeat).
    batch = batcher.logical_batch(t)
    k = batch.num_physical_batches
    idx = np.zeros((k_max, P), np.int64)
    weight = np.zeros((k_max, P), np.float32)
    idx[:k], weight[:k] = batch.indices, batch.weights
    logical = {'x': x_priv[idx], 'y': y_priv[idx], 'weight': weight}
    adapters, opt_state, _ = step.train_step(
      adapters, opt_state, logical, np.int32(k), np.uint32(t)
    )

  after = np.argmax(np.asarray(evaluate(adapters, frozen, x_test)), -1)
  print(
    f'{steps} DP steps: test accuracy {np.mean(after == y_test):.3f} '
    f'(the public base alone: {np.mean(before == y_test):.3f})'
  )
  report = plan.epsilon_at(steps)
  print(
    f'ε = {report.epsilon:.3f} ({report.bound} bound, {report.accountant}), δ = {report.delta:g}'
  )


if __name__ == '__main__':
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='a few steps (for the tests)')
  main(parser.parse_args().quick)
