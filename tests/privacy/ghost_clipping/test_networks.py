"""Ghost clipping of dpjax's networks against per-example gradients."""

import ml_collections
import pytest

from dpjax.models import factory as models
from tests.privacy.ghost_clipping import harness


def _config(name, **kw):
  c = models.default_model_config(name)
  c.update(kw)
  return c


MODELS = {
  'mlp': (ml_collections.ConfigDict({'name': 'mlp', 'hidden_sizes': (16,)}), (6, 6, 1), 0),
  'cnn': (models.default_model_config('cnn'), (28, 28, 1), 0),
  # WRN structure (stem, 3 groups with projection shortcuts and strides
  # 1, 2, 2, GroupNorm, weight standardisation) at depth 10, width 1 for
  # compile time; scripts/bench_clipping.py checks WRN-16-4 itself.
  'wrn_10_1': (_config('wrn', depth=10, width=1), (8, 8, 3), 0),
  'transformer_features': (
    _config('transformer', num_layers=1, model_dim=16, mlp_dim=32, num_heads=2),
    (5, 6),
    0,
  ),
  'transformer_tokens': (
    _config('transformer', vocab_size=11, num_layers=1, model_dim=16, mlp_dim=32, num_heads=2),
    (7,),
    11,
  ),
  'vit': (
    _config('vit', patch_size=2, num_layers=1, num_heads=2, width=8, mlp_dim=16),
    (4, 6, 3),
    0,
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(MODELS))
def test_each_model_matches_per_example_gradients(name):
  cfg, shape, vocab = MODELS[name]
  model = models.make_model(cfg, harness.K, shape)
  # 5 real rows and harness's 3 padding rows: 8 in the batch, a power of two, so the tree row
  # sums (rounding.tree_row_sum) add no zero rows (6 + 3: WRN's program compiled in 9.6 s, now
  # 7.0 s). Still 3 finite real rows, two non-finite ones, and about half the rows clipped.
  x, y = harness.inputs(shape, 5, seed=200 + sorted(MODELS).index(name), vocab=vocab)
  coverage = harness.assert_matches_vmap(model, x, y)
  if name.startswith('transformer') or name == 'vit':  # Declared in the model body.
    assert coverage.materialised == (('pos_embedding',),)
  else:
    assert not coverage.materialised
  if name == 'wrn_10_1':
    assert sum(l.rule.name == 'wsconv' for l in coverage.layers) == 10
