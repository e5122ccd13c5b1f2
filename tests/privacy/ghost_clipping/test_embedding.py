"""The Embed rule (`ghost_clipping.embedding`) against float64 per-example gradients.

Embed is a linear map of one-hot tokens, so a_s·a_t = [tok_s = tok_t] and ‖g_i‖² =
Σ_{s,t} [tok_s = tok_t] δ_s·δ_t (the ghost form, Li et al. 2022, "Large Language Models Can Be
Strong Differentially Private Learners"); with V ≤ T tokens the [V, D] gradient is
materialised instead. The ghost form carries `mixed.with_allowance` with M = Σ_s ‖δ_s‖.
"""

import contextlib

import flax.linen as nn
import numpy as np

from dpjax.privacy import ghost_clipping
from tests.privacy.ghost_clipping import harness

T, D = 6, 4  # Tokens per example, features.


def _case(vocab, tokens, seed=0):
  rng = np.random.default_rng(seed)
  module = nn.Embed(vocab, D)
  theta = {'embedding': rng.normal(size=(vocab, D)).astype(np.float32)}
  d = rng.normal(size=(*tokens.shape, D)).astype(np.float32)
  return module, theta, np.asarray(tokens, np.int32), d


def _scale(d):
  return np.sum(np.linalg.norm(np.float64(d), axis=-1), axis=1)


def test_both_forms_at_random_tokens_with_repeats():
  """V = 50 > T (ghost by the rule) and V = 3 ≤ T (materialised), tokens drawn with repeats;
  each also forced into the other form."""
  rng = np.random.default_rng(1)
  for vocab in (50, 3):
    module, theta, tokens, d = _case(vocab, rng.integers(0, min(vocab, 4), (5, T)))
    reference = harness.float64_grads(module, theta, tokens, d)
    for form in (None, True, False):
      with ghost_clipping.mixed.forced_form(form) if form is not None else contextlib.nullcontext():
        harness.assert_rule_matches_float64(
          module, theta, tokens, d, _scale(d), reference=reference
        )


def test_crafted_tokens():
  """Rows: (0) one token everywhere (g = Σ_s δ_s in one row of the table), (1) a token twice with
  opposite output gradients, the rest zero (g = 0: the ghost form cancels, the allowance
  bounds what is left), (2) all tokens distinct (‖g‖² = Σ_s ‖δ_s‖²), (3) negative tokens
  (-k reads row V - k, as flax's jnp.take does) and (4) a padding row of zero gradients."""
  tokens = np.array([[7] * T, [3, 3, 0, 1, 2, 4], list(range(T)), [-1, -2, 5, 49, -1, 0], [1] * T])
  module, theta, tokens, d = _case(50, tokens, seed=2)
  d[1, 1], d[1, 2:] = -d[1, 0], 0
  d[4] = 0
  reference = harness.float64_grads(module, theta, tokens, d)
  want = reference[1]
  np.testing.assert_allclose(want[0], np.sum(np.sum(np.float64(d[0]), 0) ** 2))
  np.testing.assert_allclose(want[2], np.sum(np.float64(d[2]) ** 2))
  assert want[1] == 0 and want[4] == 0
  for form in (True, False):
    with ghost_clipping.mixed.forced_form(form):
      got, _ = harness.assert_rule_matches_float64(
        module, theta, tokens, d, _scale(d), reference=reference
      )
    assert got[1] < (1e-3 * _scale(d)[1]) ** 2 and got[4] == 0
    np.testing.assert_allclose(got[[0, 2, 3]], want[[0, 2, 3]], rtol=2e-5)


def test_a_vocabulary_of_one_broadcasts_its_row():
  """V = 1: every token reads the one row, so g = Σ_s δ_s."""
  module, theta, tokens, d = _case(1, np.zeros((3, T)), seed=3)
  got, want = harness.assert_rule_matches_float64(module, theta, tokens, d, _scale(d))
  np.testing.assert_allclose(want, np.sum(np.sum(np.float64(d), 1) ** 2, -1))
