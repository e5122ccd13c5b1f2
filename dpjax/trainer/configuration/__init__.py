"""Every field of a training config, declared once: its type, valid range, default and meaning
(`config_fields.FIELDS`, assembled from one module per block in `blocks/`), and the settings
that change only speed (`perf`)."""
