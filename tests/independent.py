"""What a test compares dpjax's numbers with, computed without dpjax.

* ε of Poisson-sampled Gaussian steps: dp_accounting's PLD accountant called directly, with
  the sensitivity C(1 + η) of dpjax's float rounding as the noise multiplier σ/(1 + η).
* η: 1 + η = (1 + m)(1 + α(2B − 1)), written out from dpjax/privacy/rounding.py's docstring
  (Higham 2002, "Accuracy and Stability of Numerical Algorithms", Lemma 3.1, §4.2-4.3) for
  float32 matmuls: m = 2κu/(1 − κu), κ = 8, α = γ_{h+1} + (2u + 8Bu²)(1 + γ_{h+1}),
  h = ⌈log₂ B⌉, γ_n = nu/(1 − nu), u = 2⁻²⁴.
* The ε range of one balls-and-bins epoch from `PLD_accounting` (Feldman & Shenfeld 2025), as
  its public `gaussian_allocation_epsilon_range` computes it, once per process for every file
  that compares with it.
"""

import functools
import math

import PLD_accounting
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from PLD_accounting import adaptive_random_allocation


def float32_eta(max_batch_size: int) -> float:
  """η of a cap B with float32 matmuls (module docstring)."""
  u = 2.0**-24
  margin = 2 * 8 * u / (1 - 8 * u)
  depth = math.ceil(math.log2(max_batch_size)) + 1
  tree = depth * u / (1 - depth * u)
  alpha = tree + (2 * u + 8 * max_batch_size * u * u) * (1 + tree)
  return (1 + margin) * (1 + alpha * (2 * max_batch_size - 1)) - 1


def poisson_gaussian_epsilon(
  q: float, noise_multiplier: float, steps: int, delta: float, eta: float = 0.0
) -> float:
  """ε(δ) of `steps` Poisson-sampled (rate q) Gaussian steps at sensitivity 1 + η."""
  accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
  event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(noise_multiplier / (1 + eta)))
  accountant.compose(event, steps)
  return accountant.get_epsilon(delta)


@functools.cache
def allocation_epsilon_range(sigma: float, steps: int, delta: float):
  """`PLD_accounting.gaussian_allocation_epsilon_range(delta, sigma, steps)`'s one call (its
  whole body): (upper_bound, lower_bound) and the setting it stopped at (discretization,
  tail_truncation, iterations), for one epoch with one selection."""
  params = PLD_accounting.PrivacyParams(
    sigma=sigma, num_steps=steps, num_selected=1, num_epochs=1, delta=delta
  )
  return adaptive_random_allocation.optimize_allocation_epsilon_range(
    params=params, target_accuracy=-1.0, pld_builder=PLD_accounting.gaussian_allocation_pld
  )
