"""Every covered layer type (dense, conv, embedding, normalisation, WSConv) against per-example gradients, in both forms of the mixed rule."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.privacy import ghost_clipping
from dpjax.privacy.ghost_clipping.mixed import Blocks
from dpjax.privacy.ghost_clipping.mixed import linear_sq_norm
from dpjax.privacy.ghost_clipping.mixed import use_ghost
from dpjax.privacy import losses
from tests.privacy.ghost_clipping import harness


# The form each harness.AllLayers call takes by the mixed rule (its shapes; see the comments there).
ALL_LAYERS_FORMS = [
  'Conv_0: conv materialised (S=9, m=27, c=4)',
  'Dense_0: dense rank-1 (S=1, m=108, c=5)',
  'Dense_1: dense ghost (S=6, m=18, c=16)',
  'Dense_2: dense materialised (S=6, m=18, c=2)',
  'DenseGeneral_0: dense_general ghost (S=6, m=18, c=32)',
  'DenseGeneral_1: dense_general materialised (S=6, m=18, c=5)',
  'Conv_1: conv materialised (S=16, m=18, c=3)',
  'Conv_2: conv ghost (S=6, m=27, c=32)',
  'Conv_3: conv materialised (S=6, m=54, c=3)',
  'Embed_0: embed ghost (T=6 tokens, V=50, D=4)',
  'Embed_1: embed materialised (T=6 tokens, V=3, D=4)',
  'LayerNorm_0: norm per-example vjp',
  'RMSNorm_0: norm per-example vjp',
  'GroupNorm_0: norm per-example vjp',
  'WSConv_0: wsconv materialised (S=9, m=27, c=4)',
  'Dense_3: dense rank-1 (S=1, m=929, c=3)',
]


def test_layer_forms_follow_the_mixed_rule_from_each_calls_shapes():
  x, y = harness.inputs((6, 6, 3), 7, seed=100)
  model = harness.AllLayers()
  coverage = ghost_clipping.analyse_coverage(
    losses.make_loss_fn(model), harness.init(model, x, seed=1), {'x': x[0], 'y': y[0]}
  )
  assert coverage.layer_forms() == ALL_LAYERS_FORMS
  for line in ALL_LAYERS_FORMS:  # The logged choice is the rule's: S(m + c) < m·c.
    if match := re.search(r'(ghost|materialised) \(S=(\d+), m=(\d+), c=(\d+)\)', line):
      s, m, c = map(int, match.groups()[1:])
      assert (match[1] == 'ghost') == (s * (m + c) < m * c), line


@pytest.mark.slow
def test_ghost_and_materialised_forms_give_the_same_clipped_sum_for_every_layer():
  """Each layer forced to one form of the mixed rule (and Embed's): norms and clipped
  sums still equal the per-example gradients', and the logged forms say so.

  Every layer type is covered, each in both forms: the mixed rule picks one of the two per
  layer (ALL_LAYERS_FORMS), so a third program under the mixed rule was dropped (15 s cold);
  the mixed program itself runs in test_precision's and test_train_augmult's all_layers steps.
  Both forced forms are compared in one program with one vmap reference (they were two
  parametrised cases, [all_ghost] and [all_materialised], each tracing and compiling the
  reference again)."""
  x, y = harness.inputs((6, 6, 3), 7, seed=100)
  coverage = harness.assert_matches_vmap(harness.AllLayers(), x, y, forms=(True, False))
  assert {l.rule for l in coverage.layers} == set(ghost_clipping.RULES.values())
  assert not coverage.materialised
  assert len(coverage.layers) == 16
  assert coverage.layer_forms() == ALL_LAYERS_FORMS  # The mixed rule outside a forced form.
  for ghost in (True, False):
    with ghost_clipping.mixed.forced_form(ghost):
      forms = coverage.layer_forms()
    want = 'ghost' if ghost else 'materialised'
    for line in forms:
      name, rule, form = line.split(' ', 2)
      if rule == 'norm':  # One form: a vjp of the layer per example.
        assert form == 'per-example vjp', line
      else:  # S = 1: ‖a‖²‖δ‖², exact in both forms.
        assert form.startswith('rank-1' if '(S=1,' in form else want), line


def test_linear_rule_both_branches_equal_the_frobenius_norm():
  rng = np.random.default_rng(1)
  branches = set()
  for s, m, c in ((1, 5, 4), (3, 20, 30), (40, 3, 2)):
    a = rng.normal(size=(4, s, m)).astype(np.float32)
    d = rng.normal(size=(4, s, c)).astype(np.float32)
    blocks = Blocks(lambda k: jnp.asarray(a), 1, m)
    sq, _ = linear_sq_norm(blocks, jnp.asarray(d))
    want = np.sum(np.einsum('nsm,nsc->nmc', a.astype(np.float64), d) ** 2, axis=(1, 2))
    np.testing.assert_allclose(sq, want, rtol=1e-5)
    branches.add(use_ghost(s, m, c))
  assert branches == {True, False}
