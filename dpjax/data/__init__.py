"""Training data: random-access sources (`sources.make_sources` over `digits`, `arrays`: in
memory, npz and memory-mapped .npy, `tfds_source`, `synthetic`; `preprocess`), their content
identity, validation on open, and the logical batch as the compiled step reads it (`device`).
Imports only `dpjax.privacy`."""
