"""The privacy core: everything that decides or reports what a DP-SGD step releases.

Samplers, static-shape batching, per-example clipping (`ghost_clipping/`),
the Gaussian mechanism, the step and its multi-step form, precision,
sharding and PRNG streams, the accountants (`accounting/`) and empirical
audits (`auditing/`). Typed arguments only: nothing here reads a config, and
nothing here imports `dpjax.data`, `dpjax.models` or `dpjax.trainer`.
"""
