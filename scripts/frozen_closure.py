"""What `jax.jit` does with a closed-over array: why a fine-tuned model's frozen base is an argument.

On 8 forced CPU devices, a 1024x256 float32 array (1 MiB) split over an 'fsdp' axis of 8 is
used by `x @ w` three ways: closed over (sharded, and as NumPy), and passed as an argument.
For each: the lowered program's text size, its inputs' shardings and XLA's memory analysis
(argument bytes per device). Then the same for the DP step of a LoRA-fine-tuned transformer
(`dpjax.privacy.lora`): whether its base's values appear in the step's program.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/frozen_closure.py

Writes scripts/results/frozen_closure.json (seconds on 2 cores).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import optax  # pylint: disable=wrong-import-position

from dpjax.models import transformer  # pylint: disable=wrong-import-position
from dpjax.privacy import dp_step  # pylint: disable=wrong-import-position
from dpjax.privacy import lora  # pylint: disable=wrong-import-position
from dpjax.privacy import losses  # pylint: disable=wrong-import-position
from dpjax.privacy import noise  # pylint: disable=wrong-import-position
from dpjax.privacy import prng  # pylint: disable=wrong-import-position
from dpjax.privacy import sharding  # pylint: disable=wrong-import-position

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'frozen_closure.json')


def toy() -> dict:
  """x @ w with w closed over or passed, on a mesh ('fsdp',) of every device."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('fsdp',))
  host = np.arange(1024 * 256, dtype=np.float32).reshape(1024, 256)
  w = jax.device_put(host, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('fsdp')))
  x = jnp.ones((4, 1024))
  out = {'array_bytes': host.nbytes, 'devices': len(jax.devices())}
  for name, fn, args in (
    ('closure_sharded', jax.jit(lambda x: x @ w), (x,)),
    ('closure_numpy', jax.jit(lambda x: x @ jnp.asarray(host)), (x,)),
    ('argument_sharded', jax.jit(lambda x, w: x @ w), (x, w)),
  ):
    lowered = fn.lower(*args)
    compiled = lowered.compile()
    out[name] = {
      'hlo_text_chars': len(lowered.as_text()),
      'input_shardings': [str(s) for s in jax.tree.leaves(compiled.input_shardings)],
      'argument_bytes_per_device': compiled.memory_analysis().argument_size_in_bytes,
    }
  return out


def lora_step() -> dict:
  """The library tier's LoRA step on a (data, fsdp) mesh: its base's bytes in the program."""
  fsdp = 4 if len(jax.devices()) % 4 == 0 else 1
  mesh = sharding.make_mesh(fsdp=fsdp)
  model = transformer.Transformer(
    num_classes=10, max_length=8, num_layers=2, num_heads=4, model_dim=128, mlp_dim=512
  )
  params = prng.init_params(model, 0, (8, 8))
  wrapped, trainable = lora.make_finetune(
    model, params, lora_rank=4, lora_alpha=8.0, lora_targets=('query|value', 'Dense_[12]')
  )
  privatizer = noise.GaussianPrivatizer.gaussian(1.0, 1.0, 8.0, 0)
  p = 8 * len(jax.devices())
  logical = {
    'x': np.zeros((1, p, 8, 8), np.float32),
    'y': np.zeros((1, p), np.int32),
    'weight': np.ones((1, p), np.float32),
  }
  size = lambda tree: int(sum(np.size(v) * 4 for v in jax.tree.leaves(tree)))
  out = {'mesh': sharding.layout_name(mesh), 'trainable_bytes': size(trainable)}
  for name, step in (
    ('argument', dp_step.DPStep.for_model(
      wrapped, optax.adam(1e-3), clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8.0,
      mesh=mesh,
    )),
    ('closure', dp_step.DPStep(  # The loss closes over the model's own base.
      losses.make_loss_fn(wrapped), optax.adam(1e-3), privatizer, has_aux=True,
      options=dp_step.StepOptions(mesh=mesh),
    )),
  ):  # fmt: skip
    state = step.init_opt_state(trainable)
    lowered = step._train_step.lower(trainable, state, logical, 1, 0, None, step.keys)  # pylint: disable=protected-access
    analysis = lowered.compile().memory_analysis()
    out[name] = {
      'hlo_text_chars': len(lowered.as_text()),
      'argument_bytes_per_device': analysis.argument_size_in_bytes,
      'base_in_arguments': 'frozen' in step.keys,
    }
    if 'frozen' in step.keys:
      out['base_bytes'] = size(step.keys['frozen'])
      out['base_shardings'] = sorted(
        {str(a.sharding.spec) for a in jax.tree.leaves(step.keys['frozen'])}
      )
  return out


def main() -> None:
  result = {'jax': jax.__version__, 'toy': toy(), 'lora_step': lora_step()}
  os.makedirs(os.path.dirname(PATH), exist_ok=True)
  with open(PATH, 'w') as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1))


if __name__ == '__main__':
  main()
