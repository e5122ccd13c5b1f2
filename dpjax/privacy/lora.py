"""Fine-tuning a pretrained parameter tree: a frozen subset and LoRA adapters.

Freezing (regexes searched in the '/'-joined parameter paths) and LoRA (Hu et al. 2022,
"LoRA: Low-Rank Adaptation of Large Language Models"; rank r, α, target regexes on kernel
paths) partition the parameters into trainable ones and frozen ones:

  W' = W_frozen + s · A · B,   s = α / r,   A ∈ R^{in × r} ~ N(0, 1/in),   B ∈ R^{r × out} = 0,

for each targeted kernel viewed as an [in, out] matrix (Dense [in, out] and Conv
[kh, kw, in, out] → [kh·kw·in, out]; attention query/key/value [in, heads, head_dim] →
[in, heads·head_dim]; attention 'out' [heads, head_dim, out] → [heads·head_dim, out]).
B = 0 makes the first forward pass that of the pretrained model.

`FineTuneModel.apply({'params': trainable, 'frozen': base}, x)` runs the model on trainable
∪ base with the LoRA products merged in. The base is data, not a constant: passed as an
argument, it is an input of the compiled program, placed like parameters over a mesh
(`frozen_shardings`; a jax.Array closed over by `jax.jit` is embedded in the program as an
HLO constant on one device instead: scripts/frozen_closure.py measures it). Without
'frozen' the model's own copy is used (small models, eager use). Everything private sees the
trainable tree alone: per-example gradients, their norms, the clipping and the noise. The
base gets no gradient, no noise and no share of the clip norm; it is public when the
pretrained weights are, else its privacy loss composes with this run's (the trainer's
`init_source`).

Ghost clipping covers LoRA targets of Dense and DenseGeneral layers
(`ghost_clipping.lora`): while `apply` runs, `scale_of(module path)` gives each targeted
layer's s, which the coverage analysis records with the layer call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import contextlib
import math
import re
from typing import Any

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from dpjax.privacy import param_sharding
from dpjax.privacy import prng
from dpjax.privacy.random_streams import Stream

Params = Any
LORA_A, LORA_B = '_lora_a', '_lora_b'  # Suffixes of the adapters beside their kernel's name.
_active_scales: list[dict[tuple[str, ...], float]] = []  # Set while `FineTuneModel.apply` runs.


def flatten(params: Params) -> dict[str, Any]:
  """{'Dense_0/kernel': array, ...}: '/'-joined parameter paths."""
  return traverse_util.flatten_dict(params, sep='/')


def unflatten(flat: dict[str, Any]) -> Params:
  return traverse_util.unflatten_dict(flat, sep='/')


def scale_of(module_path: Sequence[str]) -> float | None:
  """s = α/r of the LoRA-adapted layer at `module_path` of the model being applied now (None:
  not adapted, or outside `FineTuneModel.apply`). Read at trace time by ghost clipping."""
  return _active_scales[-1].get(tuple(module_path)) if _active_scales else None


@contextlib.contextmanager
def _scales(table: dict[tuple[str, ...], float]) -> Iterator[None]:
  _active_scales.append(table)
  try:
    yield
  finally:
    _active_scales.pop()


def _listing(items: Sequence[str], limit: int = 8) -> str:
  shown = ', '.join(items[:limit])
  return shown + (f' and {len(items) - limit} more' if len(items) > limit else '')


def _matching(field: str, patterns: Sequence[str], paths: Sequence[str]) -> set[str]:
  """Paths some pattern matches (re.search); ValueError for a pattern matching none."""
  if isinstance(patterns, str):
    raise ValueError(f'{field} = {patterns!r}: must be a tuple of regexes, not a string.')
  hits = set()
  for p in patterns:
    try:
      pattern = re.compile(p)
    except (re.error, TypeError) as e:
      raise ValueError(f'{field} regex {p!r}: invalid ({e}).') from None
    matched = {q for q in paths if pattern.search(q)}
    if not matched:
      raise ValueError(
        f'{field} regex {pattern.pattern!r} matches no parameter; the parameters '
        f'are [{_listing(sorted(paths))}].'
      )
    hits |= matched
  return hits


def matrix_split(path: str, shape: Sequence[int]) -> int:
  """How many leading axes of a kernel are its input axes (module docstring)."""
  parent = path.rsplit('/', 2)[-2] if path.count('/') else ''
  if len(shape) == 3 and parent in ('query', 'key', 'value'):
    return 1
  return len(shape) - 1


class FineTuneModel:
  """`model` on trainable ∪ frozen parameters with LoRA products merged in (module docstring).

  apply({'params': trainable, 'frozen': base}, x), or apply({'params': trainable}, x) with
  the base held here. Hashable by identity (usable as a static jit argument).
  """

  def __init__(self, model, frozen: Params, lora_targets: Sequence[str], lora_scale: float):
    self.model = model
    self.frozen = frozen  # The base: a nested tree like the model's parameters.
    self.lora_targets = tuple(lora_targets)
    self.lora_scale = float(lora_scale)
    self._scales = {tuple(p.split('/')[:-1]): self.lora_scale for p in self.lora_targets}

  def full_params(self, trainable: Params, frozen: Params | None = None) -> Params:
    """The model's parameters: trainable ∪ frozen, with W + s·A·B on LoRA targets."""
    flat = dict(flatten(trainable))
    base = flatten(self.frozen if frozen is None else frozen)
    if set(base) != set(flatten(self.frozen)):
      raise ValueError(
        f'frozen: expected the paths [{_listing(sorted(flatten(self.frozen)))}], '
        f'got [{_listing(sorted(base))}].'
      )
    merged = {k: v for k, v in flat.items() if not k.endswith((LORA_A, LORA_B))}
    merged.update(base)
    for path in self.lora_targets:
      w = base[path]
      delta = flat[path + LORA_A] @ flat[path + LORA_B]
      merged[path] = (w + self.lora_scale * delta.reshape(w.shape)).astype(w.dtype)
    return unflatten(merged)

  def apply(self, variables: dict[str, Params], *args, **kwargs):
    params = self.full_params(variables['params'], variables.get('frozen'))
    with _scales(self._scales):
      return self.model.apply({'params': params}, *args, **kwargs)

  def with_base(self, frozen: Params) -> 'BoundModel':
    """This model with `frozen` (e.g. a traced argument) as its base: apply({'params': θ}, x)."""
    return BoundModel(self, frozen)


class BoundModel:
  """A FineTuneModel with its base bound: what `losses.make_loss_fn` takes as a model."""

  def __init__(self, model: FineTuneModel, frozen: Params):
    self.model, self.frozen = model, frozen

  def apply(self, variables: dict[str, Params], *args, **kwargs):
    return self.model.apply({**variables, 'frozen': self.frozen}, *args, **kwargs)


def loss_and_base(
  model, make_loss, mesh: jax.sharding.Mesh | None = None, rules=None
) -> tuple[Any, Any]:
  """(loss_fn, base) of `model` for `DPStep`: make_loss(model) and None, or for a
  FineTuneModel `(params, example, frozen) -> make_loss(model.with_base(frozen))(params,
  example)` and its base (an argument of the step's programs, not a constant in them), placed
  once over `mesh` by `frozen_shardings` (`rules`: the step's `param_sharding.ShardingRules`)."""
  if not isinstance(model, FineTuneModel):
    return make_loss(model), None
  base = model.frozen if mesh is None else place_base(model.frozen, mesh, rules)
  return (lambda p, example, frozen: make_loss(model.with_base(frozen))(p, example)), base


def place_base(frozen: Params, mesh: jax.sharding.Mesh, rules=None) -> Params:
  """The base as global arrays over `mesh`, placed like parameters (`frozen_shardings`)."""
  return param_sharding.place(frozen, frozen_shardings(frozen, mesh, rules))


def frozen_shardings(
  frozen: Params, mesh: jax.sharding.Mesh, rules: param_sharding.ShardingRules = None
) -> Params:
  """NamedShardings of the base over `mesh`: the parameters' rule (FSDP / tensor parallel,
  `param_sharding.parameter_specs`), as if the base were trained."""
  rules = rules or param_sharding.ShardingRules()
  specs = param_sharding.parameter_specs(frozen, mesh, rules)
  return jax.tree.map(
    lambda s: jax.sharding.NamedSharding(mesh, s),
    specs,
    is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
  )


def _check_lora(lora_rank, lora_alpha, lora_targets) -> None:
  if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
    raise ValueError(f'lora.rank = {lora_rank!r}: must be an integer >= 0 (0 = no LoRA).')
  if not lora_rank:
    return
  if not (isinstance(lora_alpha, (int, float)) and lora_alpha > 0 and math.isfinite(lora_alpha)):
    raise ValueError(f'lora.alpha = {lora_alpha!r}: must be a finite number > 0.')
  if not lora_targets:
    raise ValueError('lora.targets = (): must name the kernels to adapt when lora.rank > 0.')


def make_finetune(
  model,
  params: Params,
  *,
  freeze: Sequence[str] = (),
  lora_rank: int = 0,
  lora_alpha: float = 1.0,
  lora_targets: Sequence[str] = (),
  seed: int = 0,
) -> tuple[FineTuneModel, Params]:
  """(wrapped model, initial trainable parameters) for fine-tuning `params`.

  Args:
    model: the flax module the parameters belong to.
    params: the (pretrained) parameters.
    freeze: regexes on '/'-joined paths: these are frozen.
    lora_rank: r (0 = no LoRA); lora_alpha: α > 0.
    lora_targets: regexes on kernel paths (ndim ≥ 2, name 'kernel'); their base kernels are
      frozen and get adapters A, B.
    seed: the run's seed; A is drawn from `prng.stream_key(seed, Stream.LORA)`.

  Raises ValueError (one line) for a bad field, a regex matching nothing, r > min(in, out)
  or nothing left to train. The wrapped model's `frozen` is the base (place it with
  `frozen_shardings` and pass it as 'frozen' to keep it out of compiled programs).
  """
  _check_lora(lora_rank, lora_alpha, lora_targets)
  flat = flatten(params)
  paths = sorted(flat)
  frozen_paths = _matching('freeze', freeze, paths)
  targets: list[str] = []
  if lora_rank:
    kernels = [p for p in paths if p.endswith('kernel') and np.ndim(flat[p]) >= 2]
    targets = sorted(_matching('lora.targets', lora_targets, kernels))
    frozen_paths |= set(targets)
  trainable = {p: flat[p] for p in paths if p not in frozen_paths}
  key = prng.stream_key(seed, Stream.LORA)
  for i, path in enumerate(targets):
    shape = np.shape(flat[path])
    split = matrix_split(path, shape)
    d_in, d_out = int(np.prod(shape[:split])), int(np.prod(shape[split:]))
    if lora_rank > min(d_in, d_out):
      raise ValueError(
        f'lora.rank = {lora_rank}: must be <= min(in, out) = {min(d_in, d_out)} '
        f'of {path} {tuple(shape)}.'
      )
    dtype = jnp.asarray(flat[path]).dtype
    trainable[path + LORA_A] = jax.random.normal(
      jax.random.fold_in(key, i), (d_in, lora_rank), dtype
    ) / math.sqrt(d_in)
    trainable[path + LORA_B] = jnp.zeros((lora_rank, d_out), dtype)
  if not trainable:
    raise ValueError(f'freeze = {tuple(freeze)!r}: freezes every parameter; nothing would train.')
  frozen = unflatten({p: jnp.asarray(flat[p]) for p in frozen_paths}) if frozen_paths else {}
  wrapped = FineTuneModel(model, frozen, targets, lora_alpha / lora_rank if lora_rank else 0.0)
  return wrapped, unflatten(trainable)
