"""Correlated noise: matrix-factorization strategies (DP-FTRL, BandMF, BLT) as float64 NumPy.

The mechanism releases X + C⁻¹Z for a lower-triangular strategy C (docs/accounting.md §9).
Modules: `toeplitz` (Toeplitz C from its coefficients, C⁻¹ as a stream), `sensitivity` (Δ of
X ↦ CX for the samplers' participation patterns), `workloads` (the linear map from noisy
gradients to iterates: prefix sums, momentum and learning rates), `expected_error` (the
squared error of the released iterates), `bandmf` (banded Toeplitz strategies, optimised) and
`blt` (buffered linear Toeplitz strategies, optimised), and `strategy` (one typed `Strategy`:
what the privatizer runs and the accountant reads). Nothing here imports jax or the trainer
(`Strategy.privatizer` imports `dpjax.privacy.correlated_noise` when called).
"""
