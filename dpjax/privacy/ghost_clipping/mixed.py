"""The mixed ghost / materialised norm of a linear map (Bu et al. 2022), shared by the rules.

A layer z = a·W + b at S positions of one example has g_i = a_iᵀ δ_i and
‖g_i‖² = Σ_{s,s'} (a_s·a_s')(δ_s·δ_s') (ghost, cost S²(m + c)) = ‖a_iᵀ δ_i‖²_F
(materialised, cost S·m·c); `use_ghost` picks the cheaper from the shapes.
`forced_form` overrides every rule's choice (tests and benchmarks compare the
two forms with it); `chosen_forms` overrides it layer by layer (the measured choice of
`form_timing`), read while `layer_scope` names the layer whose rule is traced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dpjax.privacy import precision
from dpjax.privacy import rounding

HIGHEST = jax.lax.Precision.HIGHEST


_forced: bool | None = None  # Set by `forced_form`: every choice is this (True: ghost).
_chosen: dict = {}  # Set by `chosen_forms`: layer key -> True (ghost) / False.
_layer = None  # Set by `layer_scope`: the key of the layer whose rule is being traced.


def forced_ghost() -> bool | None:
  """The form imposed on the layer traced now (True: ghost, False: materialised), or None
  (the FLOP rule decides): `forced_form`'s, else `chosen_forms`' for the `layer_scope`."""
  return _chosen.get(_layer) if _forced is None else _forced


@contextlib.contextmanager
def chosen_forms(table: dict) -> Iterator[None]:
  """While tracing inside: the layer whose key is in `table` (see `layer_scope`) takes the
  form it names (True: ghost, False: materialised); other layers follow the FLOP rule."""
  global _chosen
  saved, _chosen = _chosen, dict(table)
  try:
    yield
  finally:
    _chosen = saved


@contextlib.contextmanager
def layer_scope(key) -> Iterator[None]:
  """While inside: the rules traced are those of the layer `key` (for `chosen_forms`)."""
  global _layer
  saved, _layer = _layer, key
  try:
    yield
  finally:
    _layer = saved


@contextlib.contextmanager
def forced_form(ghost: bool) -> Iterator[None]:
  """While tracing inside: every rule that chooses between a ghost and a materialised form
  (the mixed rule, Embed's) takes the ghost one (True) or the materialised one (False)."""
  global _forced
  saved, _forced = _forced, bool(ghost)
  try:
    yield
  finally:
    _forced = saved


def use_ghost(s: int, m: int, c: int) -> bool:
  """Mixed rule: ghost form S²(m + c) cheaper than materialising S·m·c (or `forced_ghost`)."""
  forced = forced_ghost()
  return s * (m + c) < m * c if forced is None else forced


def linear_form(s: int, m: int, c: int, rank_one: bool = True) -> str:
  """The form `linear_sq_norm` takes for S positions, m inputs, c outputs (for logs);
  rank_one=False for rules without the S = 1 shortcut."""
  form = 'rank-1' if rank_one and s == 1 else 'ghost' if use_ghost(s, m, c) else 'materialised'
  return f'{form} (S={s}, m={m}, c={c})'


class Blocks(NamedTuple):
  """Column blocks of a layer's input matrix a [n, S, count·width].

  A dense layer has one block (a itself); a convolution has one per kernel
  offset (the input shifted by the offset, strided), whose concatenation is
  the patches matrix in the HWIO kernel's feature order. `get(k)` returns
  block k [n, S, width] for a traced k, so the blocks are visited by a scan
  and the patches (prod(kernel) x the input) never exist in memory.
  """

  get: Callable[[jax.Array | int], jax.Array]
  count: int
  width: int
  unroll: bool = True  # Python loop (fast for small blocks) or lax.scan.


def scan_blocks(blocks: Blocks, body, init):
  """Scan of body(carry, block_k, k) -> (carry, y) over the blocks."""
  if blocks.unroll:
    carry, ys = init, []
    for k in range(blocks.count):
      carry, y = body(carry, blocks.get(k), k)
      ys.append(y)
    return carry, jax.tree.map(lambda *v: jnp.stack(v), *ys)
  return jax.lax.scan(lambda c, k: body(c, blocks.get(k), k), init, jnp.arange(blocks.count))


def _stack_rows(ys: jax.Array) -> jax.Array:
  """Per-block gradients [K, n, width, c] -> [n, K·width, c] (kernel order)."""
  k, n, w, c = ys.shape
  return jnp.moveaxis(ys, 0, 1).reshape(n, k * w, c)


def linear_sq_norm(blocks: Blocks, d: jax.Array):
  """‖a_iᵀ d_i‖²_F [n] for a given by `blocks`, d: [n, S, c] (mixed rule).

  Returns (squared norms, the per-example gradients [n, m, c] if they were
  materialised, else None).
  """
  n, s, c = d.shape
  m = blocks.count * blocks.width
  if s == 1:
    a_sq, _ = scan_blocks(
      blocks, lambda t, b, k: (t + jnp.sum(jnp.square(b), axis=(1, 2)), None), jnp.zeros(n)
    )
    return a_sq * jnp.sum(jnp.square(d), axis=(1, 2)), None
  if use_ghost(s, m, c):
    gram, _ = scan_blocks(
      blocks,
      lambda t, b, k: (t + jnp.einsum('nsm,ntm->nst', b, b, precision=HIGHEST), None),
      jnp.zeros((n, s, s)),
    )
    gd = jnp.einsum('nsc,ntc->nst', d, d, precision=HIGHEST)
    return jnp.sum(gram * gd, axis=(1, 2)), None
  g = per_example_grads(blocks, d)
  return jnp.sum(jnp.square(g), axis=(1, 2)), g


def per_example_grads(blocks: Blocks, d: jax.Array) -> jax.Array:
  """The per-example gradients a_iᵀ d_i [n, m, c] (materialised)."""
  if blocks.unroll and blocks.count > 1:
    # Blocks stacked on a new axis [n, K, S, width]: one batched matmul over
    # S, no concatenation along the (often 1-wide) channel axis, which is
    # slow on the CPU.
    a3 = jnp.stack([blocks.get(k) for k in range(blocks.count)], axis=1)
    g = jnp.einsum('nksw,nsc->nkwc', a3, d, precision=HIGHEST)
    return g.reshape(d.shape[0], -1, d.shape[-1])
  _, gs = scan_blocks(
    blocks, lambda t, b, k: (t, jnp.einsum('nsm,nsc->nmc', b, d, precision=HIGHEST)), 0
  )
  return _stack_rows(gs)


def cancellation_allowance() -> tuple[float, float]:
  """(ε, η) for g = Σ_s a_s δ_sᵀ and M = Σ_s ‖a_s‖‖δ_s‖ (Higham 2002, §3.1: a dot product's
  rounding error scales with Σ|x_k y_k|, not with its result).

  The book-kept sum adds g to within ε·M (its operands rounded to the traced matmul format u,
  `precision.traced_matmul_format`, and accumulated in float32), and the norm's ‖g‖² (float32,
  HIGHEST) is within η·M² of the exact one: ε = KAPPA(u + 2u₃₂), η = KAPPA·u₃₂.
  """
  u = precision.UNIT_ROUNDOFF[precision.traced_matmul_format(jnp.float32)]
  u32 = precision.UNIT_ROUNDOFF['float32']
  return precision.KAPPA * (u + 2 * u32), precision.KAPPA * u32


def with_allowance(sq: jax.Array, scale: jax.Array) -> jax.Array:
  """(√(max(sq, 0) + η M²) + ε M)² with M = `scale` [n]: never below the squared norm of what
  the book-kept sum adds, however much g = Σ_s a_s δ_sᵀ cancels (‖g‖ ≪ M: e.g. an input nearly
  constant over positions and output gradients summing to zero, as an attention key
  projection's). Over-clips by a relative ~ε·M/‖g‖ otherwise. NaN stays NaN."""
  eps, eta = cancellation_allowance()
  return jnp.square(jnp.sqrt(jnp.maximum(sq, 0.0) + eta * jnp.square(scale)) + eps * scale)


def exact_rows(mask: jax.Array, row_value, shape, sum_factor: jax.Array | None = None):
  """Per-example values of the rows in `mask`, computed one example at a time.

  For the rows whose ghost bound is loose (its allowance a large share of the norm): a scan
  over the rows calls `row_value(i)` (an array of `shape`) for those only, and is skipped
  entirely when no row is in `mask`. Each row's path depends on that row alone, so a
  neighbouring dataset changes no other row's contribution. Returns ‖row_value(i)‖² [n]
  (0 outside `mask`), or with `sum_factor` [n] (0 where a row must not count) the
  compensated sum Σ_{i ∈ mask} factor_i·row_value(i) (`rounding.kahan_add`).
  """
  n, zero = mask.shape[0], jnp.zeros(shape, jnp.float32)
  if sum_factor is None:
    step = lambda carry, i: (
      carry,
      jax.lax.cond(mask[i], lambda: jnp.sum(jnp.square(row_value(i))), lambda: jnp.zeros(())),
    )
    run = lambda: jax.lax.scan(step, 0, jnp.arange(n))[1]
    return jax.lax.cond(jnp.any(mask), run, lambda: jnp.zeros((n,)))
  take = mask & (sum_factor != 0)
  step = lambda carry, i: (
    jax.lax.cond(
      take[i], lambda: rounding.kahan_add(*carry, sum_factor[i] * row_value(i)), lambda: carry
    ),
    None,
  )
  run = lambda: jax.lax.scan(step, (zero, zero), jnp.arange(n))[0][0]
  return jax.lax.cond(jnp.any(take), run, lambda: zero)


def _position_norms(blocks: Blocks, n: int, s: int) -> jax.Array:
  """‖a_s‖ [n, S] of the input rows (over every block)."""
  a_sq, _ = scan_blocks(
    blocks, lambda t, b, k: (t + jnp.sum(jnp.square(b), axis=-1), None), jnp.zeros((n, s))
  )
  return a_sq


def linear_norms(
  theta: dict,
  a: jax.Array,
  d: jax.Array,
  blocks: Blocks,
  d2: jax.Array,
  *,
  keep_small_grads: bool = False,
):
  """(‖g_i‖² [n], grads, operands) of a linear layer with input blocks and d2 [n, S, c].

  keep_small_grads: return materialised per-example gradients for the clipped
  sum when they are no larger than the input and output gradient they replace
  (convolutions): norm and sum then use the same tensors. Otherwise the clipped
  sum is the matmul a2ᵀ(f·d2) of the operands (one block), or the layer's own
  weight-gradient vjp (operands None), and with S > 1 positions the norm gets the
  cancellation allowance of `with_allowance` (the bias as an input of constant 1).
  """
  n, s, _ = d2.shape
  has_bias = 'bias' in theta
  bias = jnp.sum(d2, axis=1)  # [n, c].
  sq = jnp.sum(jnp.square(bias), axis=1) * has_bias
  kernel_sq, g = linear_sq_norm(blocks, d2)
  sq = sq + kernel_sq
  if keep_small_grads and g is not None and theta['kernel'].size <= a[0].size + d[0].size:
    grads = {'kernel': g.reshape(n, *theta['kernel'].shape)}
    if has_bias:
      grads['bias'] = bias.reshape(n, *theta['bias'].shape)
    return sq, grads, None
  if s > 1:  # S = 1: ‖g‖ = ‖a‖‖δ‖, no cancellation (the precision margin covers it).
    a_norms = jnp.sqrt(_position_norms(blocks, n, s) + has_bias)
    sq = with_allowance(sq, jnp.sum(a_norms * jnp.linalg.norm(d2, axis=-1), axis=1))
  return sq, None, (blocks.get(0), d2) if blocks.count == 1 else None
