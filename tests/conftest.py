"""Test-session settings: a shared persistent XLA compilation cache.

Many tests (and the training subprocesses of the resume test) compile the
same small programs; caching them on disk for the session keeps the suite
within its time budget on two CPU cores. Results are unaffected: a cached
executable is the same program.
"""

import os
import tempfile

import jax

_CACHE = os.environ.setdefault(
    'JAX_COMPILATION_CACHE_DIR', os.path.join(tempfile.gettempdir(), 'dpjax-test-xla-cache'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
