"""jax_privacy's matrix-factorization numbers, written to JSON for dpjax's tests (an oracle only).

jax_privacy is not a dpjax dependency (its pins may not match ours): run this script in a
separate environment, and `tests/privacy/correlated/test_jax_privacy_oracle.py` compares
dpjax's strategies with the JSON it writes:

  python3 -m venv /work/venv_jp && /work/venv_jp/bin/pip install jax-privacy
  /work/venv_jp/bin/python scripts/jax_privacy_oracle.py

It records, for a handful of cases: BandMF (jax_privacy's `optimize_banded_toeplitz`, mean
error on prefix sums) coefficients and loss; Toeplitz min-separation sensitivities and the
dense min-sep upper bound and fixed-epoch sensitivity; loss of a given strategy on a Toeplitz
momentum workload; BLT (`buffered_toeplitz.optimize`, mean error, fixed number of buffers)
parameters, loss, Toeplitz coefficients and the inverse BLT's coefficients. Loss = mean
per-query squared error × sensitivity², i.e. dpjax's expected error at Δ = 1, σ = 1.
"""

import json
import pathlib
import platform
import sys
from importlib import metadata

import jax

jax.config.update('jax_enable_x64', True)

import jax.numpy as jnp
import numpy as np
from jax_privacy.matrix_factorization import buffered_toeplitz
from jax_privacy.matrix_factorization import sensitivity
from jax_privacy.matrix_factorization import toeplitz

OUT = (
  pathlib.Path(__file__).resolve().parents[1] / 'tests/privacy/correlated/jax_privacy_oracle.json'
)
BANDMF_CASES = [(64, 1), (64, 4), (64, 16), (256, 4), (256, 16), (400, 8)]
BLT_CASES = [(64, 2), (256, 2), (256, 3), (400, 4)]
BLT_MINSEP_CASES = [(128, 2, 32, 4)]  # n, buffers, min_sep, participations
SENS_COEFS = {
  'prefix_sqrt_5': [1.0, 0.5, 0.375, 0.3125, 0.2734375],
  'banded_3': [1.0, 0.6, 0.3],
}
SENS_CASES = [(24, 1, 1), (24, 3, 3), (24, 2, 5), (24, 8, 3), (24, None, 4)]


def listed(x):
  return [float(v) for v in np.asarray(x)]


def bandmf_cases():
  out = []
  for n, bands in BANDMF_CASES:
    coef = toeplitz.optimize_banded_toeplitz(n, bands, reduction_fn=jnp.mean)
    out.append(
      {'n': n, 'bands': bands, 'coefs': listed(coef), 'loss': float(toeplitz.loss(coef, n))}
    )
  return out


def sensitivity_cases():
  out = []
  for name, coef in SENS_COEFS.items():
    for n, k, sep in SENS_CASES:
      sens2 = toeplitz.minsep_sensitivity_squared(jnp.array(coef), sep, k, n=n)
      c = toeplitz.materialize_lower_triangular(toeplitz.pad_coefs_to_n(jnp.array(coef), n))
      upper = sensitivity.get_min_sep_sensitivity_upper_bound(c, sep, k)
      case = {'name': name, 'coefs': coef, 'n': n, 'participations': k, 'min_sep': sep}
      case |= {'toeplitz_sensitivity': float(jnp.sqrt(sens2)), 'dense_upper_bound': float(upper)}
      out.append(case)
  for name, coef in SENS_COEFS.items():
    for n, epochs in [(24, 3), (24, 4), (24, 6)]:
      c = toeplitz.materialize_lower_triangular(toeplitz.pad_coefs_to_n(jnp.array(coef), n))
      value = float(sensitivity.fixed_epoch_sensitivity(c, epochs))
      out.append({'name': name, 'coefs': coef, 'n': n, 'epochs': epochs, 'fixed_epoch': value})
  return out


def momentum_cases():
  out = []
  for n, beta in [(32, 0.9), (64, 0.5)]:
    workload = (1 - beta ** np.arange(1, n + 1)) / (1 - beta)  # A[t, s] = Σ_{u=s}^t β^(u−s).
    coef = jnp.array(SENS_COEFS['prefix_sqrt_5'])
    err = toeplitz.per_query_error(strategy_coef=coef, n=n, workload_coef=jnp.array(workload))
    loss = float(jnp.mean(err) * toeplitz.sensitivity_squared(coef, n))
    out.append({'n': n, 'momentum': beta, 'coefs': listed(coef), 'loss': loss})
  return out


def blt_record(blt, n, k=1, sep=None):
  c = blt.toeplitz_coefs(n)
  inv = blt.inverse()
  err = jnp.mean(toeplitz.per_query_error(noising_coef=inv.toeplitz_coefs(n)))
  sens2 = toeplitz.minsep_sensitivity_squared(c, sep or n, k, n=n)
  return {
    'decays': listed(blt.buf_decay),
    'weights': listed(blt.output_scale),
    'coefs': listed(c),
    'inverse_coefs': listed(inv.toeplitz_coefs(n)),
    'loss': float(err * sens2),
  }


def blt_cases():
  out = []
  for n, d in BLT_CASES:
    blt = buffered_toeplitz.optimize(n=n, error='mean', min_buffers=d, max_buffers=d)
    out.append({'n': n, 'buffers': d} | blt_record(blt, n))
  for n, d, sep, k in BLT_MINSEP_CASES:
    blt = buffered_toeplitz.optimize(
      n=n, error='mean', min_sep=sep, max_participations=k, min_buffers=d, max_buffers=d
    )
    case = {'n': n, 'buffers': d, 'min_sep': sep, 'participations': k}
    out.append(case | blt_record(blt, n, k, sep))
  return out


def main():
  result = {
    'jax_privacy_version': metadata.version('jax-privacy'),
    'jax_version': jax.__version__,
    'python': platform.python_version(),
    'command': '/work/venv_jp/bin/python scripts/jax_privacy_oracle.py  '
    '(venv: python3 -m venv /work/venv_jp && /work/venv_jp/bin/pip install jax-privacy)',
    'loss': 'mean per-query squared error on prefix sums (or the given workload) × sensitivity²',
    'bandmf': bandmf_cases(),
    'sensitivity': sensitivity_cases(),
    'momentum': momentum_cases(),
    'blt': blt_cases(),
  }
  OUT.write_text(json.dumps(result, indent=1) + '\n')
  print(f'wrote {OUT}', file=sys.stderr)


if __name__ == '__main__':
  main()
