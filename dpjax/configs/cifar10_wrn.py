"""DP-SGD WideResNet-16-4 with GroupNorm on CIFAR-10 at ε <= 8 (De et al. 2022).

Source: De, Berrada, Hayes, Smith, Balle 2022, "Unlocking High-Accuracy
Differentially Private Image Classification through Scale" (arXiv 2204.13650),
the CIFAR-10 WRN-16-4 recipe: b = 4096 (Poisson), C = 1, SGD without momentum,
augmentation multiplicity K = 16 (crop with 4-pixel reflect padding + flip,
gradient averaged over views before the one clipping), EMA of the parameters,
weight standardisation + GroupNorm(16), δ = 1e-5. Expected test accuracy:
≈ 79.5% for WRN-16-4 at ε = 8 (81.4% for WRN-40-4, the paper's headline).

What was checked and what was not. The paper's hyper-parameter table could not
be read from this machine (no network; the reference search held its abstract
and jax_privacy's configs, not the table). jax_privacy's CIFAR-10 WRN-16-4
ε = 1 config was checked: σ = 10, 875 updates, b = 4096, K = 16, lr 2, EMA
0.999; dp_accounting's RDP accountant gives ε = 0.988 there, so its updates
were set by RDP to meet the target. The ε = 8 row used here (σ = 3, 2468
updates, lr 4) is from memory of the same table and is NOT verified: at these
settings RDP gives ε = 7.05 and dpjax's PLD 6.53, below 8. dpjax reports its
own PLD upper bound for what runs, so the run is honest either way; to spend
exactly ε = 8 set privacy.noise_multiplier = 0 and keep target_epsilon = 8
(dpjax calibrates σ for 2468 steps), or raise num_steps.

augmult and EMA run inside dpjax.train (K views made on the device in the
compiled step; vmap and ghost clipping both clip the view mean once). This is
a GPU-sized run (K = 16 multiplies the per-step compute by 16); on a CPU use
:runlocal. Needs CIFAR-10 prepared as TFDS ArrayRecord files:
  tfds build cifar10 --data_dir ~/tfds --file_format=array_record

Run:
  python -m dpjax.train --config configs/cifar10_wrn.py --workdir workdirs/cifar10_wrn \\
      --config.data.data_dir=$HOME/tfds
Smoke run (no data needed):
  python -m dpjax.train --config configs/cifar10_wrn.py:runlocal --workdir /tmp/wrn_smoke
"""

from dpjax.trainer.configuration import config_fields
from dpjax import configs
from dpjax.models import factory as models


def get_config(arg: str | None = None):
  c = config_fields.default_config()
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
  c.privacy.noise_multiplier = 3.0  # σ of the paper. dpjax PLD: ε = 6.53 (RDP 7.05) <= 8.
  c.privacy.target_epsilon = 8.0

  c.model = models.default_model_config('wrn')  # WRN-16-4, GroupNorm(16), weight standardisation.

  c.optimizer.name = 'sgd'
  c.optimizer.learning_rate = 4.0
  c.optimizer.momentum = 0.0  # De et al. use plain SGD.

  c.augmult.num_views = 16  # De et al.: K = 16 views, gradient averaged before clipping.
  c.augmult.crop_padding = 4
  c.augmult.flip = True
  c.ema_decay = 0.999  # Polyak/EMA averaging of the parameters (evaluated beside the raw ones).

  c.num_epochs = 0
  c.num_steps = 2468  # De et al.'s updates at ε = 8 (≈ 202 epochs at q = 4096/50000).
  c.log_every_steps = 10
  c.eval_every_steps = 250
  c.checkpoint_every_steps = 250
  if configs.runlocal(arg):  # A CPU smoke run on synthetic 32x32x3 data (no download).
    c.data.source = 'synthetic'
    c.data.num_examples = 512
    c.data.input_shape = (32, 32, 3)
    c.data.num_classes = 10
    c.num_steps = 2
    c.augmult.num_views = 2
    c.sampler.batch_size = 32
    c.sampler.physical_batch_size = 16
    c.model.width = 1
  return c
