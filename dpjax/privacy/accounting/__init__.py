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

from dpjax.privacy.accounting.accountant import ACCOUNTANTS
from dpjax.privacy.accounting.accountant import Accountant
from dpjax.privacy.accounting.report import BOUNDS
from dpjax.privacy.accounting.report import PrivacyReport
from dpjax.privacy.accounting.accountant import resolve_accountant
from dpjax.privacy.accounting.calibration import calibrate_noise_multiplier
from dpjax.privacy.accounting.calibration import max_num_steps
