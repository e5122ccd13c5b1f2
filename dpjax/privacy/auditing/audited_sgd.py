"""DP-SGD with gradient canaries and white-box records, for audits: the library's step.

The run is built from a `PrivacyPlan` (its sampler, cap B, C, σ, seed) and runs the library
tier the trainer runs too: the plan's batcher, the clipped sum (`clipping`), summed over the
physical batches by `accumulator.GradSum`, and the plan's privatizer (`noise.noisy_mean`:
the one place dpjax adds noise and divides by b), then plain SGD:

  s_t = Σ_i w_i clip_C(g_i) (canaries injected) + N(0, σ²C² I),   θ ← θ − η s_t / b.

It records, for every step, the released s_t (= b·ĝ_t) and the auditor's own sum c_t of the
*ordinary* rows' clipped gradients (a separate, independent computation:
`clipping.per_example_clipped_sum` at the configured C), both projected on the canaries, and
the canary rows of each batch. That is what `one_run` (scores) and `white_box` (effective σ)
need.

The one-run score of canary j is Σ_t ⟨s_t − c_t, u_j⟩ / C. An adversary may
compute it: it knows the ordinary examples and the models θ_t (functions of
the released sums), and sees which ordinary examples were sampled; their
sampling is independent of the canaries' (Poisson: independent coins;
balls-and-bins: independent uniform bins), so the run stays (ε, δ)-DP with
respect to each canary given it, and the bound of `one_run` applies.

`_bug` plants a privacy bug for the tests and experiment 08 only (it is not a
config field and never reachable from `dpjax.train`), each as a wrapper of one piece of the
real step, so an audit tests the code that trains:
  'noise_tenth'      the privatizer of σ/10 while the claim uses σ;
  'skip_clipping'    the clipped sum at C = ∞ (ordinary rows and canaries);
  'count_twice'      every physical batch's clipped sum is added twice;
  'skip_noise_every_4th'  the privatizer's output replaced by the noiseless mean on t ≡ 3 (mod 4).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax

from dpjax.privacy import accumulator
from dpjax.privacy import batching
from dpjax.privacy import clipping
from dpjax.privacy import losses
from dpjax.privacy import noise
from dpjax.privacy import privacy_plan
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


def _release_transform(plan, bug: str | None) -> optax.GradientTransformationExtraArgs:
  """The plan's privatizer, or its planted-bug wrapper."""
  if bug == 'noise_tenth':
    return noise.gaussian_privatizer(
      plan.noise_multiplier / 10,
      plan.clip_norm,
      plan.expected_batch_size,
      plan.seed,
      max_batch_size=plan.max_batch_size,
    )
  inner = plan.privatizer()
  if bug != 'skip_noise_every_4th':
    return inner

  def update(updates, state, params=None, *, step=None, **extra):
    released, state = inner.update(updates, state, params, step=step, **extra)
    plain = noise.noisy_mean(updates, None, None, plan.expected_batch_size)
    released = jax.tree.map(lambda r, g: jnp.where(step % 4 == 3, g, r), released, plain)
    return released, state

  return optax.GradientTransformationExtraArgs(inner.init, update)


def _plan(settings: AuditSettings, sampler) -> privacy_plan.PrivacyPlan:
  return privacy_plan.PrivacyPlan.create(
    sampler,
    num_steps=settings.num_steps,
    clip_norm=settings.clip_norm,
    noise_multiplier=settings.noise_multiplier,
    delta=settings.delta,
    physical_batch_size=settings.physical_batch_size,
    max_batch_size=settings.max_batch_size,
  )


def _mechanism(settings: AuditSettings, sampler, params, loss_fn, private: bool, _bug):
  """(C claimed, σ, C applied, release transform, batcher, clipped-sum fn) of the run: the
  plan's (with `_bug`'s wrappers) when private, else the unclipped, unnoised sum ÷ b."""
  if private:
    plan = _plan(settings, sampler)
    tx = _release_transform(plan, _bug)
    batcher = plan.batcher(settings.physical_batch_size, plan.privatizer().init(params))
    applied_clip = math.inf if _bug == 'skip_clipping' else plan.clip_norm
    base = clipping.make_clipped_sum_fn('vmap', loss_fn, applied_clip)
    return plan.clip_norm, plan.noise_multiplier, applied_clip, tx, batcher, base
  b = sampler.expected_batch_size
  tx = optax.GradientTransformationExtraArgs(
    lambda p: optax.EmptyState(),
    lambda g, s, p=None, *, step=None: (noise.noisy_mean(g, None, None, b), s),
  )
  max_batch_size = batching.resolve_max_batch_size(
    sampler,
    settings.physical_batch_size,
    settings.max_batch_size,
    num_steps=settings.num_steps,
    delta=settings.delta,
  )
  batcher = batching.Batcher(sampler, settings.physical_batch_size, max_batch_size)
  return 1.0, 0.0, math.inf, tx, batcher, functools.partial(clipping.grad_sum, loss_fn)


def train(
  settings: AuditSettings,
  model,
  base_source,
  *,
  num_canaries: int,
  private: bool = True,
  _bug: str | None = None,
) -> AuditedRun:
  """Trains `model` for `settings.num_steps` steps on `base_source` plus m canaries."""
  if _bug is not None and _bug not in PLANTED_BUGS:
    raise ValueError(f'_bug = {_bug!r}; valid: {PLANTED_BUGS}.')
  source = canaries_lib.CanarySource(base_source, num_canaries)
  seed = prng.draw_seed() if settings.seed is None else settings.seed
  sampler = samplers.make(settings.sampler, len(source), settings.batch_size, seed)
  num_steps, b = settings.num_steps, sampler.expected_batch_size
  params = prng.init_params(model, seed, base_source.input_shape)
  flat0, _ = jax.flatten_util.ravel_pytree(params)
  canaries = canaries_lib.make_canaries(seed, num_canaries, flat0.size)
  loss_fn = losses.make_loss_fn(model)

  clip_norm, sigma, applied_clip, tx, batcher, base = _mechanism(
    settings, sampler, params, loss_fn, private, _bug
  )
  step_sum = gradient_canary.with_gradient_canaries(
    base, canaries, canary_norm=canaries.gradient_scale * clip_norm, clip_norm=applied_clip
  )
  coordinates, signs = jnp.asarray(canaries.coordinates), jnp.asarray(canaries.signs)

  def project(tree):
    return jax.flatten_util.ravel_pytree(tree)[0][coordinates] * signs

  @jax.jit
  def accumulate(params, total, batch):
    """The running sum plus this batch's clipped sum as the step computes it (twice for
    'count_twice'), and the auditor's projected sum of the ordinary rows."""
    g, _ = step_sum(params, batch)
    for _ in range(2 if _bug == 'count_twice' else 1):
      total = total.add(g)
    ordinary = dict(batch, weight=jnp.where(batch['canary_id'] >= 0, 0.0, batch['weight']))
    del ordinary['canary_id']
    if private:
      ref, _ = clipping.per_example_clipped_sum(loss_fn, params, ordinary, clip_norm)
    else:
      ref, _ = clipping.grad_sum(loss_fn, params, ordinary)
    return total, project(ref)

  @jax.jit
  def release(params, state, grad_sum, step):
    """ĝ_t from the step's transform, θ − η·ĝ_t, and ⟨b·ĝ_t, u_j⟩ (the released s_t)."""
    mean, state = tx.update(grad_sum, state, params, step=step)
    params = jax.tree.map(lambda p, u: p - settings.learning_rate * u, params, mean)
    return params, state, project(mean) * b

  state = tx.init(params)
  m = num_canaries
  released, ordinary_rec = np.zeros((num_steps, m)), np.zeros((num_steps, m))
  counts = np.zeros((num_steps, m), np.int64)
  for step in range(num_steps):
    logical = batcher.logical_batch(step)
    logical.check_rows(len(source))
    total, ref_sum = accumulator.GradSum.zeros(params), jnp.zeros(m)
    for indices, weights in logical.physical_batches():
      batch = source.gather(indices)
      counts[step] += gradient_canary.canary_counts(batch['canary_id'], weights, m)
      batch['weight'] = weights
      total, ref = accumulate(params, total, batch)
      ref_sum = ref_sum + ref
    params, state, projected = release(params, state, total.total, np.uint32(step))
    released[step] = np.asarray(projected)
    ordinary_rec[step] = np.asarray(ref_sum)
  return AuditedRun(canaries, params, released, ordinary_rec, counts, clip_norm, sigma, len(source))
