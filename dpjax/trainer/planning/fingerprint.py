"""The privacy fingerprint of a run: everything that enters ε, compared on resume.

`run_fingerprint` lists the private flag, the sampler and its accounting parameters (N or
its declared public bound, b, the resolved cap B, the group size), σ as used, C, δ, the
resolved accountant, η (the float rounding ε pays for) with its matmul format, the runs `init_from` starts from and whether their data is declared
disjoint, the digest of the weights `init_from` names (a resume from other weights is
refused), the SHA-256 of the seed, the audit canaries and the dataset's identity
(`dataset_identity`: source, split, N and a digest of its content, `dpjax.data.identity`).
Settings that cannot change ε (`dpjax.trainer.configuration.perf.Perf`) are not among its inputs.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any

import ml_collections

from dpjax.data import identity as data_identity
from dpjax.privacy import mechanisms
from dpjax.privacy import privacy_plan
from dpjax.privacy import rounding as rounding_lib
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import composition
from dpjax.trainer.planning import plan_blocks

# The digest of the weights `init_from` names (`stored_params.sha256`), when it is set.
INIT_WEIGHTS_FIELD = 'init_from.weights_sha256'
FINGERPRINT_VERSION = 3  # 2: the seed as its SHA-256, the data by its content; 3: η.
# The dataset's part of the fingerprint: its content, not where it lives (a copy resumes).
DATASET_FIELDS = ('source', 'split', 'num_examples', 'content_sha256')


def run_fingerprint(
  sampler,
  max_batch_size: int,
  privacy,
  dataset,
  audit: plan_blocks.AuditPlan,
  finetune: plan_blocks.Finetune,
  public_num_examples: int,
  init_weights_sha256: str | None = None,
) -> dict[str, Any]:
  """The privacy fingerprint: the privacy plan's fields, the private flag, the starting
  weights' digest, audit and data (N̄ = `public_num_examples`, 0 when N is public)."""
  dataset = dataset or {}
  canaries = audit.num_canaries
  if privacy is not None:
    fields = privacy.fingerprint
  else:
    fields = {
      'sampler.name': sampler.name,
      'sampler.num_examples': sampler.num_examples,
      'sampler.batch_size': sampler.batch_size,
      'sampler.max_batch_size': max_batch_size,
      **sampler.own_values(),
      'privacy.group_size': None,
      'privacy.noise_multiplier': None,
      'privacy.clip_norm': None,
      'privacy.delta': None,
      'privacy.accountant': None,
      'privacy.matmul_format': None,
      'privacy.rounding_eta': None,
      'seed_sha256': privacy_plan.seed_digest(sampler.seed),
    }
  init = {
    'init_from_disjoint_data': finetune.init_from_disjoint_data,
    INIT_WEIGHTS_FIELD: init_weights_sha256,
  }
  return {
    'fingerprint_version': FINGERPRINT_VERSION,
    'privacy.enabled': privacy is not None,
    **fields,
    # Whether the starting weights' runs are composed (present when init_from is set).
    **(init if finetune.init_from else {}),
    # Audit canaries change the data (N + m rows) and what each canary contributes.
    'audit.num_canaries': canaries,
    'audit.kind': audit.kind if canaries else None,
    **{f'data.{key}': dataset.get(key) for key in DATASET_FIELDS},
    # A declared public bound on N (sampler.num_examples then holds it); absent when the
    # exact N is public, as in checkpoints written before the field existed.
    **({'data.public_num_examples': public_num_examples} if public_num_examples else {}),
  }


def dataset_identity(
  data_config: ml_collections.ConfigDict, source, key: bytes = b''
) -> dict[str, Any]:
  """Source, name, location, split, N and a digest of a train split's content (features, labels).

  The digest is `data_identity.content_identity(source, key=key)`: a SHA-256 over every
  example for in-memory data (and for files up to its full-read limit), else file sizes,
  modification times and a keyed sample of rows (`key` is derived from the run's secret seed).
  `location` (the TFDS name and data_dir, the file's real path) is kept in the checkpoint's
  metadata, not in the fingerprint: the same content elsewhere resumes.
  """
  identity = data_identity.content_identity(source, key=key)
  kind = data_config.source
  path = str(data_config.get('path', '') or '')
  name = {'tfds': data_config.name, 'digits': 'sklearn digits'}.get(
    kind, path.rstrip('/').rsplit('/', 1)[-1] or kind
  )
  location = {
    'tfds': f'{data_config.name}@{os.path.realpath(data_config.data_dir or ".")}',
    'npz': os.path.realpath(path) if path else '',
    'memmap': os.path.realpath(path) if path else '',
  }.get(kind, kind)
  split = data_config.train_split if kind in ('tfds', 'memmap') else 'train'
  return {
    'source': kind,
    'name': name,
    'location': location,
    'split': split,
    'num_examples': len(source),
    'content_sha256': identity['sha256'],
    'content_method': identity['method'],
  }


def data_key(seed: int) -> bytes:
  """The key of the dataset identity's row sample: a function of the secret seed."""
  return hashlib.sha256(f'dpjax-data-key:{int(seed)}'.encode()).digest()


def fingerprint_changes(previous: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """'field: old → new' for every fingerprint field that differs (the seed by name only)."""
  changes = []
  for key in sorted(set(previous) | set(current)):
    old, new = previous.get(key, '<absent>'), current.get(key, '<absent>')
    if old != new and not (
      _is_float(old) and _is_float(new) and math.isclose(old, new, rel_tol=1e-12)
    ):
      if key == 'seed_sha256':
        changes.append(
          'seed: another seed than the run being resumed (a given seed differs, '
          "or the workdir's private/seed.json is missing or was changed)"
        )
      else:
        changes.append(f'{key}: {old!r} → {new!r}')
  return changes


def _is_float(x) -> bool:
  return isinstance(x, float)


class PendingFields:
  """The fingerprint fields of a privacy plan before σ is calibrated (for the resume check);
  `options`: its `AccountingOptions` (the noise and its strategy)."""

  def __init__(
    self, sampler, max_batch_size, privacy, sigma, precision: str, options, prior_runs=()
  ):
    prior = {composition.FINGERPRINT_FIELD: [r.fingerprint for r in prior_runs]}
    rounding = rounding_lib.Rounding.of(max_batch_size, precision)
    self.fingerprint = {
      **(prior if prior_runs else {}),
      'sampler.name': sampler.name,
      'sampler.num_examples': sampler.num_examples,
      'sampler.batch_size': sampler.batch_size,
      'sampler.max_batch_size': max_batch_size,
      **sampler.own_values(),
      'privacy.group_size': privacy.group_size,
      'privacy.noise_multiplier': None if sigma is None else float(sigma),
      'privacy.clip_norm': float(privacy.clip_norm),
      'privacy.delta': float(privacy.delta),
      'privacy.accountant': accountant_lib.resolve_accountant(
        sampler.name, privacy.accountant, privacy.group_size
      ),
      'privacy.matmul_format': rounding.matmul_format,
      'privacy.rounding_eta': rounding.eta,
      'seed_sha256': privacy_plan.seed_digest(sampler.seed),
      **mechanisms.fingerprint(options.noise, options.strategy),
    }
