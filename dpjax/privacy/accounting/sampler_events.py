"""dp_accounting events: one DP-SGD step (or epoch) of each sampler as a `DpEvent`.

Adjacency is add/remove up to k examples ("zeroing-out", k = group size; k = 1
is example-level DP). Every event below is a dominating pair for one step
(one epoch for the epoch-based samplers), so composing it with dp_accounting
gives an upper bound on ε. N is the number of training examples, b the
(expected) batch size, σ the noise multiplier. See docs/accounting.md.

* Poisson, q = b/N (§1): `PoissonSampledDpEvent(q, GaussianDpEvent(σ))`.
  Truncated to B: `TruncatedSubsampledGaussianDpEvent(N', q, B, σ)` (arXiv
  2508.15089). Group k (Ganesh, seed 004, Thm 3.1): MoG with sensitivities
  [0, 1, …, k] and probabilities Binomial(k, q).
* Fixed size without replacement (§4; Ganesh Thm 3.3): MoG with sensitivities
  [0, 2, …, 2k] and probabilities Hypergeometric(N, k, b) (k = 1: [0, 2] with
  [1 − b/N, b/N]; the 2: an added example displaces another). Stated for
  datasets of size ≥ N, so it covers both neighbours of the training set.
  Replace-one baseline for comparison: `SampledWithoutReplacementDpEvent(N, b,
  GaussianDpEvent(σ/2))` (Wang, Balle, Kasiviswanathan 2019; sensitivity 2C).
* Fixed size with replacement: MoG with sensitivities [0, 2, …, 2b] and
  probabilities Binomial(b, k/N); see `fixed_size_with_replacement_step_event`.
* Deterministic order (and the upper bound for shuffle and balls-and-bins):
  one epoch releases each example's clipped gradient once, so the epoch is the
  Gaussian mechanism with L2 sensitivity k: `GaussianDpEvent(σ/k)` per epoch.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting import dp_event
from scipy import stats

from dpjax.privacy import checks

# Tail mass (per step) that is merged into the largest sensitivity. It must stay far below the
# mass dp_accounting's mixture PLD truncates (½·e^-50 ≈ 1e-22, `log_mass_truncation_bound`):
# then that component never widens the privacy-loss grid, and its mass lands in the
# pessimistic infinite-loss bucket.
MOG_TAIL_MASS = 1e-30
# Relative margin on the tail sums Pr[K >= j] of the input pmf (scipy's pmfs are accurate to a
# few ulps; the margin makes the trimmed event dominate despite float round-off).
_TAIL_MARGIN = 1e-9


def check_positive_int(name: str, value, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f'{name} must be an integer >= {minimum}, got {value!r}.')
  return int(value)


def check_sensitivity(value) -> float:
  """1 + η: a finite number >= 1 (the noised sum's L2 sensitivity in units of C)."""
  number = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
  if not (number and math.isfinite(value) and value >= 1):
    raise ValueError(f'sensitivity must be a finite number >= 1 (1 + η), got {value!r}.')
  return float(value)


def check_sampling_probability(value) -> float:
  number = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool)
  if not (number and 0 < value <= 1):
    raise ValueError(f'sampling probability q = b/N must be in (0, 1], got {value!r}.')
  return float(value)


def _check_sizes(num_examples, batch_size) -> tuple[int, int]:
  n = check_positive_int('num_examples N', num_examples)
  b = check_positive_int('batch_size b', batch_size)
  if b > n:
    raise ValueError(f'batch_size b = {b} must be in [1, N = {n}].')
  return n, b


def mixture_of_gaussians_event(
  noise_multiplier: float, sensitivities, pmf, *, tail_mass: float = MOG_TAIL_MASS
) -> dp_event.MixtureOfGaussiansDpEvent:
  """MoG event from a pmf over increasing sensitivities, trimmed so that it still dominates.

  Let K be the component index, T(j) = Pr[K >= j] its tail sums. The event
  built here has tail sums T'(j) >= T(j) for every j (first-order stochastic
  dominance): T' = (1 + 1e-9)·T (a float margin), and the components j >= J,
  J the first index with T'(J) < `tail_mass`, are merged into the *largest*
  sensitivity, which can only raise T'. Float round-off of the telescoped
  probabilities goes to the largest kept component (a deficit: raises T') or
  comes off sensitivity 0 (an excess: no T'(j), j >= 1, changes).

  Why dominance suffices: moving probability mass of the mixture to a larger
  sensitivity can only increase the hockey-stick divergence of the pair
  (Σ p_i N(s_i, σ²), N(0, σ²)) in both directions, for every ε (Ganesh, seed
  004, Lemma 2.9: the mixture with a stochastically larger sensitivity
  dominates), so the trimmed event is an upper bound, and composing it too.

  Args:
    noise_multiplier: σ.
    sensitivities: increasing, the first usually 0.
    pmf: the probabilities of the sensitivities (summing to 1 up to round-off).
    tail_mass: the threshold for merging the tail; keep it << 1e-22 (above).
  """
  sensitivities = np.asarray(sensitivities, dtype=np.float64)
  pmf = np.clip(np.asarray(pmf, dtype=np.float64), 0.0, 1.0)
  tail = np.minimum(1.0, np.cumsum(pmf[::-1])[::-1] * (1 + _TAIL_MARGIN))  # T'(j)
  tail[0] = 1.0
  small = np.nonzero(tail[1:] < tail_mass)[0]
  keep = int(small[0]) + 1 if small.size else len(pmf)  # J: components 0..J-1 kept.
  probs = list(np.append(tail[1:keep], 0.0 if keep == len(pmf) else tail[keep]))
  probs = [float(t - u) for t, u in zip(tail[:keep], probs)]  # T'(j) - T'(j+1)
  sens = [float(x) for x in sensitivities[:keep]]
  if keep < len(pmf) and tail[keep] > 0:
    sens.append(float(sensitivities[-1]))
    probs.append(float(tail[keep]))
  excess = math.fsum(probs) - 1.0
  if excess < 0:
    probs[keep - 1] -= excess
  else:
    probs[0] -= excess
  return dp_event.MixtureOfGaussiansDpEvent(float(noise_multiplier), sens, probs)


def poisson_step_event(
  sampling_probability: float, noise_multiplier: float, *, group_size: int = 1
) -> dp_event.DpEvent:
  """One step of Poisson-subsampled DP-SGD (rate q), untruncated.

  k = 1: `PoissonSampledDpEvent(q, GaussianDpEvent(σ))`. k > 1: MoG with
  sensitivities [0, …, k] and probabilities Binomial(k, q) (Ganesh, Thm 3.1).
  """
  q = check_sampling_probability(sampling_probability)
  sigma = checks.check_noise_multiplier(noise_multiplier)
  k = check_positive_int('group_size k', group_size)
  if k == 1:
    return dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
  counts = np.arange(k + 1)
  return mixture_of_gaussians_event(sigma, counts, stats.binom.pmf(counts, k, q))


def truncated_poisson_step_event(
  dataset_size: int, sampling_probability: float, max_batch_size: int, noise_multiplier: float
) -> dp_event.DpEvent:
  """One step of Poisson sampling truncated to B (a uniform B kept if n > B).

  dp_accounting's `TruncatedSubsampledGaussianDpEvent` (arXiv 2508.15089),
  example-level only. `dataset_size` is the size of the dataset *holding* the
  sensitive example: N for the remove direction and N + 1 for add; the
  accountant evaluates both and keeps the worse.
  """
  n = check_positive_int('dataset_size', dataset_size)
  b_max = check_positive_int('max_batch_size B', max_batch_size)
  return dp_event.TruncatedSubsampledGaussianDpEvent(
    dataset_size=n,
    sampling_probability=check_sampling_probability(sampling_probability),
    truncated_batch_size=b_max,
    noise_multiplier=checks.check_noise_multiplier(noise_multiplier),
  )


def fixed_size_step_event(
  num_examples: int, batch_size: int, noise_multiplier: float, *, group_size: int = 1
) -> dp_event.MixtureOfGaussiansDpEvent:
  """One step of fixed-size sampling without replacement (Ganesh, seed 004, Thm 3.3).

  MoG with sensitivities [0, 2, …, 2k] and probabilities Hypergeometric(N, k, b)
  (the number of the k group members among b draws from N without
  replacement). k = 1: sensitivities [0, 2], probabilities [1 − b/N, b/N].
  """
  n, b = _check_sizes(num_examples, batch_size)
  sigma = checks.check_noise_multiplier(noise_multiplier)
  k = check_positive_int('group_size k', group_size)
  if k > n:
    raise ValueError(f'group_size k = {k} must be in [1, N = {n}].')
  counts = np.arange(min(k, b) + 1)
  pmf = stats.hypergeom.pmf(counts, n, k, b)
  return mixture_of_gaussians_event(sigma, 2 * counts, pmf)


def fixed_size_with_replacement_step_event(
  num_examples: int, batch_size: int, noise_multiplier: float, *, group_size: int = 1
) -> dp_event.MixtureOfGaussiansDpEvent:
  """One step of b uniform draws with replacement: MoG [0, 2, …, 2b], Binomial(b, k/N).

  Why this dominates (add/remove up to k, the argument of Ganesh's Thm 3.3):
  let D' be the smaller dataset and D = D' ∪ G, |G| ≤ k, |D| ≥ N ≥ |D'|. Draw
  the b positions from D' i.i.d. uniformly; draw K ~ Binomial(b, |G|/|D|)
  and replace K of the positions (the first K, by exchangeability of i.i.d.
  draws) by uniform members of G. This is exactly b i.i.d. uniform draws from
  D. Conditioned on the draws from D', the output on D' is one Gaussian and
  on D a mixture over K of Gaussians whose centres move by at most 2K
  (each replaced draw removes a norm-≤1 gradient and adds one). Quasi-convexity
  (Ganesh Lemma 3.2) and the vector-to-scalar reduction (Lemma 2.9) give the
  MoG with sensitivities 2K; Binomial(b, |G|/|D|) is stochastically ≤
  Binomial(b, k/N), which dominates again. Repeated draws of one example count
  with multiplicity, as in the sampler. dp_accounting's RDP accountant does not
  support `SampledWithReplacementDpEvent`, so PLD with this MoG is the bound.
  """
  n, b = _check_sizes(num_examples, batch_size)
  sigma = checks.check_noise_multiplier(noise_multiplier)
  k = check_positive_int('group_size k', group_size)
  if k > n:
    raise ValueError(f'group_size k = {k} must be in [1, N = {n}].')
  counts = np.arange(b + 1)
  return mixture_of_gaussians_event(sigma, 2 * counts, stats.binom.pmf(counts, b, k / n))


def sampled_without_replacement_rdp_event(
  num_examples: int, batch_size: int, noise_multiplier: float
) -> dp_event.DpEvent:
  """Wang-Balle-Kasiviswanathan 2019 baseline (RDP, *replace-one* adjacency).

  Replace-one moves the sum by up to 2C, hence the Gaussian noise multiplier
  σ/2 (docs/accounting.md §7). For comparison only: a different adjacency.
  """
  n, b = _check_sizes(num_examples, batch_size)
  sigma = checks.check_noise_multiplier(noise_multiplier)
  return dp_event.SampledWithoutReplacementDpEvent(n, b, dp_event.GaussianDpEvent(sigma / 2))


def epoch_gaussian_event(
  noise_multiplier: float, *, group_size: int = 1
) -> dp_event.GaussianDpEvent:
  """One epoch in a fixed (deterministic) order: the Gaussian mechanism, sensitivity k.

  Each example is in exactly one batch per epoch; k zeroed examples move the
  concatenated epoch output by at most k in L2 (all in one batch is worst).
  By joint convexity this also bounds shuffle and balls-and-bins (seed 000, §3).
  """
  sigma = checks.check_noise_multiplier(noise_multiplier)
  k = check_positive_int('group_size k', group_size)
  return dp_event.GaussianDpEvent(sigma / k)


def composed(event: dp_event.DpEvent, count: int) -> dp_event.DpEvent:
  """`event` self-composed `count` times (adaptive composition)."""
  count = check_positive_int('count', count)
  return event if count == 1 else dp_event.SelfComposedDpEvent(event, count)
