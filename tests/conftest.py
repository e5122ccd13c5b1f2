"""Test-session settings: a shared persistent XLA compilation cache, XLA's backend optimisation
off on the CPU, setup shared by workers.

Many tests (and the training subprocesses of the resume test) compile the
same small programs; caching them on disk for the session keeps the suite
within its time budget on two CPU cores. Results are unaffected: a cached
executable is the same program.

Each test gets its own seed record (`DPJAX_STATE_DIR`, `dpjax.trainer.workdir.seed_record`): the
suite's many runs with seed 0 never touch the user's home and never trip each other; a test
that reuses a seed within itself sees what a user would.

The `shared_setup` fixture builds an expensive, read-only setup (finished runs, a workdir)
once per test session even under pytest-xdist, where each worker would otherwise run a
module-scoped fixture again for its share of the module's tests. `in_process_pld_builds`
builds balls-and-bins PLDs without starting an interpreter for each.
"""

import contextlib
import fcntl
import functools
import gc
import hashlib
import os
import pathlib
import pickle
import shutil
import sys
import tempfile

# One BLAS thread per process (set before numpy loads; children inherit it): the suite runs
# several workers on two cores, where OpenBLAS's threads spin for small products (a 40k-term dot
# product of the max test cost 8 ms of CPU instead of 0.015 ms).
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')
# Bytecode is written (and read) in __pycache__ even where PYTHONDONTWRITEBYTECODE is set (as on
# the CI box): otherwise each worker compiles every dpjax module and rewrites every test module's
# asserts anew (collection 11 s -> 6 s of CPU per worker), and each child process compiles the
# dpjax modules it imports (~0.4 s each). The files are the interpreter's own cache, ignored by git.
sys.dont_write_bytecode = False
os.environ.pop('PYTHONDONTWRITEBYTECODE', None)

import jax
import pytest

_CACHE = os.environ.setdefault(
  'JAX_COMPILATION_CACHE_DIR', os.path.join(tempfile.gettempdir(), 'dpjax-test-xla-cache')
)
# dpjax's own caches (the trainer's XLA cache, random-allocation PLDs) are the session's too:
# never the user's ~/.cache/dpjax, whose contents would make a cold suite partly warm. A
# `dpjax.train` child then loads the programs this session already compiled.
os.environ.setdefault('DPJAX_CACHE_DIR', _CACHE)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
# The suite's programs are tiny and run a few times each: compiling them takes far more CPU than
# running them. On the CPU, XLA's LLVM optimisation passes are off for them (a cold compilation
# cache: -40% on the compile-heavy files), fusions are emitted by the elemental emitters rather
# than the MLIR fusion emitters (-43% compile time on the WRN ghost test and the CNN augmult step,
# Nov 27), and each module is compiled in one piece rather than split over threads (the workers
# already fill the cores). None of this changes a program, only its machine code (float results
# may differ in the last bits, as on another CPU; runs compared bit for bit both use it).
# Subprocesses inherit it through XLA_FLAGS. A GPU run (JAX_PLATFORMS=cuda) keeps the defaults.
_CPU_COMPILE_FLAGS = (
  '--xla_backend_optimization_level=0',
  '--xla_cpu_use_fusion_emitters=false',
  '--xla_cpu_parallel_codegen_split_count=1',
)
if os.environ.get('JAX_PLATFORMS', 'cpu') == 'cpu':
  os.environ['XLA_FLAGS'] = ' '.join([os.environ.get('XLA_FLAGS', ''), *_CPU_COMPILE_FLAGS]).strip()
# Tracing allocates many small objects: at Python's default threshold (700) the cyclic garbage
# collector runs every few hundred allocations and, every hundred runs, walks the whole heap
# (jax, flax and every traced program). At 50 000, and with what imports and collection built
# frozen out of those walks (`pytest_collection_finish`), trace-heavy files take 5% less CPU
# (test_networks + test_precision + test_dp_step, cold, -n 0: 93.8 -> 88.4 s, Nov 27). Cyclic
# garbage is still collected, in fewer passes; nothing a test computes changes.
gc.set_threshold(50_000, 20, 20)
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


# Until a test sets its own (below), and for anything run outside a test: never the real home.
_SESSION_STATE = tempfile.mkdtemp(prefix='dpjax-test-state-')
os.environ['DPJAX_STATE_DIR'] = os.path.join(_SESSION_STATE, 'session')


@pytest.fixture(autouse=True)
def private_seed_record(request, monkeypatch):
  """This test's own seed record (created only if a run writes to it)."""
  key = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
  monkeypatch.setenv('DPJAX_STATE_DIR', os.path.join(_SESSION_STATE, key))


def shared_directory(tmp_path_factory, name: str, build) -> str:
  """A directory that `build(path)` fills once per test session, for every pytest-xdist worker.

  The first worker to ask builds it under a lock; the others wait and reuse it. Tests must only
  read it (copy it to change anything). A failed build leaves nothing behind: the next worker
  builds again and fails the same way in its own tests.
  """
  base = tmp_path_factory.getbasetemp()
  root = base.parent if os.environ.get('PYTEST_XDIST_WORKER') else base  # The session's root.
  path, done = root / f'shared-{name}', root / f'shared-{name}.done'
  with open(root / f'shared-{name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      if not done.exists():
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir()
        try:
          build(path)
        except BaseException:
          shutil.rmtree(path, ignore_errors=True)
          raise
        done.touch()
    finally:
      with contextlib.suppress(OSError):
        fcntl.flock(lock, fcntl.LOCK_UN)
  return str(path)


@pytest.fixture(scope='session')
def shared_setup(tmp_path_factory):
  """`shared_setup(name, build)`: the path of `shared_directory` `name`, built by `build`."""
  return functools.partial(shared_directory, tmp_path_factory)


def shared_run(tmp_path_factory, name: str, run) -> tuple[pathlib.Path, object]:
  """(workdir, result): `result = run(workdir)` (a training, child processes) once per test
  session for every pytest-xdist worker (`shared_directory`: xdist hands a module's tests to all
  its workers, and a module-scoped fixture would run again on each). The result, on the host, is
  kept in a pickle beside the workdir; tests only read the workdir (copy it to change it)."""

  def build(path):
    result = run(path / 'run')
    with open(path / 'result.pkl', 'wb') as f:
      pickle.dump(jax.device_get(result), f)

  root = pathlib.Path(shared_directory(tmp_path_factory, name, build))
  with open(root / 'result.pkl', 'rb') as f:
    return root / 'run', pickle.load(f)


@pytest.fixture(scope='session')
def shared_result(tmp_path_factory):
  """`shared_result(name, run)`: `shared_run`'s (workdir, result) of `run(workdir)`."""
  return functools.partial(shared_run, tmp_path_factory)


@pytest.fixture(scope='session')
def reference_run(shared_result):
  """(workdir, result) of one uninterrupted run of tests/run_configs.small_config() (6 steps),
  trained once per session and read by the tests that compare with it."""
  from dpjax import train  # pylint: disable=import-outside-toplevel
  from tests.run_configs import small_config  # pylint: disable=import-outside-toplevel

  return shared_result('reference', lambda w: train.train_and_evaluate(small_config(), str(w)))


@pytest.fixture
def in_process_pld_builds(monkeypatch):
  """Random-allocation PLDs built in this process, not in a child interpreter.

  dpjax builds each one-epoch PLD in a child `python -m dpjax.privacy.accounting.random_allocation
  σ T grid tail bound out.npz` (killable at its time budget) whose interpreter start costs
  ~3 s of CPU, far more than the builds of the small T used in tests. Here that command runs
  its `main` in this process instead: the same build and the same .npz written and loaded,
  a failure raised as the child's CalledProcessError with the traceback as stderr; the time
  budget is not enforced. Tests of the child itself (killed at the budget, its failure, its
  build) do not use this.
  """
  import subprocess  # pylint: disable=import-outside-toplevel
  import traceback  # pylint: disable=import-outside-toplevel
  from dpjax.privacy.accounting import random_allocation  # pylint: disable=import-outside-toplevel

  real = random_allocation.subprocess.run

  def run(argv, *args, **kwargs):
    if list(argv[1:3]) != ['-m', random_allocation.__name__]:
      return real(argv, *args, **kwargs)
    try:
      returncode = random_allocation.main(list(argv[3:]))
    except SystemExit as e:  # argparse's usage error: exit code 2, as the child's.
      returncode = e.code
    except Exception as e:  # pylint: disable=broad-except
      raise subprocess.CalledProcessError(1, argv, stderr=traceback.format_exc()) from e
    if returncode:
      raise subprocess.CalledProcessError(returncode, argv, stderr='')
    return subprocess.CompletedProcess(argv, 0, '', '')

  monkeypatch.setattr(random_allocation.subprocess, 'run', run)


def pytest_collection_finish(session):
  """Imports and collection built objects that live for the whole session: frozen, so the
  garbage collector's full passes no longer walk them (see `gc.set_threshold` above)."""
  del session
  gc.collect()
  gc.freeze()


def pytest_collection_modifyitems(items):
  """Tests marked `slow` run first, in file order (a module's tests stay together for its
  fixtures). pytest-xdist hands tests out in this order, so the whole trainings and child
  processes start at once on every worker and the many quick tests fill the workers' tails,
  instead of a training starting last on one worker while the others sit idle."""
  items.sort(key=lambda item: item.get_closest_marker('slow') is None)
