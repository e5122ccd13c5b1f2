"""The blocks of a training config, one module each: their fields declared with `Field`.

`dpjax.trainer.configuration.config_fields` assembles them, in this order, into `FIELDS`, the one table
of every field (docs/config.md).

"""
