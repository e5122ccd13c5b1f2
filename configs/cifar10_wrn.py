"""DP-SGD WideResNet-16-4 with GroupNorm on CIFAR-10 (De et al. 2022).

Large batches with many epochs are what makes DP-SGD work here (De et al.:
b = 4096, σ ≈ 3, ε = 8). This is a GPU-sized run; on a CPU use :runlocal.
Needs CIFAR-10 prepared as TFDS ArrayRecord files:
  tfds build cifar10 --data_dir ~/tfds --file_format=array_record

Run:
  python -m dpjax.train --config configs/cifar10_wrn.py --workdir workdirs/cifar10_wrn \\
      --config.data.data_dir=$HOME/tfds
"""

from configs import digits_mlp
from dpjax import models


def get_config(arg: str | None = None):
  c = digits_mlp.get_config()
  c.data.source = 'tfds'
  c.data.name = 'cifar10'
  c.data.data_dir = ''  # Set on the command line: --config.data.data_dir=...
  c.data.scale = 255.0
  c.data.mean = (0.4914, 0.4822, 0.4465)  # Public CIFAR-10 channel statistics.
  c.data.std = (0.2470, 0.2435, 0.2616)

  c.sampler.name = 'poisson'
  c.sampler.batch_size = 4096  # De et al. 2022.
  c.sampler.physical_batch_size = 256

  c.privacy.clip_norm = 1.0
  c.privacy.target_epsilon = 8.0

  c.model = models.default_model_config('wrn')  # WRN-16-4, GroupNorm(16), weight standardisation.

  c.optimizer.name = 'sgd'
  c.optimizer.learning_rate = 4.0
  c.optimizer.momentum = 0.0  # De et al. use plain SGD.

  c.num_epochs = 875  # ≈ 2500 steps at b = 4096 (De et al.: 875 epochs for ε = 8).
  c.log_every_steps = 10
  c.eval_every_steps = 250
  c.checkpoint_every_steps = 250
  if arg == 'runlocal':
    c.num_epochs = 0
    c.num_steps = 2
    c.sampler.batch_size = 32
    c.sampler.physical_batch_size = 16
    c.model.width = 1
  return c
