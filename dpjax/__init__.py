"""dpjax: DP-SGD in JAX with an ε that is an upper bound for what ran.

Three tiers; each is built on the one above it.

Tier 1, config-free primitives (typed arguments, no config):
  samplers      PoissonSampler, BallsAndBinsSampler, ShuffleSampler,
                DeterministicSampler, FixedSizeSampler, FixedSizeWithReplacementSampler
                (num_examples, batch_size, seed); `make_sampler(name, N, b, seed)`.
  Batcher       a logical batch as static-shape physical batches, padded with
                weight-0 rows, truncated at a cap B (accounted for).
  clipped_grad  shaped like `jax.grad`: Σ_i w_i · clip_C(∇loss(params, example_i)), the
                weights w (0 for padding) required, for any per-example loss, by
                per-example gradients or ghost
                clipping (linen and NNX layers); `PerExample` holds each row's loss,
                aux and norm (monitoring only, not private). `GradSum` adds the
                physical batches of a logical step with Kahan's compensation.
  gaussian_privatizer  an optax transform: + N(0, σ²C²) once per logical step, ÷ b,
                its noise keyed by (seed, t); `update(sum, state, params, step=t)` noises
                the t its state expects and no other (`GaussianNoiseState`: t, σ, C, b, B
                and the plan's fingerprint).
  Accountant, PrivacyReport, calibrate_noise_multiplier, max_num_steps
                ε after any step with its kind of bound; σ for a target ε. For Poisson
                and balls-and-bins they need the batcher's cap B (None: never truncated).
  NNXFunctional an `nnx.Module` as `loss_fn(params, example)` (NNX ghost clipping).

Tier 2, one object binds everything that enters ε:
  PrivacyPlan.create(sampler, num_steps=T, clip_norm=C, delta=δ,
                     noise_multiplier=σ | target_epsilon=ε) makes the batcher (with its
  cap), `clipped_grad`, the `privatizer` and the accountant, so they cannot disagree;
  refuses σ ≤ 0, C ∉ (0, ∞), δ ≥ 1/N; `epsilon_at(step)`, `fingerprint`. Its batcher starts
  at the privatizer state's step and draws each step once, in order; `create(...,
  resume_from=opt_state)` keeps the σ and B that ran. `DPStep.from_plan` is the compiled
  step the trainer runs (virtual batching, one program per logical step).

Tier 3, the trainer:  python -m dpjax.train --config digits_mlp --workdir w
  (config fields: docs/config.md), with `dpjax.account`, `dpjax.planner`, `dpjax.audit`,
  `dpjax.trainer.workdir.checkpoints` and `dpjax.export` beside it.

Your own loop (README, "Use dpjax in your own training loop"; examples/):

  plan = dpjax.PrivacyPlan.create(dpjax.PoissonSampler(num_examples=N, batch_size=256,
                                  seed=secrets.randbits(63)), num_steps=T, clip_norm=1.0,
                                  target_epsilon=3.0, delta=1e-5)
  grad_fn = jax.jit(plan.clipped_grad(loss_fn))
  tx = optax.chain(plan.privatizer(), optax.adam(1e-3))
  opt_state = tx.init(params)
  for batch in plan.batcher(P, opt_state):       # t = 0, ..., T − 1, each once
    g = dpjax.GradSum.zeros(params)              # Kahan's sum over the physical batches
    for idx, w in batch.physical_batches():
      g = g.add(grad_fn(params, data[idx], w)[0])
    updates, opt_state = tx.update(g.total, opt_state, params, step=batch.step)
  print(plan.epsilon_at(T))

The guarantee (docs/threat_model.md) is for add/remove neighbours and needs the seed to
be secret; a seed you choose must be kept private like the data.
"""

from dpjax.utils.lazy_exports import lazy_exports

# Name -> (module, attribute). Imported on first use (PEP 562), so that `import dpjax`, which
# every `python -m dpjax.<command>` runs first, is instant and an early Ctrl-C is the
# command's to handle.
_EXPORTS = {
  # Tier 1.
  'Sampler': ('dpjax.privacy.samplers', 'Sampler'),
  'PoissonSampler': ('dpjax.privacy.samplers', 'PoissonSampler'),
  'BallsAndBinsSampler': ('dpjax.privacy.samplers', 'BallsAndBinsSampler'),
  'ShuffleSampler': ('dpjax.privacy.samplers', 'ShuffleSampler'),
  'DeterministicSampler': ('dpjax.privacy.samplers', 'DeterministicSampler'),
  'FixedSizeSampler': ('dpjax.privacy.samplers', 'FixedSizeSampler'),
  'FixedSizeWithReplacementSampler': ('dpjax.privacy.samplers', 'FixedSizeWithReplacementSampler'),
  'make_sampler': ('dpjax.privacy.samplers', 'make'),
  'Batcher': ('dpjax.privacy.batching', 'Batcher'),
  'clipped_grad': ('dpjax.privacy.clipping', 'clipped_grad'),
  'PerExample': ('dpjax.privacy.clipping', 'PerExample'),
  'GradSum': ('dpjax.privacy.accumulator', 'GradSum'),
  'gaussian_privatizer': ('dpjax.privacy.noise', 'gaussian_privatizer'),
  'GaussianNoiseState': ('dpjax.privacy.noise_state', 'GaussianNoiseState'),
  'Accountant': ('dpjax.privacy.accounting.accountant', 'Accountant'),
  'PrivacyReport': ('dpjax.privacy.accounting.report', 'PrivacyReport'),
  'calibrate_noise_multiplier': (
    'dpjax.privacy.accounting.calibration',
    'calibrate_noise_multiplier',
  ),
  'max_num_steps': ('dpjax.privacy.accounting.calibration', 'max_num_steps'),
  'NNXFunctional': ('dpjax.models.functional', 'Functional'),
  # Tier 2.
  'PrivacyPlan': ('dpjax.privacy.privacy_plan', 'PrivacyPlan'),
  'DPStep': ('dpjax.privacy.dp_step', 'DPStep'),
}
__all__ = tuple(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
