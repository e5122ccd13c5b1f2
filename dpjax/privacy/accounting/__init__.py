"""Privacy accounting for every dpjax sampler (docs/accounting.md).

```python
acct = Accountant(sampler, noise_multiplier, delta, num_steps=T, max_batch_size=B)
report = acct.epsilon_at(step)    # PrivacyReport: epsilon, delta, bound, epsilon_lower, details
```

Modules: `accountant` (the per-run API), `options` (`AccountingOptions`, how it accounts), `analyses` (one per sampler kind),
`matrix_mechanism` (correlated noise without amplification: one Gaussian of the strategy's
sensitivity), `sampler_events` (dp_accounting events per sampler), `rdp_steps` (RDP of T
steps, one step's curve kept), `fixed_size_rdp` (Birrell et al. FS-RDP), `balls_and_bins` (deterministic and random-allocation bounds,
truncation penalty), `provable_bound` (the balls-and-bins ε attached to a run),
`monte_carlo` (high-probability bound), `max_test` (lower bounds),
`calibration` (σ for a target ε, on `target_search`).
"""

from dpjax.utils.lazy_exports import lazy_exports

# Imported on first use: a Monte Carlo worker process imports one submodule, not every accountant.
_EXPORTS = {
  'ACCOUNTANTS': ('dpjax.privacy.accounting.accountant', 'ACCOUNTANTS'),
  'Accountant': ('dpjax.privacy.accounting.accountant', 'Accountant'),
  'BOUNDS': ('dpjax.privacy.accounting.report', 'BOUNDS'),
  'PrivacyReport': ('dpjax.privacy.accounting.report', 'PrivacyReport'),
  'resolve_accountant': ('dpjax.privacy.accounting.accountant', 'resolve_accountant'),
  'calibrate_noise_multiplier': (
    'dpjax.privacy.accounting.calibration',
    'calibrate_noise_multiplier',
  ),
  'max_num_steps': ('dpjax.privacy.accounting.calibration', 'max_num_steps'),
}
__all__ = tuple(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
