"""Small training configs and workdir digests shared by the end-to-end tests."""

import hashlib
import os

from dpjax.configs import digits_mlp


def small_config(**overrides):
  """configs/digits_mlp.py as a 6-step run with a given σ = 1 (no calibration), b = 128, P = 32.

  The seed is fixed (0) so that tests can compare two runs bit for bit; a real run draws a
  secret one (seed None: tests/trainer/test_run_seed.py). `overrides` are dotted paths, e.g.
  small_config(**{'privacy.enabled': False}).
  """
  config = digits_mlp.get_config()
  config.seed = 0
  config.num_epochs = 0
  config.num_steps = 6
  config.sampler.batch_size = 128
  config.sampler.physical_batch_size = 32
  config.privacy.target_epsilon = 0.0
  config.privacy.noise_multiplier = 1.0
  config.log_every_steps = 2
  config.eval_every_steps = 3
  config.checkpoint_every_steps = 2
  config.update_from_flattened_dict(overrides)
  return config


def tree_digest(root) -> dict[str, str]:
  """SHA-256 of every file under root by relative path, directories listed as 'dir'."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames:
      out[os.path.relpath(os.path.join(dirpath, name), root) + '/'] = 'dir'
    for name in filenames:
      path = os.path.join(dirpath, name)
      with open(path, 'rb') as f:
        out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
  return out
