"""The float32 sum's sensitivity: ‖S(D) − S(D∖{i})‖ ≤ C(1 + η), the sensitivity ε pays for.

Each example is clipped at C exactly, but S(D) and S(D∖{i}) are different float32
computations: removing one row shifts every later row to another position and changes the
rounding of every partial sum. The accountant takes the sensitivity C(1 + η)
(`dpjax.privacy.rounding`). Before that (da06065) examples were clipped at
C / ((1 + margin)(1 + sum_margin(B))): 4.9e-3 below C at B = 4,096, 7.2% below when B was
not given (the DP step's default), and the tests below fail there on the clip bound.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpjax
from dpjax.privacy import dp_step
from dpjax.privacy import precision
from dpjax.privacy import rounding

D, N, P, C = 64, 4096, 256, 1.0


class _Linear(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(x)


def _data():
  """Rows whose clipped gradients point nearly the same way: partial sums grow like n·C."""
  rng = np.random.default_rng(0)
  base = 3 * rng.normal(size=D)
  return (base + 0.3 * rng.normal(size=(N, D))).astype(np.float32), np.zeros(N, np.int32)


def _sum(step, params, x, y, p=P):
  """Σ_i w_i clip(g_i) over the rows of x as the DP step accumulates them (K batches of p)."""
  m = len(x)
  k = -(-m // p)
  xp, yp, w = (
    np.zeros((k * p, *x.shape[1:]), np.float32),
    np.zeros(k * p, np.int32),
    np.zeros(k * p, np.float32),
  )
  xp[:m], yp[:m], w[:m] = x, y, 1
  acc = step.init_accumulator(params)
  for j in range(k):
    rows = slice(j * p, (j + 1) * p)
    acc = step.accumulate(params, acc, {'x': xp[rows], 'y': yp[rows], 'weight': w[rows]})
  return np.concatenate([np.asarray(l, np.float64).ravel() for l in jax.tree.leaves(acc.grad_sum)])


@pytest.mark.parametrize('clipping', ['vmap', 'ghost'])
def test_neighbouring_float32_sums_differ_by_at_most_c_one_plus_eta(clipping):
  """b = 4,096 rows in 16 physical batches of 256. Fails on da06065: the step (B not given)
  clipped at 0.9275·C, and with B = 4,096 the neighbours' sums differed by 0.9952·C."""
  x, y = _data()
  model = _Linear()
  params = model.init(jax.random.PRNGKey(0), x[:1])['params']
  step = dp_step.DPStep.for_model(
    model,
    optax.sgd(0.1),
    clip_norm=C,
    noise_multiplier=1.0,
    expected_batch_size=N,
    clipping=clipping,
  )
  assert step.clip_bound == C
  with jax.default_matmul_precision('highest'):  # The same on GPUs (TF32 otherwise).
    full = _sum(step, params, x, y)
    worst = max(
      np.linalg.norm(full - _sum(step, params, np.delete(x, i, 0), np.delete(y, i, 0)))
      for i in (0, 1, 1000, 2047, 3000, N - 2, N - 1)
    )
  eta = rounding.eta(N, precision.matmul_format('highest'))
  assert worst <= C * (1 + eta)
  # Every example is clipped (‖g_i‖ ≫ C), so the exact difference is C: what floating point
  # adds is far below η (measured: ~3e-5 against η = 7.3e-3).
  assert C * (1 - 1e-5) <= worst <= C * (1 + 0.1 * eta)


class _Zero(nn.Module):
  """Dense(2) at zero: on a 1-d input x with label 0 the gradient is exactly
  (−x/2, x/2) for the kernel and (−1/2, 1/2) for the bias."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, kernel_init=nn.initializers.zeros)(x)


def _adversarial_rows(ramp: int = 512, pairs: int = 256, unit: float = 2.0**-15):
  """x ∈ [−1, 1]: `ramp` rows of 1 (norm exactly C = 1 each), then `pairs` pairs (1 − a·u,
  −1 + b·u) built so that, past the ramp, every physical batch of two rows adds 0.55 or −0.45
  ulp of the running kernel sum (rounded up) for D, and 0.45 or −0.55 ulp (rounded down) once
  one ramp row is removed and every later row moves by one position."""
  xs, a = [1.0] * ramp, 0.0
  for _ in range(pairs):
    delta = 141 / 256 if a < 0.9 else 141 / 256 - 1
    xs += [1 - a * unit, -1 + (a + 2 * delta) * unit]
    a = (a + 52 / 256) % 2
  return np.array(xs, np.float32)[:, None]


def test_neighbouring_sums_over_512_physical_batches_differ_by_at_most_c_one_plus_eta():
  """The attack on the sum across physical batches: 1,024 rows in 512 batches of 2, chosen
  so that a plain float32 sum of the batches rounds up for D and down for D minus one row.
  Plain, the neighbours' sums differ by 1.0036·C, above C(1 + η) = 1.0016·C (η of B = 1,024):
  the test fails with Kahan's compensation off (`rounding.kahan_add` as a plain add: checked
  by hand, and below from the same batch sums). Compensated, by exactly C. Fails on da06065:
  0.9275·C (clipped 7.2% below C)."""
  x = _adversarial_rows()
  y = np.zeros(len(x), np.int32)
  model = _Zero()
  params = model.init(jax.random.PRNGKey(0), x[:1])['params']
  step = dp_step.DPStep.for_model(
    model, optax.sgd(0.1), clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=len(x)
  )
  full = _sum(step, params, x, y, p=2)
  drop = [_sum(step, params, np.delete(x, i, 0), y[1:], p=2) for i in (0, 511)]
  worst = max(np.linalg.norm(full - d) for d in drop)
  eta = rounding.eta(len(x), precision.matmul_format('default'))
  assert 1.0 <= worst <= 1 + eta

  # The same batches summed without compensation (the batch sums are exact here: pairs of
  # halves of dyadic numbers): the sensitivity would exceed C(1 + η).
  def plain(rows):
    grads = np.zeros((-(-len(rows) // 2) * 2, 4), np.float32)  # A zero padding row if odd.
    grads[: len(rows)] = np.concatenate([-rows / 2, rows / 2, 0 * rows - 0.5, 0 * rows + 0.5], 1)
    sums = grads.reshape(-1, 2, 4).sum(1)
    return np.cumsum(sums, axis=0, dtype=np.float32)[-1].astype(np.float64)

  # η of the sum alone (float32 rows: on a GPU the 'default' η also holds TF32's matmul margin,
  # which this model has no matmul to need).
  eta_sum = rounding.eta(len(x), 'float32')
  assert np.linalg.norm(plain(x) - plain(np.delete(x, 0, 0))) > 1 + 2 * eta_sum


def test_ten_thousand_rows_summed_as_a_step_sums_them_are_within_the_bound_eta_assumes():
  """10⁴ float32 rows, 100 physical batches of 100 (each `clipped_grad`'s sum, then
  `rounding.kahan_add`) against float64: |Ŝ − S| ≤ α·Σ|x| per coordinate, α = γ_8 + 2u +
  8Ku² (`rounding.sum_error_per_row` of B = 10⁴ is larger). The rows a sequential sum loses: 1,
  then 0.75u's (a gradient equal to the row: loss w·x, C above every norm). Fails on da06065:
  XLA:CPU's dot sums a batch's rows in sequence, which drops the 99 rows after the 1 (74u)."""
  u, p, k = 2.0**-24, 100, 100
  rows = np.full((p * k, 3), 0.75 * u, np.float32)
  rows[0] = 1.0
  rows[:, 1] *= -1
  rows[:, 2] = np.random.default_rng(0).uniform(-1, 1, p * k) / 4
  grad_fn = jax.jit(dpjax.clipped_grad(lambda w, row: jnp.dot(w, row['x']), 2.0, method='vmap'))
  total = compensation = np.zeros(3, np.float32)
  for j in range(k):
    g, _ = grad_fn(
      np.zeros(3, np.float32), {'x': rows[j * p : (j + 1) * p]}, np.ones(p, np.float32)
    )
    total, compensation = rounding.kahan_add(total, compensation, g)
  exact = np.sum(rows.astype(np.float64), axis=0)
  gamma = 8 * u / (1 - 8 * u)  # ⌈log₂ 100⌉ = 7 levels and the product f_i·g_i.
  alpha = gamma + (2 * u + 8 * k * u**2) * (1 + gamma)
  bound = alpha * np.sum(np.abs(rows.astype(np.float64)), axis=0)
  assert np.all(np.abs(np.asarray(total, np.float64) - exact) <= bound)
  assert alpha <= rounding.sum_error_per_row(p * k)
  plain = np.cumsum(rows, axis=0, dtype=np.float32)[-1]  # A sequential float32 sum.
  assert abs(plain[0] - exact[0]) > 100 * bound[0]


def test_eta_is_the_closed_form():
  """1 + η = (1 + m)(1 + α(2B − 1)), α = γ_{⌈log₂B⌉+1} + (2u + 8Bu²)(1 + γ_{⌈log₂B⌉+1}).
  η is new (an ImportError on da06065)."""
  u = 2.0**-24
  for b, fmt in (
    (1, 'float32'),
    (1000, 'float32'),
    (4096, 'float32'),
    (4096, 'tf32'),
    (512, 'bfloat16'),
  ):
    h = int(np.ceil(np.log2(b))) + 1
    gamma = h * u / (1 - h * u)
    alpha = gamma + (2 * u + 8 * b * u**2) * (1 + gamma)
    want = (1 + precision.format_margin(fmt)) * (1 + alpha * (2 * b - 1)) - 1
    assert rounding.eta(b, fmt) == pytest.approx(want, rel=1e-12)
  assert rounding.eta(4096, 'float32') == pytest.approx(7.33e-3, rel=1e-2)
  assert rounding.eta(1000, 'float32') < rounding.eta(1024, 'float32')  # The true B.
  with pytest.raises(ValueError, match='max_batch_size'):
    rounding.eta(0, 'float32')
