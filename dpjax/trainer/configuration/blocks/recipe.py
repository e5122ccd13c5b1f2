"""The recipe fields of a training config: augmentation multiplicity, EMA, fine-tuning, LoRA.

All post-processing of the noised gradients or public inputs: none enters ε (an init_from
trained by dpjax has its privacy loss composed in by the plan).
"""

from dpjax.trainer.configuration.field_spec import Field

FIELDS: tuple[Field, ...] = (
  Field(
    'augmult.num_views',
    'int',
    0,
    'K views per example, the gradient averaged over them '
    'before the one clipping (De et al. 2022); 0 or 1 = off',
    0,
  ),
  Field(
    'augmult.crop_padding', 'int', 0, 'images: reflect padding of the random crop; 0 = no crop', 0
  ),
  Field('augmult.flip', 'bool', False, 'images: random horizontal flip'),
  Field(
    'ema_decay',
    'float',
    0.0,
    'EMA of the parameters, decay min(d, (1+t)/(10+t)); 0 = off',
    0,
    1,
    high_open=True,
  ),
  Field(
    'init_from',
    'text',
    '',
    "pretrained params: an .npz ('/'-joined keys; assumed public "
    'unless a dpjax privacy card is inside or beside it), a dpjax export, a dpjax workdir '
    "or a checkpoint step directory, whose runs' privacy loss is composed into this run's "
    'ε; "" = the initialisation',
  ),
  Field(
    'init_from_rules',
    'pairs',
    (),
    "(regex, replacement) pairs renaming the file's keys; '' drops one",
  ),
  Field(
    'init_from_disjoint_data',
    'bool',
    False,
    "True declares that this run's data shares no "
    "individual with the dpjax run(s) init_from comes from: ε is then this run's alone; "
    "False composes their privacy loss with this run's",
  ),
  Field(
    'freeze',
    'texts',
    (),
    "regexes on '/'-joined parameter paths: frozen (no gradient, noise or clip cost)",
  ),
  Field('lora.rank', 'int', 0, 'r: LoRA adapters W + (alpha/r)·A·B on lora.targets; 0 = off', 0),
  Field('lora.alpha', 'float', 1.0, 'alpha > 0', 0, low_open=True),
  Field(
    'lora.targets',
    'texts',
    (),
    'regexes on kernel paths (Dense, Conv, attention); their W is frozen',
  ),
)
