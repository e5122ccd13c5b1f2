"""The Dense and DenseGeneral rules (`ghost_clipping.dense`) against float64 per-example gradients.

g_i = Σ_s a_s δ_sᵀ over the S positions of example i (plus Σ_s δ_s for the bias): the mixed
rule takes ‖g_i‖² by the Gram form Σ_{s,t} (a_s·a_t)(δ_s·δ_t) when S(m + c) < m·c, else
materialises g_i (Bu et al. 2023, "Differentially Private Optimization on Large Model at Small
Cost"); with S > 1 the norm carries the cancellation allowance of `mixed.with_allowance`.
"""

import flax.linen as nn
import numpy as np

from dpjax.privacy import ghost_clipping
from tests.privacy.ghost_clipping import harness


def _case(module, in_shape, n=5, seed=0):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(n, *in_shape)).astype(np.float32)
  theta = harness.init(module, a, seed=seed)  # Negative axes: one example's kernel too.
  out = module.apply({'params': theta}, a[0])
  d = rng.normal(size=(n, *out.shape)).astype(np.float32)
  return theta, a, d


def _scale(a2, d2, bias=True):
  """M = Σ_s ‖(a_s, 1)‖‖δ_s‖ per example (a2 [n, S, m], d2 [n, S, c]), float64."""
  a_norms = np.sqrt(np.sum(np.float64(a2) ** 2, -1) + bias)
  return np.sum(a_norms * np.linalg.norm(np.float64(d2), axis=-1), axis=1)


def test_dense_at_random_states():
  """S = 1 (rank-1), S = 6 with m·c large (ghost by the mixed rule) and small (materialised),
  without bias over two position axes (materialised)."""
  cases = [
    (nn.Dense(5), (12,)),
    (nn.Dense(16), (6, 18)),
    (nn.Dense(2), (6, 18)),
    (nn.Dense(7, use_bias=False), (2, 3, 9)),
  ]
  for module, shape in cases:
    theta, a, d = _case(module, shape)
    a2, d2 = a.reshape(len(a), -1, shape[-1]), d.reshape(len(a), -1, module.features)
    scale = _scale(a2, d2, module.use_bias) if a2.shape[1] > 1 else None
    harness.assert_rule_matches_float64(module, theta, a, d, scale)


def _positions(a, axes):
  """a [n, *in] as [n, S, m]: the contracted axes (of one example) last, as flax orders them."""
  axes = sorted(ax % (a.ndim - 1) + 1 for ax in axes)
  moved = np.moveaxis(a, axes, list(range(a.ndim - len(axes), a.ndim)))
  return moved.reshape(len(a), -1, int(np.prod([a.shape[ax] for ax in axes])))


def test_dense_general_contracting_trailing_and_inner_axes():
  """axis=(-2, -1) into features (4, 2); axis=-2 of a [4, 5, 3] input and axes (-3, -1) (positions
  on both sides of a contracted axis: the rule moves them last, as flax orders the kernel)."""
  for module, shape in (
    (nn.DenseGeneral((4, 2), axis=(-2, -1)), (3, 6)),
    (nn.DenseGeneral(6, axis=-2), (4, 5, 3)),
    (nn.DenseGeneral((3, 2), axis=(-3, -1), use_bias=False), (4, 5, 3)),
  ):
    theta, a, d = _case(module, shape, seed=3)
    axes = module.axis if isinstance(module.axis, tuple) else (module.axis,)
    a2 = _positions(a, axes)
    d2 = d.reshape(len(a), a2.shape[1], -1)
    harness.assert_rule_matches_float64(module, theta, a, d, _scale(a2, d2, module.use_bias))


def test_crafted_states_cancellation_padding_and_scale():
  """Crafted rows of one batch: (0) an input constant over positions with output gradients
  summing to zero (g = 0 exactly: the Gram form cancels, the allowance bounds what is left),
  (1) a zero row (padding: exactly 0), (2) one position only non-zero (rank-1 inside S > 1),
  (3) (2)'s row with inputs × 1e3 and output gradients × 1e-3 (the kernel's gradient of (2),
  the bias's 1e3 times smaller), (4) random."""
  module = nn.Dense(16)  # S = 6, m = 18, c = 16: ghost by the rule.
  theta, a, d = _case(module, (6, 18), n=5, seed=4)
  a[0] = a[0, :1]
  d[0] -= d[0].mean(0)
  a[1], d[1] = 0, 0
  a[2, 1:], d[2, 1:] = 0, 0
  a[3], d[3] = a[2] * 1e3, d[2] * 1e-3
  reference = harness.float64_grads(module, theta, a, d)
  for form in (True, False):
    with ghost_clipping.mixed.forced_form(form):
      got, want = harness.assert_rule_matches_float64(
        module, theta, a, d, _scale(a, d), reference=reference
      )
    assert want[0] < 1e-9 and got[0] < (1e-3 * _scale(a, d)[0]) ** 2, got[0]
    assert got[1] == 0
    np.testing.assert_allclose(got[2:], want[2:], rtol=2e-5)  # No cancellation in these.
