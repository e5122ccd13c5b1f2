"""What a run leaves in its workdir: checkpoints that carry their ε (verified, atomic, exact
resume), the lock, the run id and secret seed, the audit record and every write's one-line
failure."""
