"""The privacy block of a training config: C, σ or a target ε, δ, the accountant, the noise."""

from dpjax.privacy import clipping
from dpjax.privacy import names
from dpjax.privacy import prng
from dpjax.privacy.accounting import accountant
from dpjax.trainer.configuration.field_spec import Field

NON_PRIVATE_HINT = 'To train without privacy, set privacy.enabled=False.'


def is_private(config) -> bool:
  """privacy.enabled: the fields that configure the mechanism are checked only then."""
  return bool(config.privacy.enabled)


FIELDS: tuple[Field, ...] = (
  Field(
    'privacy.enabled',
    'bool',
    True,
    'False: the non-private baseline through the same pipeline',
    accounting=True,
  ),
  Field(
    'privacy.clip_norm',
    'float',
    1.0,
    'C, the per-example clip norm',
    0,
    low_open=True,
    when=is_private,
    accounting=True,
    hint=NON_PRIVATE_HINT,
  ),
  Field(
    'privacy.noise_multiplier',
    'float',
    None,
    'σ; None = calibrate it to privacy.target_epsilon',
    0,
    low_open=True,
    optional=True,
    when=is_private,
    accounting=True,
    hint=NON_PRIVATE_HINT,
  ),
  Field(
    'privacy.target_epsilon',
    'float',
    3.0,
    'the ε budget at the last step; 0 = none. σ '
    'None: calibrated to meet it; σ set: a run that would exceed it is refused',
    0,
    when=is_private,
    accounting=True,
  ),
  Field(
    'privacy.delta',
    'float',
    1e-5,
    'δ; must be < 1/N (a warning above 1/(10·N))',
    0,
    1,
    low_open=True,
    high_open=True,
    when=is_private,
    accounting=True,
  ),
  Field(
    'privacy.allow_large_delta',
    'bool',
    False,
    'accept δ >= 1/N (a weak guarantee)',
    when=is_private,
  ),
  Field(
    'privacy.accountant',
    'str',
    'auto',
    'auto | pld | rdp | monte_carlo',
    choices=accountant.ACCOUNTANTS,
    when=is_private,
    accounting=True,
  ),
  Field(
    'privacy.group_size',
    'int',
    1,
    'k: the guarantee is for groups of k examples',
    1,
    when=is_private,
    accounting=True,
  ),
  Field(
    'privacy.noise',
    'str',
    'gaussian',
    'the noise mechanism: gaussian (DP-SGD, independent each step) | bandmf (banded matrix '
    'factorisation: noise correlated across privacy.num_bands steps; amplified with sampler '
    'cyclic_poisson and sampler.num_groups >= privacy.num_bands, else accounted by its '
    'sensitivity with deterministic or shuffle) | blt (buffered linear Toeplitz, '
    'privacy.num_buffers buffers; deterministic, shuffle or cyclic_poisson, by its sensitivity)',
    choices=names.NOISES,
    when=is_private,
    accounting=True,
  ),
  Field(
    'privacy.num_bands',
    'int',
    1,
    "bandmf: the bands b of the strategy, optimised for the run's steps (its state: b - 1 "
    'copies of the parameters); 1 = DP-SGD',
    1,
    when=is_private,
    accounting=True,
  ),
  Field(
    'privacy.num_buffers',
    'int',
    2,
    "blt: the buffers d of the strategy, optimised for the run's steps (its state: d copies "
    'of the parameters)',
    1,
    when=is_private,
    accounting=True,
  ),
  Field(
    'privacy.monte_carlo_workers',
    'int',
    None,
    'processes drawing the balls-and-bins '
    'Monte-Carlo samples; None = the available cores, as many as the samples pay to start '
    '(the estimate does not depend on it)',
    1,
    optional=True,
    when=is_private,
  ),
  Field(
    'privacy.random_allocation_timeout',
    'float',
    300.0,
    'seconds for the provable '
    'balls-and-bins bound (cached on disk); past it the deterministic bound, labelled',
    0,
    low_open=True,
    when=is_private,
  ),
  Field(
    'privacy.noise_prng',
    'str',
    'threefry',
    'the JAX generator of the noise: threefry '
    '(reproducible everywhere) | rbg | unsafe_rbg (faster; none is a cryptographic '
    'sampler; docs/threat_model.md)',
    choices=tuple(prng.NOISE_IMPLS),
  ),
  Field(
    'privacy.clipping',
    'str',
    'auto',
    'how per-example norms are computed: auto (ghost '
    'where it covers every parameter, else vmap) | vmap | ghost',
    choices=clipping.CLIPPING_METHODS,
  ),
)
