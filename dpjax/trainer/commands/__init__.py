"""What every `python -m dpjax.*` command shares: config files and one-line errors (`cli`),
SIGINT / SIGTERM handled without a traceback or lost work (`interrupts`)."""
