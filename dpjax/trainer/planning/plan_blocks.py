"""The typed blocks of a run's plan: what the step, the loop and the reports read of a config.

`make_plan` (`dpjax.trainer.planning.plan`) reads the validated config once into these frozen
blocks; below the plan nothing reads the config (tests/test_structure.py checks it):

  Schedule      the periods of the loop's actions and how many checkpoints are kept
  Recipe        what the step computes that does not enter ε (model, loss, clipping method,
                noise generator, precision, augmentation, EMA, the optimiser)
  Finetune      the weights the run starts from and which parameters train
  AuditPlan     the one-run audit's canaries
  DataSettings  the data's source, label format and declared public bound on N

A field a config lacks (an accounting-only config) has its declared default
(`config_fields.FIELDS`), read by `declared`: no default is written twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from dpjax.privacy import augmult as augmult_lib
from dpjax.trainer.configuration import config_fields
from dpjax.trainer.planning import optimizers


def declared(config: ml_collections.ConfigDict, path: str) -> Any:
  """config[path], or the default `config_fields.FIELDS` declares for it when it is absent."""
  return config_fields.get(config, path, config_fields.FIELDS_BY_PATH[path].default)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """How often the loop logs, evaluates and checkpoints (in steps; the last step always
  does all three), and how many checkpoints it keeps."""

  log_every: int
  eval_every: int
  checkpoint_every: int
  keep_checkpoints: int

  @classmethod
  def of(cls, config: ml_collections.ConfigDict) -> Schedule:
    return cls(
      log_every=declared(config, 'log_every_steps'),
      eval_every=declared(config, 'eval_every_steps'),
      checkpoint_every=declared(config, 'checkpoint_every_steps'),
      keep_checkpoints=declared(config, 'keep_checkpoints'),
    )


@dataclasses.dataclass(frozen=True)
class Recipe:
  """What the step computes that does not enter ε (the precision does, through η: the
  privacy plan holds the one it pays for, and `build` checks the two agree)."""

  model_name: str
  loss: str
  clipping: str  # 'auto', 'vmap' or 'ghost' (`clipping.clipped_grad`).
  noise_prng: str  # The JAX generator of the noise (`prng`).
  precision: str
  ema_decay: float
  augmult: augmult_lib.Augmult | None  # None: one view per example.
  optimizer: optimizers.OptimizerSettings

  @classmethod
  def of(cls, config: ml_collections.ConfigDict) -> Recipe:
    augmult = {
      name: declared(config, f'augmult.{name}') for name in ('num_views', 'crop_padding', 'flip')
    }
    return cls(
      model_name=config_fields.get(config, 'model.name', ''),  # Absent to account only.
      loss=declared(config, 'loss'),
      clipping=declared(config, 'privacy.clipping'),
      noise_prng=declared(config, 'privacy.noise_prng'),
      precision=declared(config, 'precision'),
      ema_decay=float(declared(config, 'ema_decay')),
      augmult=augmult_lib.Augmult.of(**augmult),
      optimizer=optimizers.OptimizerSettings.of(
        config_fields.get(config, 'optimizer', ml_collections.ConfigDict())
      ),
    )


@dataclasses.dataclass(frozen=True)
class Finetune:
  """`init_from` (the run or weights it starts from; '' = from scratch), its rules, whether
  its data is declared disjoint from this run's, and what trains (`freeze`, LoRA)."""

  init_from: str
  init_from_rules: tuple
  init_from_disjoint_data: bool
  freeze: tuple
  lora_rank: int
  lora_alpha: float
  lora_targets: tuple

  @classmethod
  def of(cls, config: ml_collections.ConfigDict) -> Finetune:
    return cls(
      init_from=declared(config, 'init_from') or '',
      init_from_rules=tuple(declared(config, 'init_from_rules')),
      init_from_disjoint_data=bool(declared(config, 'init_from_disjoint_data')),
      freeze=tuple(declared(config, 'freeze')),
      lora_rank=int(declared(config, 'lora.rank')),
      lora_alpha=float(declared(config, 'lora.alpha')),
      lora_targets=tuple(declared(config, 'lora.targets')),
    )


@dataclasses.dataclass(frozen=True)
class AuditPlan:
  """The one-run audit (Steinke et al. 2023): m canaries (0 = none), their kind, the
  confidence of its lower bound, whether each checkpoint is audited, and δ (the config's,
  also for a non-private run)."""

  num_canaries: int
  kind: str
  confidence: float
  every_checkpoint: bool
  delta: float

  @classmethod
  def of(cls, config: ml_collections.ConfigDict) -> AuditPlan:
    return cls(
      num_canaries=int(declared(config, 'audit.num_canaries')),
      kind=declared(config, 'audit.kind'),
      confidence=float(declared(config, 'audit.confidence')),
      every_checkpoint=bool(declared(config, 'audit.every_checkpoint')),
      delta=float(declared(config, 'privacy.delta')),
    )


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """The data's source kind, its label format, and N̄, the declared public bound on N
  (0: the exact N is public; `training_set_size`)."""

  source: str
  label_format: str
  public_num_examples: int

  @classmethod
  def of(cls, config: ml_collections.ConfigDict) -> DataSettings:
    return cls(
      source=declared(config, 'data.source'),
      label_format=declared(config, 'data.label_format'),
      public_num_examples=int(declared(config, 'data.public_num_examples') or 0),
    )
