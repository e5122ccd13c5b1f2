"""One object binds everything that enters ε: sampler, cap B, σ, C, δ, η and the accountant.

  plan = PrivacyPlan.create(PoissonSampler(num_examples=N, batch_size=256, seed=seed),
                            num_steps=T, clip_norm=1.0, target_epsilon=3.0, delta=1e-5)
  grad_fn = plan.clipped_grad(loss_fn)             # Σ_i w_i clip_C(g_i), like jax.grad
  grad_sum = grad_sum.add(grad_fn(...)[0])         # physical batches: `GradSum`, compensated
  tx = optax.chain(plan.privatizer(), optax.adam(1e-3))   # + N(0, σ²C²), ÷ b
  opt_state = tx.init(params)
  for batch in plan.batcher(64, opt_state):        # steps t = the state's, ..., T − 1, once each
    ...                                            # Σ over batch.physical_batches()
    updates, opt_state = tx.update(grad_sum.total, opt_state, params, step=batch.step)
  report = plan.epsilon_at(T)                      # ε after T steps, with its kind of bound

The batcher, the clipped gradient, the noise, the DP step (`dp_step.DPStep.from_plan`) and
the accountant are all made from the plan, so they cannot disagree: an accountant built
without the batcher's cap, σ or C that differ between step and report, or a sampler other
than the one accounted for are not expressible through it (the low-level pieces stay
available for callers who need them, without this guarantee). The batches and the noise
share one step counter, the privatizer state (`noise_state`): the batcher starts at its
step and draws each step once, in order (`step_batcher`); the privatizer noises a step only
when told its t and only from a state this plan made. Resuming a loop:
`PrivacyPlan.create(..., resume_from=opt_state)` takes σ and B from the state (never
re-calibrated: the steps that ran had that σ; another `noise_multiplier` or `max_batch_size`
is refused, and `target_epsilon` is then a budget the whole run must meet) and refuses a
state made with another C, b or fingerprint.

η is the float rounding of the noised sum (`rounding.Rounding`: a function of B, the
precision mode and the platform): examples are clipped at C exactly and the accountant
(and σ's calibration) uses the sensitivity C(1 + η).

Refused here, with one line naming the argument: σ ≤ 0 or not finite, C ∉ (0, ∞),
δ ∉ (0, 1), and δ ≥ 1/N unless `allow_large_delta` (an (ε, δ) guarantee with δ ≥ 1/N
permits releasing a random record in the clear: "name-and-shame", Dwork & Roth 2014,
§2.3). δ > 1/(10·N) is allowed with a warning (`warnings`).

Inputs: the sampler's seed is secret (it drives sampling and, through `dpjax.privacy.prng`,
the noise); N, b, T, σ, C and δ are public.

  >>> from dpjax.privacy.samplers import PoissonSampler
  >>> plan = PrivacyPlan.create(PoissonSampler(num_examples=60000, batch_size=256, seed=0),
  ...                           num_steps=1000, clip_norm=1.0, noise_multiplier=1.1, delta=1e-6)
  >>> report = plan.epsilon_at(1000)
  >>> plan.max_batch_size, round(report.epsilon, 3), report.bound, report.accountant
  (474, 0.707, 'upper', 'pld')
  >>> round(plan.rounding.eta, 6), plan.rounding.matmul_format  # On the CPU.
  (0.000678, 'float32')
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

from dpjax.privacy import batching
from dpjax.privacy import clipping
from dpjax.privacy import correlated_optax
from dpjax.privacy import mechanisms
from dpjax.privacy import noise
from dpjax.privacy import noise_state
from dpjax.privacy import plan_inputs
from dpjax.privacy import rounding as rounding_lib
from dpjax.privacy import samplers as samplers_lib
from dpjax.privacy import step_batcher
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import composition
from dpjax.privacy.accounting.options import AccountingOptions


def resolved_options(
  accounting: AccountingOptions | None,
  fields: dict[str, Any],
  num_steps: int,
  num_buffers: int | None = None,
) -> AccountingOptions:
  """`accounting` with `fields`, and the run's strategy for T steps (`mechanisms.strategy`) when
  they name correlated noise without one: BandMF's bands, or BLT's `num_buffers` buffers
  (required for 'blt'). What the step runs and what the accountant reads, made once."""
  base = accounting or AccountingOptions()
  if fields.get('noise', base.noise) == 'blt' and fields.get('strategy', base.strategy) is None:
    if num_buffers is None:
      raise ValueError("noise = 'blt' needs num_buffers (the BLT buffers, an integer >= 1).")
    fields = {**fields, 'strategy': mechanisms.strategy('blt', num_steps, 1, num_buffers)}
  options = base.replace(**fields)
  if options.strategy is None and options.noise == 'bandmf' and options.num_bands > 1:
    return options.replace(strategy=mechanisms.strategy('bandmf', num_steps, options.num_bands))
  return options


def seed_digest(seed: int) -> str:
  """SHA-256 of the seed (what a fingerprint stores instead of the seed itself)."""
  return hashlib.sha256(f'dpjax-seed:{int(seed)}'.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class PrivacyPlan:
  """The sampler, B, σ, C, δ, k and the accountant of one private run, resolved once.

  Build it with `PrivacyPlan.create` (validates, resolves B, calibrates σ if asked).

  Attributes:
    sampler: selects every logical batch (its seed is secret).
    num_steps: the planned run length T.
    clip_norm: C, the per-example clip norm.
    noise_multiplier: σ; the noise on the summed clipped gradients has std σ·C.
    noise_multiplier_source: 'given', 'calibrated' or 'checkpoint'.
    delta: δ.
    max_batch_size: B, the cap on a logical batch (truncation is accounted).
    group_size: k (the guarantee is for groups of k examples).
    target_epsilon: the ε budget at the last step (0 = none).
    precision: the matmul precision of the clipped gradients (`dpjax.privacy.precision`).
    rounding: η (`rounding.Rounding` of B, the precision and the platform).
    accountant: the `accounting.Accountant` of this sampler, σ, δ, B, k and 1 + η.
  """

  sampler: samplers_lib.Sampler
  num_steps: int
  clip_norm: float
  noise_multiplier: float
  noise_multiplier_source: str
  delta: float
  max_batch_size: int
  group_size: int
  target_epsilon: float
  precision: str
  rounding: rounding_lib.Rounding
  accountant: accountant_lib.Accountant = dataclasses.field(compare=False, repr=False)

  @classmethod
  def create(
    cls,
    sampler: samplers_lib.Sampler,
    *,
    num_steps: int,
    clip_norm: float,
    delta: float,
    noise_multiplier: float | None = None,
    target_epsilon: float = 0.0,
    max_batch_size: int = 0,
    physical_batch_size: int = 0,
    noise_multiplier_source: str | None = None,
    check_budget: bool = True,
    resume_from: Any = None,
    precision: str = 'default',
    platform: str | None = None,
    accounting: AccountingOptions | None = None,
    num_buffers: int | None = None,
    **accounting_fields: Any,
  ) -> PrivacyPlan:
    """Validates every argument, resolves B, calibrates σ if it is None, checks the budget.

    Args:
      sampler: the run's sampler (`dpjax.privacy.samplers`), seeded by the run's secret seed.
      num_steps: T, the number of logical steps.
      clip_norm: C, finite and > 0.
      delta: δ in (0, 1), below 1/N unless `accounting.allow_large_delta`.
      noise_multiplier: σ > 0, or None to calibrate the smallest σ meeting `target_epsilon`.
      target_epsilon: the ε budget (0 = none; required when σ is None). With σ given, a run
        whose final ε would exceed it is refused (`check_budget`).
      max_batch_size: B; 0 = the automatic cap (`batching.resolve_max_batch_size`).
      physical_batch_size: P, if known (B is then a multiple of it); 0 = B to the row.
      noise_multiplier_source: how σ was obtained ('given' by default, 'checkpoint' on resume).
      check_budget: refuse a given σ whose final ε exceeds `target_epsilon` (False: later).
      resume_from: the optimiser state of a loop to continue: σ and B are its privatizer
        state's (see the module docstring); a state of another C, b or fingerprint is refused.
      precision: 'default', 'highest' or 'bfloat16', the gradients' mode: with B, it sets η.
      platform: the backend that computes them ('cpu', 'gpu', 'tpu'); None = this one.
      accounting: how the accountant accounts (`AccountingOptions`: accountant, k,
        allow_large_delta, prior runs composed in ε and calibrated for, ...); B, T and
        1 + η are this plan's. **accounting_fields replace some of its fields (noise='bandmf'
        with num_bands, or 'blt' with `num_buffers`: the strategy is made for T steps).

    Raises:
      ValueError (one line, naming the argument) for any invalid input or a budget overrun.
    """
    if not isinstance(sampler, samplers_lib.Sampler):
      raise TypeError(f'sampler must be a dpjax sampler, got {type(sampler).__name__}.')
    options = resolved_options(accounting, accounting_fields, num_steps, num_buffers)
    if resume_from is not None:
      noise_multiplier, max_batch_size = plan_inputs.resumed_settings(
        resume_from, noise_multiplier, max_batch_size
      )
      noise_multiplier_source = 'checkpoint'
    num_steps, clip_norm, delta, target, options = plan_inputs.checked(
      sampler, num_steps, clip_norm, delta, target_epsilon, options
    )
    rounding, options = plan_inputs.cap_and_rounding(
      sampler, max_batch_size, physical_batch_size, precision, platform, delta, options
    )
    sigma, source = plan_inputs.resolve_sigma(sampler, noise_multiplier, target, delta, options)
    plan = cls(
      sampler=sampler,
      num_steps=num_steps,
      clip_norm=clip_norm,
      noise_multiplier=sigma,
      noise_multiplier_source=(noise_multiplier_source or source) if source == 'given' else source,
      delta=delta,
      max_batch_size=rounding.max_batch_size,
      group_size=options.group_size,
      target_epsilon=target,
      precision=precision,
      rounding=rounding,
      accountant=accountant_lib.Accountant(sampler, sigma, delta, options),
    )
    if resume_from is not None:
      noise_state.check(resume_from, plan.initial_noise_state, 'the resumed plan')
    if check_budget and source != 'calibrated':
      plan.check_budget()
    return plan

  @property
  def noise(self) -> str:
    """The noise mechanism ('gaussian' or 'bandmf'), the accountant's."""
    return self.accountant.noise

  @property
  def num_bands(self) -> int:
    return self.accountant.num_bands

  @property
  def strategy(self):
    """The matrix-factorisation strategy that runs (`correlated.strategy.Strategy`), the one
    the accountant reads; None for DP-SGD's Gaussian (C = I)."""
    return self.accountant.options.strategy

  def mechanism(self, noise_impl: str = 'threefry') -> noise.Privatizer:
    """The `noise.Privatizer` the step runs, with this plan's σ, C, b and seed: DP-SGD's
    Gaussian, or the strategy's correlated noise (`mechanisms.privatizer`), the mechanism the
    accountant accounts for."""
    return mechanisms.privatizer(
      self.strategy,
      self.noise_multiplier,
      self.clip_norm,
      self.expected_batch_size,
      self.seed,
      noise_impl,
    )

  @property
  def accountant_name(self) -> str:
    """The resolved accountant ('pld', 'rdp' or 'monte_carlo')."""
    return self.accountant.accountant

  @property
  def expected_batch_size(self) -> float:
    """What the noisy sum is divided by: the sampler's E[n_t], never the rows present."""
    return self.sampler.expected_batch_size

  @property
  def seed(self) -> int:
    return self.sampler.seed

  def batcher(self, physical_batch_size: int, opt_state: Any) -> step_batcher.StepBatcher:
    """The batches of this loop: P rows per physical batch, truncation at B, steps from the
    privatizer state's in `opt_state` (read once) to T − 1, each once and in order.

    Raises ValueError (one line) for a state this plan's privatizer did not make (another σ,
    C, b, B or fingerprint) or one that refused a step (`noise_state.check`).
    """
    start = (
      correlated_optax.state_step(opt_state, self.mechanism())
      if self.strategy is not None
      else noise_state.check(opt_state, self.initial_noise_state)
    )
    return step_batcher.StepBatcher(
      batching.Batcher(self.sampler, physical_batch_size, self.max_batch_size),
      self.num_steps,
      start,
    )

  def epsilon_at(self, step: int, *, estimates: bool = False) -> accountant_lib.PrivacyReport:
    """The PrivacyReport after `step` steps: ε, δ and the kind of bound (`report.bound`)."""
    return self.accountant.epsilon_at(step, estimates=estimates)

  def final_report(self, *, estimates: bool = True) -> accountant_lib.PrivacyReport:
    return self.accountant.epsilon_at(self.num_steps, estimates=estimates)

  def check_budget(self) -> None:
    """ValueError if the final ε exceeds `target_epsilon` (> 0)."""
    if not self.target_epsilon:
      return
    final = self.accountant.epsilon(self.num_steps)
    if final > self.target_epsilon:
      raise BudgetExceededError(
        f'noise_multiplier = {self.noise_multiplier:g} over {self.num_steps} steps would reach '
        f'ε = {final:.4g} (δ = {self.delta:g}), above target_epsilon = '
        f'{self.target_epsilon:g}: raise the budget, raise σ, or shorten the run.',
        final_epsilon=final,
      )

  def clipped_grad(self, loss_fn, *, has_aux: bool = False, method: str = 'auto'):
    """`clipping.clipped_grad` with this plan's C and precision (the η its accountant pays)."""
    return clipping.clipped_grad(
      loss_fn, self.clip_norm, has_aux=has_aux, method=method, precision=self.precision
    )

  @functools.cached_property
  def _ideal_accountants(self) -> dict[Any, accountant_lib.Accountant]:
    return {}

  def rounding_cost(self, step: int | None = None) -> float | None:
    """Δε = ε(t) − ε₀(t) after `step` steps (None: the last): what η costs, ε₀ from the same
    accountant at η = 0 and at the PLD grid ε(t) was reported at (one grid, no refinement:
    Δε is η's cost alone, never the two grids' difference). None for balls-and-bins, whose
    ε₀ would need a second random-allocation PLD (minutes)."""
    if self.sampler.random_allocation_bracket:
      return None
    step = self.num_steps if step is None else step
    report = self.accountant.epsilon_at(step, estimates=False)
    grid = report.details.get('pld_grid')
    if grid not in self._ideal_accountants:
      options = self.accountant.options.replace(sensitivity=1.0)
      if grid is not None:
        options = options.replace(value_discretization_interval=grid)
      self._ideal_accountants[grid] = accountant_lib.Accountant(
        self.sampler, self.noise_multiplier, self.delta, options
      )
    return report.epsilon - self._ideal_accountants[grid].epsilon(step)

  def rounding_record(self, step: int | None = None) -> dict[str, Any]:
    """η, what it is of, and its cost Δε after `step` steps (for checkpoints and the card)."""
    r, cost = self.rounding, self.rounding_cost(step)
    return {
      'eta': r.eta,
      'max_batch_size': r.max_batch_size,
      'matmul_format': r.matmul_format,
      'precision': self.precision,
      'epsilon_cost': cost,
      'statement': r.describe(cost) + ' (included in ε; examples are clipped at C exactly)',
    }

  def privatizer(self, *, noise_impl: str = 'threefry'):
    """The optax transform adding N(0, σ²C²) to each step's clipped sum and dividing by b,
    with this plan's σ, C, b and seed (`noise.gaussian_privatizer`); with a correlated-noise
    strategy, its noise σC·(C⁻¹z)_t instead (`correlated_optax.as_optax`, state: the step and
    the recent noise or buffers, which `batcher` reads the step from)."""
    if self.strategy is not None:  # Correlated noise: the strategy's, with its state.
      return correlated_optax.as_optax(self.mechanism(noise_impl))
    return noise.gaussian_privatizer(
      self.noise_multiplier,
      self.clip_norm,
      self.expected_batch_size,
      self.seed,
      max_batch_size=self.max_batch_size,
      fingerprint=self.fingerprint,
      noise_impl=noise_impl,
    )

  @property
  def initial_noise_state(self) -> noise_state.GaussianNoiseState:
    """The state `privatizer().init` starts from (step 0): σ, C, b, B and the fingerprint."""
    return noise_state.made_with(
      self.noise_multiplier,
      self.clip_norm,
      self.expected_batch_size,
      self.max_batch_size,
      self.fingerprint,
    )

  @property
  def fingerprint(self) -> dict[str, Any]:
    """Everything here that enters ε, JSON-ready (the seed only as its SHA-256)."""
    s = self.sampler
    prior = {composition.FINGERPRINT_FIELD: [r.fingerprint for r in self.accountant.prior_runs]}
    return {
      **(prior if self.accountant.prior_runs else {}),
      'sampler.name': s.name,
      'sampler.num_examples': s.num_examples,
      'sampler.batch_size': s.batch_size,
      'sampler.max_batch_size': self.max_batch_size,
      **s.own_values(),
      'privacy.group_size': self.group_size,
      'privacy.noise_multiplier': self.noise_multiplier,
      'privacy.clip_norm': self.clip_norm,
      'privacy.delta': self.delta,
      'privacy.accountant': self.accountant_name,
      'privacy.matmul_format': self.rounding.matmul_format,
      'privacy.rounding_eta': self.rounding.eta,
      'seed_sha256': seed_digest(s.seed),
      **mechanisms.fingerprint(self.noise, self.strategy),
    }


class BudgetExceededError(ValueError):
  """The run's final ε would exceed the target; `final_epsilon` holds it."""

  def __init__(self, message: str, final_epsilon: float):
    super().__init__(message)
    self.final_epsilon = final_epsilon
