"""The convolution rule: patches and scanned blocks."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from dpjax.privacy import ghost_clipping
from dpjax.privacy.ghost_clipping.backward import layer_norms
from dpjax.privacy.ghost_clipping.conv import patches
from dpjax.models import layers
from tests.privacy.ghost_clipping import harness


def test_patches_times_kernel_is_the_convolution():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 7, 6, 3)).astype(np.float32)
  w = rng.normal(size=(3, 2, 3, 4)).astype(np.float32)
  for strides, padding, dilation in (
    ((1, 1), 'SAME', (1, 1)),
    ((2, 3), 'VALID', (2, 1)),
    ((2, 1), ((1, 2), (0, 1)), (1, 2)),
  ):
    want = jax.lax.conv_general_dilated(
      x, w, strides, padding, rhs_dilation=dilation, dimension_numbers=('NHWC', 'HWIO', 'NHWC')
    )
    p = patches(x, (3, 2), strides, padding, dilation)
    got = (p @ w.reshape(-1, 4)).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_scanned_and_unrolled_conv_blocks_agree(monkeypatch):
  """Large convs visit their kernel offsets with lax.scan (the model tests
  use small convs, which are unrolled): both give the same norms."""
  rng = np.random.default_rng(2)
  cases = [
    (nn.Conv(4, (3, 3)), (9, 9, 3)),  # Materialised.
    (nn.Conv(32, (3, 3), strides=3), (6, 6, 3)),  # Ghost.
    (layers.WSConv(4, (3, 3)), (9, 9, 3)),
    (layers.WSConv(32, (3, 3), (3, 3)), (6, 6, 3)),
  ]
  for module, shape in cases:
    x = rng.normal(size=(3, 1, *shape)).astype(np.float32)
    theta = jax.tree.map(np.asarray, harness.init(module, x[0], seed=2))
    out = jax.eval_shape(lambda: module.apply({'params': theta}, x[0]))
    d = rng.normal(size=(3, *out.shape)).astype(np.float32)
    layer = ghost_clipping.Layer(
      None, ghost_clipping.RULES[type(module)], module, (), tuple(theta), None, None
    )
    sq = {}
    for unroll_bytes in (2**40, 0):
      monkeypatch.setattr(ghost_clipping.conv, '_UNROLL_BYTES', unroll_bytes)
      sq[unroll_bytes] = jax.jit(lambda a, d: layer_norms(layer, theta, a, d)[0])(x, d)
    np.testing.assert_allclose(sq[0], sq[2**40], rtol=1e-5)
