"""The trainer: the only layer, with the entry points above it, that reads a config.

  configuration/  every config field, declared once (`config_fields`, one module per block)
  planning/       the config resolved once into a typed `RunPlan`: σ, the sampler, the fingerprint
  loop/           what a run computes from its plan, the loop, its reports and metrics
  workdir/        what a run leaves on disk: checkpoints, the lock, the seed, atomic writes
  commands/       what every `python -m dpjax.*` command shares: one-line errors, signals

`from dpjax.trainer import config_fields` (the idiom of config files) still works.
"""

import importlib


def __getattr__(name: str):
  if name == 'config_fields':
    return importlib.import_module('dpjax.trainer.configuration.config_fields')
  raise AttributeError(f'module {__name__} has no attribute {name!r}')
