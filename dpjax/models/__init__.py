"""Models: one module per family (`mlp`, `cnn`, `wrn`, `transformer`, `vit`: the Flax linen
network, its NNX twin where one exists, and its builder from a config's `model` block), the
layers they share (`layers`), NNX models as functions of a parameter dict (`functional`), and
`factory.make_model`, which dispatches over the families. Imports only `dpjax.privacy`."""
