"""The shared harness of the ghost-clipping tests: a model with every covered layer, inputs, and
the comparison of ghost norms and clipped sums with per-example (vmap) gradients."""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dpjax.privacy import clipping
from dpjax.privacy import rounding
from dpjax.privacy import ghost_clipping
from dpjax.privacy.ghost_clipping.coverage import leaf_paths
from dpjax.models import layers
from dpjax.privacy import losses

K = 3  # Classes.


class AllLayers(nn.Module):
  """Every covered layer type, each on its own branch of a [6, 6, 3] input.

  Shapes exercise both branches of the mixed rule (ghost when
  S·(m + c) < m·c, else materialised): see the comment on each layer.
  """

  @nn.compact
  def __call__(self, x):
    n = x.shape[0]
    seq = x.reshape(n, 6, 18)
    tokens = jnp.floor(jnp.abs(x[:, :, 0, 0]) * 2).astype(jnp.int32)  # Repeats.
    gn_in = nn.Conv(4, (3, 3), strides=2)(x)  # S=9, m=27, c=4: materialised.
    branches = [
      nn.Dense(5)(x.reshape(n, -1)),  # One vector per example: S = 1.
      nn.Dense(16)(seq),  # S=6, m=18, c=16: ghost.
      nn.Dense(2)(seq),  # Materialised.
      nn.DenseGeneral((4, 8))(seq),  # Ghost.
      nn.DenseGeneral(5, axis=(-2, -1))(x),  # Two contracted axes.
      nn.Conv(3, (2, 3), padding='VALID', kernel_dilation=(2, 1))(x),
      nn.Conv(32, (3, 3), strides=3, padding=((1, 0), (2, 1)))(x),  # Ghost.
      nn.Conv(3, (3,), use_bias=False)(seq),  # 1-D.
      nn.Embed(50, 4)(tokens),  # V > S: ghost with [tok_s = tok_s'].
      nn.Embed(3, 4)(tokens % 3),  # V <= S: one-hot, materialised.
      nn.LayerNorm()(seq),
      nn.RMSNorm()(seq),
      nn.GroupNorm(num_groups=2)(gn_in),
      layers.WSConv(4, (3, 3), (2, 2))(x),
    ]
    h = jnp.concatenate([jnp.tanh(b).reshape(n, -1) for b in branches], -1)
    return nn.Dense(K)(h)


def init(model, x, seed):
  """Random parameters from numpy (jax.random in init compiles slowly).

  Kernels N(0, 1/fan_in); scales and gains 1 + N(0, 0.09), so norm layers
  are not at their identity initialisation; other vectors N(0, 0.09).
  """
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x[:1]))['params']
  rng = np.random.default_rng(seed)

  def draw(path, s):
    name = str(getattr(path[-1], 'key', path[-1]))
    if len(s.shape) >= 2:
      return (rng.normal(size=s.shape) / np.sqrt(np.prod(s.shape[:-1]))).astype(np.float32)
    return (float(name in ('scale', 'gain')) + 0.3 * rng.normal(size=s.shape)).astype(np.float32)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def inputs(shape, n, seed, vocab=0):
  rng = np.random.default_rng(seed)
  if vocab:
    x = rng.integers(0, vocab, (n, *shape)).astype(np.int32)
  else:
    x = rng.normal(size=(n, *shape)).astype(np.float32)
  return x, rng.integers(0, K, n).astype(np.int32)


def compare(loss_fn, params, batch, forms=(None,), coverage=None):
  """Per-example ‖g_i‖² per layer both ways, and both clipped sums.

  One vmap pass and one ghost pass per entry of `forms` (None: the rules' own choice; True /
  False: `mixed.forced_form`), each feeding the same clipping code as
  `per_example_clipped_sum` / `ghost_clipped_sum` (one program: halves the compile time; the
  forms share the vmap reference). C is between the middle two finite norms, so about half
  the rows are clipped. `coverage`: the loss's `analyse_coverage` (the forms do not change it),
  given to `ghost_pass` so that it is not traced again per form (None: each pass computes it).
  Returns (want, [(ghost norms, (ghost sum, stats)) per form], (vmap sum, stats)).
  """
  examples, w = clipping.examples_of(batch), batch['weight']
  y = batch['y']
  (losses, aux), grads = jax.vmap(jax.value_and_grad(loss_fn, has_aux=True), in_axes=(None, 0))(
    params, examples
  )
  want = {}
  for path, g in zip(leaf_paths(grads), jax.tree.leaves(grads)):
    key = '/'.join(path if path[0] == 'pos_embedding' else path[:-1])
    want[key] = want.get(key, 0.0) + jnp.sum(jnp.square(g.reshape(len(y), -1)), axis=1)
  total = sum(want.values())
  finite = jnp.sort(jnp.where(jnp.isfinite(total), total, jnp.inf))
  m = jnp.sum(jnp.isfinite(total)) // 2
  clip = jnp.sqrt((finite[m - 1] + finite[m]) / 2)
  ref, ref_rows = clipping._clip_and_sum(
    losses,
    aux,
    total,
    lambda f, keep: jax.tree.map(lambda g: rounding.weighted_row_sum(f, g, keep), grads),
    w,
    clip,
  )
  ghosts = []
  for form in forms:
    with contextlib.nullcontext() if form is None else ghost_clipping.mixed.forced_form(form):
      ghost = ghost_clipping.ghost_pass(loss_fn, params, examples, coverage)
      got, rows = clipping._clip_and_sum(
        ghost.losses, ghost.aux, ghost.sq_norms, ghost.weighted_sum, w, clip
      )
    ghosts.append((ghost.sq_norms_by_path, (got, clipping.ClipStats.of(rows, w, clip))))
  return want, ghosts, (ref, clipping.ClipStats.of(ref_rows, w, clip))


def assert_matches_vmap(model, x, y, num_pad=3, forms=(None,)):
  """Norms and clipped sums equal the vmap path, on a batch with padding
  rows (garbage copies of real rows, weight 0), one NaN and one inf row; in each of `forms`
  (`compare`), all in one program."""
  loss_fn = losses.make_loss_fn(model)
  params = init(model, x, seed=int(np.sum(y)))
  coverage = ghost_clipping.analyse_coverage(loss_fn, params, {'x': x[0], 'y': y[0]})
  assert coverage.complete, coverage.describe()
  n = len(y)
  x = np.concatenate([x, x[:num_pad]])
  floats = x.dtype == np.float32
  if floats:  # Real rows 1, 2 and the first padding row become non-finite.
    x[1].flat[3], x[2].flat[0], x[n].flat[5] = np.nan, np.inf, np.nan
  batch = {
    'x': x,
    'y': np.concatenate([y, y[:num_pad]]),
    'weight': np.r_[np.ones(n), np.zeros(num_pad)].astype(np.float32),
  }
  want, ghosts, (ref, ref_stats) = jax.device_get(  # NumPy: the checks run no eager XLA ops.
    jax.jit(compare, static_argnums=(0, 3, 4))(loss_fn, params, batch, tuple(forms), coverage)
  )
  ok = np.isfinite(sum(want.values()))
  assert np.sum(ok) == n + num_pad - 3 * floats
  for got, (ghost, stats) in ghosts:
    _assert_ghost_matches(want, ok, got, ghost, stats, ref, ref_stats, n, floats)
  return coverage


def _assert_ghost_matches(want, ok, got, ghost, stats, ref, ref_stats, n, floats):
  assert set(got) == set(want)
  for path in want:
    # Never below the per-example gradient's norm; above it by at most the cancellation
    # allowances (mixed.with_allowance, conv.ws_allowance: ~1e-5 relative in float32).
    np.testing.assert_array_less(want[path][ok] * (1 - 2e-5), got[path][ok], err_msg=path)
    np.testing.assert_allclose(got[path][ok], want[path][ok], rtol=2e-4, err_msg=path)
  assert not np.isfinite(sum(got.values())[~ok]).any()
  assert all(np.isfinite(l).all() for l in jax.tree.leaves(ghost))
  scale = max(float(np.max(np.abs(l))) for l in jax.tree.leaves(ref))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale), ghost, ref
  )
  for field in clipping.ClipStats._fields:
    np.testing.assert_allclose(getattr(stats, field), getattr(ref_stats, field), rtol=1e-5)
  assert 0 < int(stats.num_clipped) < n
  assert int(stats.num_nonfinite) == 2 * floats  # Padding is not counted.


class Scaled(nn.Module):
  """A layer ghost clipping has no rule for."""

  @nn.compact
  def __call__(self, x):
    return x * self.param('gain', nn.initializers.ones, (x.shape[-1],))


class Uncovered(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(K)(jnp.tanh(Scaled()(nn.Dense(4)(x))))


def rule_on(module, theta, a, d):
  """One call of `module` through its registered rule: (‖g_i‖² [n], grads, operands) from the
  inputs a [n, *in] and the output gradients d [n, *out] (`backward.layer_norms`)."""
  rule = ghost_clipping.RULES[type(module)]
  in_aval = jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
  out_aval = jax.eval_shape(lambda: module.apply({'params': theta}, a[0]))
  layer = ghost_clipping.Layer(None, rule, module, (), tuple(theta), in_aval, out_aval)
  return jax.jit(lambda t, a, d: ghost_clipping.backward.layer_norms(layer, t, a, d))(theta, a, d)


def float64_grads(module, theta, a, d):
  """Per-example gradients g_i = ∂⟨d_i, module(θ, a_i)⟩/∂θ in float64 (vmap of the layer's own
  vjp, x64 enabled): the reference the rules are held to. Returns ({name: [n, *shape]}, ‖g_i‖²)."""
  with jax.enable_x64(True):
    theta64 = jax.tree.map(lambda t: np.asarray(t, np.float64), theta)
    a64 = np.asarray(a, np.float64) if np.issubdtype(a.dtype, np.floating) else np.asarray(a)

    def one(a_i, d_i):
      _, vjp = jax.vjp(lambda t: module.apply({'params': t}, a_i), theta64)
      return vjp(d_i)[0]

    with jax.default_matmul_precision('highest'):
      grads = jax.jit(jax.vmap(one))(a64, np.asarray(d, np.float64))
    grads = jax.tree.map(np.asarray, grads)
  n = len(a)
  return grads, sum(np.sum(g.reshape(n, -1) ** 2, axis=1) for g in jax.tree.leaves(grads))


def assert_rule_matches_float64(module, theta, a, d, scale=None, rtol=2e-5, reference=None):
  """The rule's norms against float64 per-example gradients: never below them, and above by at
  most the cancellation allowance ε·M + √(2η)·M of `mixed.with_allowance` (M = `scale` [n],
  Σ_s ‖a_s‖‖δ_s‖; None: no allowance, relative rtol only); kept grads and dense operands
  (Σ_i f_i a_iᵀ d_i) equal the reference's (`float64_grads`, computed unless given). Returns
  (got, want)."""
  got, grads, operands = jax.tree.map(np.asarray, rule_on(module, theta, a, d))
  want_grads, want = reference or float64_grads(module, theta, a, d)
  got = got.astype(np.float64)
  assert np.all(got >= want * (1 - rtol)), (got, want)
  eps, eta = ghost_clipping.mixed.cancellation_allowance()
  slack = 0 if scale is None else (eps + np.sqrt(2 * eta)) * np.asarray(scale, np.float64)
  np.testing.assert_array_less(np.sqrt(got), np.sqrt(want) * (1 + rtol) + slack + 1e-30)
  if grads is not None:
    for name, g in grads.items():
      np.testing.assert_allclose(
        g, want_grads[name], rtol=1e-5, atol=1e-6 * np.max(np.abs(want_grads[name])), err_msg=name
      )
  if operands is not None:  # The clipped sum Σ_i f_i g_i of the kernel from the operands.
    a2, d2 = (np.asarray(o, np.float64) for o in operands)
    f = np.linspace(0.1, 1.0, len(a))
    kernel = want_grads['kernel']
    want_sum = np.tensordot(f, kernel.reshape(len(a), a2.shape[-1], -1), axes=1)
    np.testing.assert_allclose(
      np.einsum('n,nsm,nsc->mc', f, a2, d2),
      want_sum,
      rtol=1e-5,
      atol=1e-6 * np.max(np.abs(want_sum)),
    )
  return got, want
