"""The LayerNorm / RMSNorm / GroupNorm rule (`ghost_clipping.normalization`) against float64.

The rule materialises each example's gradient by a vmapped vjp of the layer (a few parameters
per channel). The closed forms it must meet, x̂ the normalised input (Ba et al. 2016, "Layer
Normalization"; Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; Wu & He 2018,
"Group Normalization"): ∂/∂scale = Σ_positions δ ⊙ x̂ and ∂/∂bias = Σ_positions δ, with
x̂ = (x − mean) / √(var + ε) over the features (LayerNorm), over each group's features and
positions (GroupNorm), and x̂ = x / √(mean(x²) + ε) (RMSNorm, no bias).
"""

import flax.linen as nn
import numpy as np
import pytest

from tests.privacy.ghost_clipping import harness

EPS = 1e-6  # flax's default epsilon of all three.


def _normalised(module, x):
  """x̂ in float64 for x [n, *in], by the closed form of each layer."""
  x = np.float64(x)
  if isinstance(module, nn.RMSNorm):
    return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + EPS)
  if isinstance(module, nn.LayerNorm):
    mean = np.mean(x, -1, keepdims=True)
    return (x - mean) / np.sqrt(np.var(x, -1, keepdims=True) + EPS)
  g = module.num_groups  # GroupNorm of one example [1, H, W, C]: stats per group.
  grouped = x.reshape(*x.shape[:-1], g, x.shape[-1] // g)
  axes = tuple(range(2, x.ndim - 1)) + (x.ndim,)
  mean = grouped.mean(axes, keepdims=True)
  var = grouped.var(axes, keepdims=True)
  return ((grouped - mean) / np.sqrt(var + EPS)).reshape(x.shape)


def _closed_form_sq_norms(module, theta, x, d):
  n = len(x)
  sums = lambda v: v.reshape(n, -1, v.shape[-1]).sum(1)
  sq = 0.0
  if 'scale' in theta:
    sq = sq + np.sum(sums(np.float64(d) * _normalised(module, x)) ** 2, 1)
  if 'bias' in theta:
    sq = sq + np.sum(sums(np.float64(d)) ** 2, 1)
  return sq


MODULES = {
  'layer_norm': (nn.LayerNorm(), (5, 8)),
  'layer_norm_scale_only': (nn.LayerNorm(use_bias=False), (5, 8)),
  'rms_norm': (nn.RMSNorm(), (5, 8)),
  'group_norm': (nn.GroupNorm(num_groups=2), (1, 3, 3, 4)),
}


@pytest.mark.parametrize('name', MODULES)
def test_random_and_crafted_rows(name):
  """Rows: (0, 1) random with scales and biases away from 1 and 0, (2) an input constant over
  the features (x̂ = 0 for LayerNorm: ∂/∂scale = 0), (3) row 0's input × 1e4 (the same x̂: the
  same gradient up to ε), (4) a padding row of zero output gradients (exactly 0)."""
  module, shape = MODULES[name]
  rng = np.random.default_rng(5)
  x = rng.normal(size=(5, *shape)).astype(np.float32)
  theta = harness.init(module, x, seed=5)
  d = rng.normal(size=x.shape).astype(np.float32)
  x[2] = 0.5  # Its mean is exact in float32 (0.7 would leave a rounding residue ÷ √ε).
  x[3], d[3] = x[0] * 1e4, d[0]
  d[4] = 0
  got, want = harness.assert_rule_matches_float64(module, theta, x, d)
  np.testing.assert_allclose(want, _closed_form_sq_norms(module, theta, x, d), rtol=1e-9)
  np.testing.assert_allclose(got, want, rtol=2e-5)
  np.testing.assert_allclose(want[3], want[0], rtol=1e-5)  # ε/var: ~2e-6 here.
  assert got[4] == 0
