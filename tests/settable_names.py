"""What a trainer user can set, and `unsettable_names`: what else a message names as if it were.

A refusal of the trainer (or of a command reading a config) must name what the user can change:
a declared config field (`dpjax.trainer.configuration.config_fields`, with the fields of every model family)
or a flag. It must not name a setting only a library caller has (an argument of
`dpjax.Accountant`, `PrivacyPlan.create` or `calibrate_noise_multiplier` that is no config
field, e.g. `max_grid_points`), nor suggest a field that does not exist.
"""

import dataclasses
import inspect
import re

from dpjax.models import factory
from dpjax.privacy import privacy_plan
from dpjax.privacy.accounting import accountant
from dpjax.privacy.accounting import calibration
from dpjax.privacy.accounting import options
from dpjax.trainer.configuration import config_fields
from dpjax.trainer.planning import fingerprint

DECLARED = set(config_fields.declared_paths()) | {
  f'model.{path}'
  for name in factory.MODEL_NAMES
  for path in config_fields.field_paths(factory.default_model_config(name))
}
# Names of the privacy fingerprint that are no field (a resume's "Changed: ..." lists them).
LABELS = {'sampler.num_examples'} | {f'data.{key}' for key in fingerprint.DATASET_FIELDS}
FILE_SUFFIXES = {'json', 'jsonl', 'npz', 'npy', 'md', 'py'}  # audit.json is a file.
GROUPS = sorted({path.split('.')[0] for path in DECLARED if '.' in path})
# A dotted name that starts with a config group and is not part of a longer dotted name.
PATH = re.compile(r'(?<![\w./-])(?:%s)\.[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*' % '|'.join(GROUPS))
_LEAVES = {path.rsplit('.', 1)[-1] for path in DECLARED}
_LIBRARY_SETTINGS = {
  name
  for function in (
    accountant.Accountant.__init__,
    privacy_plan.PrivacyPlan.create,
    calibration.calibrate_noise_multiplier,
  )
  for name in inspect.signature(function).parameters
} | {field.name for field in dataclasses.fields(options.AccountingOptions)}
LIBRARY_ONLY = sorted(name for name in _LIBRARY_SETTINGS - _LEAVES if '_' in name)


def unsettable_names(message: str, given: str = '') -> list[str]:
  """The config paths in `message` that are no declared field (nor a fingerprint label), and
  the library-only settings it names; a name quoted from the bad input (`given`, e.g. the
  config file's text or the command line) is what the user wrote, not a suggestion."""
  text = re.sub(r'(?<![\w.])(?:--)?config\.', ' ', message)  # --config.x.y and config.x.y.
  bad = [
    path
    for path in (m.group(0).rstrip('.') for m in PATH.finditer(text))
    if path not in DECLARED | LABELS
    and path.rsplit('.', 1)[-1] not in FILE_SUFFIXES
    and not any(known.startswith(path + '.') for known in DECLARED)
  ]
  bad += [name for name in LIBRARY_ONLY if re.search(rf'\b{name}\b', message)]
  return [name for name in bad if name not in given]
