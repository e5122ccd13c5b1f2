"""Utilities with no privacy content, below every layer: a child interpreter's environment,
lazily imported package attributes."""
