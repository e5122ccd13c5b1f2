"""Monte-Carlo upper confidence bounds on δ(ε) for balls-and-bins DP-SGD.

Chua et al. 2025, "Balls-and-Bins Sampling for DP-SGD" (AISTATS; seed 000): Algorithm 4
(Monte Carlo + Chernoff–Hoeffding), Algorithm 5 (importance sampling), Algorithm 6
(order-statistics sampling), Appendix B.3 (their combination), Appendix B.4 / Algorithm 11
(multiple epochs). The mathematics is restated in docs/accounting.md §2.

Pair for one epoch of T steps: P = (1/T) Σ_t N(e_t, σ²I_T), Q = N(0, σ²I_T), with privacy loss
L(x) = log((1/T) Σ_t exp((2x_t − 1)/(2σ²))). E epochs: product pair, L_total = Σ_e L(x^(e)).

  δ_{P‖Q}(ε) = E_{x~P}[(1 − e^{ε − L})₊]   ("remove")
  δ_{Q‖P}(ε) = E_{x~Q}[(1 − e^{ε + L})₊]   ("add");   δ(ε) = max of the two.

What is guaranteed. `delta_ucb` and `MonteCarloResult.epsilon` hold with probability ≥ 1 − β
over the sampler's randomness: each direction gets β/2 and a Chernoff–Hoeffding (Bernoulli-KL)
bound on the mean of f ∈ [0, 1]; the union bound covers both. Point estimates are *not*
guarantees. Order statistics replace L by a bound in the pessimistic direction (upper bound
for P‖Q, lower bound for Q‖P), and importance sampling is exact, so both keep the guarantee.
Solving for ε on one sample set is valid because δ⁺(ε) is non-increasing in ε: if the true
ε*(δ) were above the reported ε̂, then δ⁺(ε*) ≤ δ⁺(ε̂) ≤ δ = δ(ε*), i.e. the fixed-ε bound at
ε* failed, which has probability ≤ β.

Importance sampling (Algorithm 5) with one event A per epoch, at a level ε_c ≤ ε:
  P‖Q: A = {max_t x_t ≥ C₁}, C₁ = σ²ε_c/E + 1/2, as L_e ≤ (2 max_t x_t − 1)/(2σ²);
  Q‖P: A = {max_t x_t < C₂}, C₂ = σ²(log T − ε_c/E) + 1/2, as L_e ≥ (2 max_t x_t − 1)/(2σ²) − log T.
For P‖Q, f > 0 ⟹ Σ_e L_e > ε ≥ ε_c ⟹ some L_e > ε_c/E ⟹ some epoch is in A (Q‖P alike with
L_e < −ε_c/E). One epoch (E = 1) this is Algorithm 5 exactly. Several epochs (the paper leaves
this open, Appendix B.4): conditioning epoch 1 on A alone would be wrong, since the epoch that
makes f > 0 can be any. With N = #{e : epoch e in A} (≥ 1 wherever f > 0) and i.i.d. epochs,
E[f] = Σ_e E[f 1_{A_e} / N] = E · Pr(A) · E[f / N | epoch 1 in A]: condition epoch 1 on A, draw
the others unconditioned, and average g = f/N ∈ [0, 1]; the factor E · Pr(A) is `log_scale`.
One conditioned sample set serves every ε ≥ ε_c. `method='auto'` uses it in a direction only
when E · Pr(A) ≤ 1/2 (at E · Pr(A) ≥ 1 it cannot help). Pr(A) is computed in log-space.

Order statistics (Algorithm 6). L depends on x only through S = Σ_t exp(x_t/σ²). For ranks
1 = k_1 < … < k_m of the sorted coordinates we sample x_(k_i) exactly and bound
  S ≤ Σ_i (k_{i+1} − k_i) e^{x_(k_i)/σ²}                  (k_{m+1} = n + 1; docs §2)
  S ≥ e^{x_(k_1)/σ²} + Σ_{i≥2} (k_i − k_{i−1}) e^{x_(k_i)/σ²}
The lower bound credits the k_i − k_{i−1} − 1 unsampled coordinates between two ranks with the
smaller sampled value; it is the docs' bound tightened, and both bounds are exact when every
rank is sampled. The joint law of the uniform order statistics is drawn with the Rényi
representation (k-th smallest of n uniforms = Γ_k/Γ_{n+1}, Γ partial sums of Exp(1)), which is
the same joint law Algorithm 6 builds from its Beta chain, but hands us 1 − U with full relative
precision; normals come from `scipy.special.ndtri_exp` of log U, so the top order statistics of
n = 10⁶ coordinates (U within 1e-6 of 1) lose nothing. Cost O(samples × ranks), independent of T.
The block bounds are pessimistic by roughly the spread of x within a block, which matters when
ε is small (a smaller rank_growth tightens them at a cost linear in the number of ranks).
'auto' therefore samples every coordinate (exact L) for T ≤ 1000 and uses order statistics above.

Parallel execution (one host). The m samples of a direction are cut into chunks of a fixed
size (`SAMPLES_PER_CHUNK`, fewer for wide samples); chunk c of conditioning group g of
direction d draws from its own stream `np.random.SeedSequence(seed, spawn_key=(d, g, c))`
(independent streams, NumPy's spawn tree). A chunk yields its Σ_i f_i (or its losses, for the
ε search); chunks are added in chunk order whatever process computed them. With `workers = n`
the calling process and a `concurrent.futures.ProcessPoolExecutor` of n − 1 processes started
with the 'spawn' method (the caller may have initialised JAX, after which fork is unsafe) claim
chunks from the two ends of a shared counter. The samples, the sums and every bound are
therefore a function of the arguments and the seed alone, bit-for-bit the same for any number
of workers. Merging adds counts (Σ f, m); the confidence bound is computed once, from the
merged sums. Each worker first imports dpjax.privacy.accounting and dp_accounting, so workers
pay off for long runs only. As with any 'spawn' pool, a script calling with workers > 1 needs
the `if __name__ == '__main__':` guard.

Many machines. `balls_and_bins_sums` returns the sufficient statistics (Σ_i f_i(ε), m,
log_scale) of one seed and direction. Run it on each machine with its own seed, e.g. (seed, j)
for machine j (SeedSequence makes these independent streams) and the same other arguments
(with importance sampling, pass one `conditioning_epsilon` so the conditioning agrees), through
any engine (Ray: `ray.get([ray.remote(balls_and_bins_sums).remote(..., seed=(seed, j)) for j in
range(M)])`; Dask, MPI or a job array alike); merge with `HockeyStickSums.merge` and turn the
merged sums into bounds with `delta_from_sums`. Merge sums, never bounds.
"""

from dpjax.utils.lazy_exports import lazy_exports

# Imported on first use: a Monte Carlo worker process imports one submodule, not every accountant.
_EXPORTS = {
  'CONDITIONING_FRACTION': ('dpjax.privacy.accounting.monte_carlo.search', 'CONDITIONING_FRACTION'),
  'HockeyStickSums': ('dpjax.privacy.accounting.monte_carlo.bounds', 'HockeyStickSums'),
  'METHODS': ('dpjax.privacy.accounting.monte_carlo.validation', 'METHODS'),
  'MIN_SAMPLES': ('dpjax.privacy.accounting.monte_carlo.search', 'MIN_SAMPLES'),
  'Method': ('dpjax.privacy.accounting.monte_carlo.validation', 'Method'),
  'MonteCarloResult': ('dpjax.privacy.accounting.monte_carlo.search', 'MonteCarloResult'),
  'SAMPLES_PER_CHUNK': ('dpjax.privacy.accounting.monte_carlo.sampling', 'SAMPLES_PER_CHUNK'),
  'SAMPLES_PER_FLOOR': ('dpjax.privacy.accounting.monte_carlo.search', 'SAMPLES_PER_FLOOR'),
  'SECONDS_PER_COORDINATE': (
    'dpjax.privacy.accounting.monte_carlo.search',
    'SECONDS_PER_COORDINATE',
  ),
  'Seed': ('dpjax.privacy.accounting.monte_carlo.validation', 'Seed'),
  'available_cores': ('dpjax.privacy.accounting.monte_carlo.parallel', 'available_cores'),
  'balls_and_bins_delta': ('dpjax.privacy.accounting.monte_carlo.sums', 'balls_and_bins_delta'),
  'balls_and_bins_epsilon': (
    'dpjax.privacy.accounting.monte_carlo.search',
    'balls_and_bins_epsilon',
  ),
  'balls_and_bins_sums': ('dpjax.privacy.accounting.monte_carlo.sums', 'balls_and_bins_sums'),
  'default_num_samples': ('dpjax.privacy.accounting.monte_carlo.search', 'default_num_samples'),
  'delta_from_sums': ('dpjax.privacy.accounting.monte_carlo.bounds', 'delta_from_sums'),
  'estimated_seconds': ('dpjax.privacy.accounting.monte_carlo.search', 'estimated_seconds'),
  'kl_lower_confidence_bound': (
    'dpjax.privacy.accounting.monte_carlo.bounds',
    'kl_lower_confidence_bound',
  ),
  'kl_upper_confidence_bound': (
    'dpjax.privacy.accounting.monte_carlo.bounds',
    'kl_upper_confidence_bound',
  ),
  'order_statistic_ranks': (
    'dpjax.privacy.accounting.monte_carlo.sampling',
    'order_statistic_ranks',
  ),
  'poisson_delta': ('dpjax.privacy.accounting.monte_carlo.sums', 'poisson_delta'),
  'poisson_sums': ('dpjax.privacy.accounting.monte_carlo.sums', 'poisson_sums'),
}
__all__ = tuple(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
