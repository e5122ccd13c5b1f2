"""DP-SGD ViT-S/4 (12 layers, width 384, 4x4 patches: 64 tokens) on CIFAR-10.

The issue-14 benchmark model: a vision transformer whose every layer ghost
clipping covers (patch conv, attention and MLP Dense layers, LayerNorm; the
positional embedding per example). It keeps the WRN recipe's augmentation
multiplicity (K = 16 crops + flips, averaged before the one clipping) and EMA
(0.999) from configs/cifar10_wrn.py. The optimiser settings are a reasonable
start (Adam, b = 4096, σ = 3 for 2468 steps: ε = 6.53 by dpjax's PLD, under the
target 8), not a tuned result: no accuracy is claimed for it. A GPU-sized run; on a CPU
use :runlocal (synthetic 32x32x3 data, a 2-layer width-32 ViT, 2 steps).
Needs CIFAR-10 prepared as in configs/cifar10_wrn.py. Run:
  python -m dpjax.train --config configs/cifar10_vit.py --workdir workdirs/cifar10_vit \\
      --config.data.data_dir=$HOME/tfds
Smoke run (no data needed):
  python -m dpjax.train --config configs/cifar10_vit.py:runlocal --workdir /tmp/vit_smoke
"""

from dpjax import configs
from dpjax.models import factory as models
from dpjax.configs import cifar10_wrn


def get_config(arg: str | None = None):
  c = cifar10_wrn.get_config()  # CIFAR-10 data, Poisson b = 4096, ε = 8.
  c.model = models.default_model_config('vit')  # ViT-S/4: 21.4M parameters on 32x32x3.

  c.optimizer.name = 'adam'
  c.optimizer.learning_rate = 1e-3  # Adam on the noisy mean gradient.
  c.optimizer.momentum = 0.0  # sgd only.
  c.augmult.num_views = 16  # As the WRN recipe (De et al. 2022): K crops + flips per example.
  c.ema_decay = 0.999

  if configs.runlocal(arg):
    c.data.source = 'synthetic'  # Computed from the index: no download.
    c.data.num_examples = 512
    c.data.input_shape = (32, 32, 3)
    c.data.num_classes = 10
    c.num_epochs = 0
    c.num_steps = 2
    c.sampler.batch_size = 32
    c.sampler.physical_batch_size = 16
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.width = 32
    c.model.mlp_dim = 64
    c.eval_every_steps = 2
    c.checkpoint_every_steps = 2
  return c
