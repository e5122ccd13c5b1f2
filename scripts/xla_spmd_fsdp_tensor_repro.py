"""Minimal repro (jax/jaxlib 0.10.2, CPU, 8 forced devices): a wrong result from XLA's SPMD
partitioner, Shardy and GSPMD alike, no dpjax involved.

  x [128, 8] split over ('data', 'fsdp'); w0 [8, 64] P(None, 'tensor') (column-parallel);
  w1 [128, 64] P('tensor', 'fsdp') (row-parallel AND fsdp on its other dim); w3 replicated.
  x @ w0 + (x @ w3) @ w1 differs from the 1-device value by ~110 % (max relative).

Correct: mesh (1, 2, 2); x split over 'fsdp' only or replicated; w1 P('tensor', None),
P(None, 'fsdp'), P(('fsdp', 'tensor'), None); w0 replicated. dpjax's workaround
(param_sharding.parameter_spec): a tensor-parallel array puts 'fsdp' on the SAME dimension as
'tensor' (('fsdp', 'tensor')), never on another one.
Run: python scripts/xla_spmd_fsdp_tensor_repro.py [0 = GSPMD]
"""

import os
import sys

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

if len(sys.argv) > 1:
  jax.config.update('jax_use_shardy_partitioner', sys.argv[1] == '1')
jax.config.update('jax_default_matmul_precision', 'highest')
rng = np.random.default_rng(0)
w0 = rng.normal(size=(8, 64)).astype(np.float32)
w1 = rng.normal(size=(128, 64)).astype(np.float32)
w3 = rng.normal(size=(8, 128)).astype(np.float32)
x = rng.normal(size=(128, 8)).astype(np.float32)
f = lambda w0, w1, w3, x: x @ w0 + (x @ w3) @ w1
ref = f(w0, w1, w3, x)
mesh = jax.make_mesh(
  (2, 2, 2), ('data', 'fsdp', 'tensor'), axis_types=(jax.sharding.AxisType.Auto,) * 3
)
for s0, s1 in [
  (P(None, 'tensor'), P('tensor', 'fsdp')),  # Wrong.
  (P(), P('tensor', 'fsdp')),  # Right.
  (P(None, 'tensor'), P('tensor', None)),  # Right.
  (P(None, 'tensor'), P(('fsdp', 'tensor'), None)),  # Right (dpjax's placement).
]:
  specs = (s0, s1, P(), P(('data', 'fsdp')))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((w0, w1, w3, x), specs)]
  out = np.asarray(jax.jit(f)(*args))
  print(s0, s1, 'max relative error', float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))))
