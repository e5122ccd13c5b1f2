"""The config of an existing run, read from its workdir's config.json (resume with --workdir alone).

  python -m dpjax.train --workdir w                       # resumes w with the config it ran
  python -m dpjax.train --workdir w --config.num_steps=500   # ... extended

`dpjax.train` uses this file as `--config` when none is given; its argument is the workdir.
The values are laid over `config_fields.default_config()` (and the model's declared block), so
every field keeps its type and a field config.json lacks keeps its default.
"""

import json
import os

import ml_collections

from dpjax.trainer.configuration import config_fields
from dpjax.models import factory as models


def _merge(node: ml_collections.ConfigDict, values: dict, prefix: str) -> None:
  for key, value in values.items():
    if isinstance(value, dict) and isinstance(node.get(key), ml_collections.ConfigDict):
      _merge(node[key], value, f'{prefix}{key}.')
      continue
    if isinstance(value, list):  # JSON has no tuples.
      value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
    if key in node:
      with node.ignore_type():
        node[key] = value
    else:
      node[key] = value  # Not declared: config_fields.validate names it.


def get_config(workdir: str | None = None) -> ml_collections.ConfigDict:
  if not workdir:
    raise ValueError('from_workdir needs the workdir as its argument (path:workdir).')
  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    raise ValueError(f'{path} does not exist: give --config (this workdir holds no run to resume).')
  with open(path) as f:
    values = json.load(f)
  config = config_fields.default_config()
  name = values.get('model', {}).get('name', config_fields.DEFAULT_MODEL)
  if name in models.MODEL_NAMES:
    config.model = models.default_model_config(name)
  _merge(config, values, '')
  return config
