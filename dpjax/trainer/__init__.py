"""The trainer: config fields and the resolved plan, the loop, checkpoints, and the
workdir (lock, signals, atomic writes, metrics, the secret seed). The only layer,
with the entry points above it, that reads a config."""
