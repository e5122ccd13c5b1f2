"""Tooling of the benchmarks and experiments (not imported by dpjax): what produced a
measurement (`provenance`)."""
