"""Privacy accounting for every dpjax sampler (docs/accounting.md).

```python
acct = Accountant(sampler, noise_multiplier, delta, num_steps=T, max_batch_size=B)
report = acct.epsilon_at(step)    # PrivacyReport: epsilon, delta, bound, epsilon_lower, details
```

Modules: `accountant` (the per-run API), `sampler_events` (dp_accounting
events per sampler), `fixed_size_rdp` (Birrell et al. FS-RDP),
`balls_and_bins` (provable bound, truncation penalty), `monte_carlo`
(high-probability bound), `max_test` (lower bounds), `calibration`.
"""

from dpjax.accounting.accountant import ACCOUNTANTS
from dpjax.accounting.accountant import Accountant
from dpjax.accounting.accountant import BOUNDS
from dpjax.accounting.accountant import PrivacyReport
from dpjax.accounting.accountant import resolve_accountant
from dpjax.accounting.calibration import calibrate_noise_multiplier
from dpjax.accounting.calibration import max_num_steps
