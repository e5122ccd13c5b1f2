"""Fine-tuning from pretrained parameters: loading, freezing and LoRA adapters.

Loading (`config.init_from`, `config.init_from_rules`): a `.npz` of parameters
keyed by their '/'-joined paths (`save_npz` writes one), a dpjax export directory
(its `params.npz`), a dpjax workdir (its newest checkpoint's `params`), or one
orbax checkpoint step directory of it (`dpjax.trainer.workdir.stored_params`, which also
checks them against the digest of the weights a run started from). Whose privacy
loss comes with them: `dpjax.trainer.planning.init_source`.
Rename rules (regex, replacement) are applied in order to the file's keys
with `re.sub`; a key renamed to '' is dropped. The result must match the
model's parameters key for key and shape for shape, else ONE ValueError line
lists the missing and unexpected keys and the shape mismatches.

Freezing (`config.freeze`, regexes searched in the '/'-joined paths) and LoRA
(Hu et al. 2022, "LoRA: Low-Rank Adaptation of Large Language Models";
`lora.rank` r, `lora.alpha` α, `lora.targets` regexes on kernel paths)
partition the parameters into trainable ones and frozen constants:

  W' = W_frozen + (α / r) · A · B,   A ∈ R^{in × r} ~ N(0, 1/in),  B ∈ R^{r × out} = 0,

for each targeted kernel viewed as an [in, out] matrix (Dense [in, out] and
Conv [kh, kw, in, out] → [kh·kw·in, out]; attention query/key/value
[in, heads, head_dim] → [in, heads·head_dim]; attention 'out'
[heads, head_dim, out] → [heads·head_dim, out]). B = 0 makes the first forward
pass that of the pretrained model.

`FineTuneModel(...).apply({'params': trainable}, x)` merges the frozen
constants (and the LoRA products) in, so the DP step sees only the trainable
parameters: per-example gradients, their norms, the clipping and the noise
are over the trainable parameters alone. Frozen parameters get no gradient,
no noise and no share of the clip norm: they are part of the starting weights,
public when those are (an .npz without a privacy card), else covered by the
composition of their runs' privacy loss with this run's (`init_source`).

Clipping methods: with frozen parameters, ghost clipping covers the wrapped
model as before (tested equal to vmap); LoRA adapters are not covered by
`dpjax.privacy.ghost_clipping`, so 'auto' falls back to per-example gradients (vmap)
with a log line, and 'ghost' is refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
import re
from typing import Any

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from dpjax.trainer.workdir import stored_params
from dpjax.privacy import prng
from dpjax.privacy.random_streams import Stream

Params = Any
LORA_A, LORA_B = '_lora_a', '_lora_b'  # Suffixes of the adapters beside their kernel's name.


def flatten(params: Params) -> dict[str, Any]:
  """{'Dense_0/kernel': array, ...}: '/'-joined parameter paths."""
  return traverse_util.flatten_dict(params, sep='/')


def unflatten(flat: dict[str, Any]) -> Params:
  return traverse_util.unflatten_dict(flat, sep='/')


def save_npz(path: str, params: Params) -> None:
  """Writes params as an .npz keyed by '/'-joined paths (what `init_from` reads)."""
  stored_params.save(path, {k: np.asarray(v) for k, v in flatten(params).items()})


def _listing(items: Sequence[str], limit: int = 8) -> str:
  shown = ', '.join(items[:limit])
  return shown + (f' and {len(items) - limit} more' if len(items) > limit else '')


def apply_rules(flat: dict[str, Any], rules: Sequence[Sequence[str]]) -> dict[str, Any]:
  """Renames keys by each (regex, replacement) in turn (re.sub); '' drops the key."""
  out = dict(flat)
  for rule in rules:
    if not (
      isinstance(rule, (tuple, list)) and len(rule) == 2 and all(isinstance(s, str) for s in rule)
    ):
      raise ValueError(f'init_from_rules entry {rule!r}: must be a (regex, replacement) pair.')
    try:
      pattern = re.compile(rule[0])
    except re.error as e:
      raise ValueError(f'init_from_rules regex {rule[0]!r}: invalid ({e}).') from None
    renamed = {}
    for key, value in out.items():
      new = pattern.sub(rule[1], key)
      if new in renamed:
        raise ValueError(f'init_from_rules {tuple(rule)!r}: two keys map to {new!r}.')
      if new:
        renamed[new] = value
    out = renamed
  return out


def load_pretrained(
  init_from: str, template: Params, rules: Sequence[Sequence[str]] = (), sha256: str | None = None
) -> Params:
  """Pretrained parameters with the structure, shapes and dtypes of `template`.

  sha256: the digest of the weights the run started from (`stored_params.sha256`), if
  recorded: weights read here that differ from them are refused.

  Raises ValueError (one line) listing missing keys, unexpected keys and shape
  mismatches after the rename `rules`, or naming weights that changed.
  """
  stored = stored_params.read_params(init_from)
  stored_params.refuse_changed(init_from, sha256, stored_params.sha256(stored))
  flat = apply_rules(stored, rules)
  want = flatten(template)
  missing = sorted(set(want) - set(flat))
  unexpected = sorted(set(flat) - set(want))
  shapes = sorted(
    f'{k} {tuple(np.shape(flat[k]))} vs model {tuple(np.shape(want[k]))}'
    for k in set(want) & set(flat)
    if np.shape(flat[k]) != np.shape(want[k])
  )
  if missing or unexpected or shapes:
    parts = [
      f'{name} [{_listing(items)}]'
      for name, items in (
        ('missing keys', missing),
        ('unexpected keys', unexpected),
        ('shape mismatches', shapes),
      )
      if items
    ]
    raise ValueError(
      f'init_from = {init_from!r} does not match the model: '
      + '; '.join(parts)
      + '. Rename keys with init_from_rules (regex, replacement).'
    )
  return unflatten({k: jnp.asarray(flat[k], jnp.asarray(v).dtype) for k, v in want.items()})


def _compile_all(field: str, patterns: Sequence[str]) -> list[re.Pattern]:
  if isinstance(patterns, str):
    raise ValueError(f'{field} = {patterns!r}: must be a tuple of regexes, not a string.')
  compiled = []
  for p in patterns:
    try:
      compiled.append(re.compile(p))
    except (re.error, TypeError) as e:
      raise ValueError(f'{field} regex {p!r}: invalid ({e}).') from None
  return compiled


def _matching(field: str, patterns: Sequence[str], paths: Sequence[str]) -> set[str]:
  """Paths some pattern matches (re.search); ValueError for a pattern matching none."""
  hits = set()
  for pattern in _compile_all(field, patterns):
    matched = {p for p in paths if pattern.search(p)}
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
  """`model` with frozen constants and LoRA products merged in: apply({'params': trainable}, x).

  Hashable by identity (usable as a static jit argument, e.g. losses.eval_step).
  The frozen constants are closed over by the compiled programs.
  """

  def __init__(
    self, model, frozen: dict[str, jax.Array], lora_targets: Sequence[str], lora_scale: float
  ):
    self.model = model
    self.frozen = dict(frozen)
    self.lora_targets = tuple(lora_targets)
    self.lora_scale = float(lora_scale)

  def full_params(self, trainable: Params) -> Params:
    """The model's parameters: trainable ∪ frozen, with W + (α/r)·A·B on LoRA targets."""
    flat = dict(flatten(trainable))
    merged = {k: v for k, v in flat.items() if not k.endswith((LORA_A, LORA_B))}
    merged.update(self.frozen)
    for path in self.lora_targets:
      w = self.frozen[path]
      delta = flat[path + LORA_A] @ flat[path + LORA_B]
      merged[path] = (w + self.lora_scale * delta.reshape(w.shape)).astype(w.dtype)
    return unflatten(merged)

  def apply(self, variables: dict[str, Params], *args, **kwargs):
    return self.model.apply({'params': self.full_params(variables['params'])}, *args, **kwargs)


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
    freeze: `config.freeze`, regexes on '/'-joined paths: these are frozen.
    lora_rank: `lora.rank` r (0 = no LoRA); lora_alpha: α > 0.
    lora_targets: `lora.targets`, regexes on kernel paths (ndim ≥ 2, name
      'kernel'); their base kernels are frozen and get adapters A, B.
    seed: the run's seed; A is drawn from `prng.stream_key(seed, Stream.LORA)`.
  """
  flat = flatten(params)
  paths = sorted(flat)
  frozen_paths = _matching('freeze', freeze, paths)
  if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
    raise ValueError(f'lora.rank = {lora_rank!r}: must be an integer >= 0 (0 = no LoRA).')
  targets: list[str] = []
  if lora_rank:
    if not (isinstance(lora_alpha, (int, float)) and lora_alpha > 0 and math.isfinite(lora_alpha)):
      raise ValueError(f'lora.alpha = {lora_alpha!r}: must be a finite number > 0.')
    if not lora_targets:
      raise ValueError('lora.targets = (): must name the kernels to adapt when lora.rank > 0.')
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
  frozen = {p: jnp.asarray(flat[p]) for p in frozen_paths}
  wrapped = FineTuneModel(model, frozen, targets, lora_alpha / lora_rank if lora_rank else 0.0)
  return wrapped, unflatten(trainable)
