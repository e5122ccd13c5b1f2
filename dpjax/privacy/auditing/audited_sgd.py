"""A minimal DP-SGD loop with gradient canaries and white-box records, for audits.

Built from the library's own parts (`samplers`, `batching`, `clipping`,
`prng.noise_key`), plain SGD on the flattened parameters:

  s_t = Σ_i w_i clip_C(g_i) (canaries injected) + N(0, σ²C² I),   θ ← θ − η s_t / b.

It records, for every step, the released s_t and the auditor's own sum c_t
of the *ordinary* rows' clipped gradients (a separate call with the
configured C), both projected on the canaries, and the canary rows of each
batch. That is what `one_run` (scores) and `white_box` (effective σ) need.

The one-run score of canary j is Σ_t ⟨s_t − c_t, u_j⟩ / C. An adversary may
compute it: it knows the ordinary examples and the models θ_t (functions of
the released sums), and sees which ordinary examples were sampled; their
sampling is independent of the canaries' (Poisson: independent coins;
balls-and-bins: independent uniform bins), so the run stays (ε, δ)-DP with
respect to each canary given it, and the bound of `one_run` applies.

`_bug` plants a privacy bug for the tests and experiment 08 only (it is not a
config field and never reachable from `dpjax.train`):
  'noise_tenth'      noise std σC/10 while the claim uses σ;
  'skip_clipping'    no clipping (of ordinary rows and canaries);
  'count_twice'      every physical batch is accumulated twice;
  'skip_noise_every_4th'  no noise on steps t ≡ 3 (mod 4).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

from dpjax.privacy import batching
from dpjax.privacy import clipping
from dpjax.privacy import losses
from dpjax.privacy import prng
from dpjax.privacy import samplers
from dpjax.privacy.auditing import canaries as canaries_lib
from dpjax.privacy.auditing import gradient_canary

PLANTED_BUGS = ('noise_tenth', 'skip_clipping', 'count_twice', 'skip_noise_every_4th')


@dataclasses.dataclass
class AuditedRun:
  """What an audited run released and what its auditor recorded."""
  canaries: canaries_lib.CanarySet
  params: object  # final parameters (pytree)
  released: np.ndarray  # [T, m] ⟨s_t, u_j⟩
  ordinary: np.ndarray  # [T, m] ⟨c_t, u_j⟩
  counts: np.ndarray  # [T, m] canary rows in step t's batch
  clip_norm: float  # C (1.0 for a non-private run: the unit of the scores)
  noise_multiplier: float  # σ configured (0 = non-private)
  num_examples: int  # N + m, what sampler and accountant see

  def scores(self) -> np.ndarray:
    """The one-run scores Σ_t ⟨s_t − c_t, u_j⟩ / C."""
    return np.sum(self.released - self.ordinary, axis=0) / self.clip_norm

  def records(self) -> dict[str, np.ndarray]:
    return {'released': self.released, 'ordinary': self.ordinary, 'counts': self.counts}


@dataclasses.dataclass(frozen=True)
class AuditSettings:
  """The audited run: sampler, sizes, C, σ, δ, learning rate, length and seed."""
  sampler: str  # A `samplers.SAMPLER_NAMES` name.
  batch_size: int  # b.
  physical_batch_size: int  # P.
  max_batch_size: int  # B (0: automatic, `batching.resolve_max_batch_size`).
  num_steps: int  # T.
  clip_norm: float  # C.
  noise_multiplier: float  # σ.
  delta: float  # δ (sets the automatic B).
  learning_rate: float  # η of plain SGD.
  seed: int | None = None  # None: drawn from OS entropy.


def train(settings: AuditSettings, model, base_source, *, num_canaries: int,
          private: bool = True, _bug: str | None = None) -> AuditedRun:
  """Trains `model` for `settings.num_steps` steps on `base_source` plus m canaries."""
  if _bug is not None and _bug not in PLANTED_BUGS:
    raise ValueError(f'_bug = {_bug!r}; valid: {PLANTED_BUGS}.')
  source = canaries_lib.CanarySource(base_source, num_canaries)
  seed = prng.draw_seed() if settings.seed is None else settings.seed
  sampler = samplers.make(settings.sampler, len(source), settings.batch_size, seed)
  num_steps = settings.num_steps
  physical = settings.physical_batch_size
  max_batch_size = batching.resolve_max_batch_size(
      sampler, physical, settings.max_batch_size, num_steps=num_steps,
      delta=settings.delta)
  batcher = batching.Batcher(sampler, physical, max_batch_size)
  params = prng.init_params(model, seed, base_source.input_shape)
  flat0, unravel = jax.flatten_util.ravel_pytree(params)
  canaries = canaries_lib.make_canaries(seed, num_canaries, flat0.size)
  loss_fn = losses.make_loss_fn(model)

  clip_norm = float(settings.clip_norm) if private else 1.0
  sigma = float(settings.noise_multiplier) if private else 0.0
  canary_norm = canaries.gradient_scale * clip_norm
  if not private:
    base = functools.partial(clipping.grad_sum, loss_fn)
    applied_clip = math.inf
  else:
    applied_clip = math.inf if _bug == 'skip_clipping' else clip_norm
    base = clipping.make_clipped_sum_fn('vmap', loss_fn, applied_clip)
  step_sum = gradient_canary.with_gradient_canaries(
      base, canaries, canary_norm=canary_norm, clip_norm=applied_clip)
  coordinates = jnp.asarray(canaries.coordinates)
  signs = jnp.asarray(canaries.signs)

  @jax.jit
  def accumulate(flat, batch):
    """(this batch's summed gradient as the loop computes it, the auditor's ordinary sum)."""
    p = unravel(flat)
    g, _ = step_sum(p, batch)
    ordinary = dict(batch, weight=jnp.where(batch['canary_id'] >= 0, 0.0, batch['weight']))
    del ordinary['canary_id']
    if private:
      ref, _ = clipping.per_example_clipped_sum(loss_fn, p, ordinary, clip_norm)
    else:
      ref, _ = clipping.grad_sum(loss_fn, p, ordinary)
    return jax.flatten_util.ravel_pytree(g)[0], jax.flatten_util.ravel_pytree(ref)[0]

  @jax.jit
  def release(flat, grad_sum, key, noise_std):
    s = grad_sum + noise_std * jax.random.normal(key, grad_sum.shape, grad_sum.dtype)
    new = flat - settings.learning_rate * s / sampler.expected_batch_size
    return new, s[coordinates] * signs

  flat = flat0
  m = num_canaries
  released, ordinary_rec = np.zeros((num_steps, m)), np.zeros((num_steps, m))
  counts = np.zeros((num_steps, m), np.int64)
  for step in range(num_steps):
    logical = batcher.logical_batch(step)
    logical.check_rows(len(source))
    grad_sum, ref_sum = jnp.zeros_like(flat), jnp.zeros_like(flat)
    for indices, weights in logical.physical_batches():
      batch = source.gather(indices)
      counts[step] += gradient_canary.canary_counts(batch['canary_id'], weights, m)
      batch['weight'] = weights
      for _ in range(2 if _bug == 'count_twice' else 1):
        g, ref = accumulate(flat, batch)
        grad_sum = grad_sum + g
      ref_sum = ref_sum + ref
    noise_std = sigma * clip_norm
    if _bug == 'noise_tenth':
      noise_std /= 10
    if _bug == 'skip_noise_every_4th' and step % 4 == 3:
      noise_std = 0.0
    flat, projected = release(flat, grad_sum, prng.noise_key(seed, step),
                              jnp.float32(noise_std))
    released[step] = np.asarray(projected)
    ordinary_rec[step] = np.asarray(ref_sum[coordinates] * signs)
  return AuditedRun(canaries, unravel(flat), released, ordinary_rec, counts, clip_norm,
                    sigma, len(source))
