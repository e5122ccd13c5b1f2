"""Many `python -m <module> ARGS` command lines in one process: the imports once, a fork each.

  python -m tests.forked_cli MODULE CASES.json RESULTS.json

CASES.json is a list of {"argv": [...], "cwd": "..."}, each optionally with "signal":
{"name": "SIGINT", "after": "module.function", "in_finaliser": false}: the child sends itself
that signal once `function` returns (inside an object's `__del__` if in_finaliser, where Python
drops an exception raised by the handler), at a point of its own choosing. This process imports what MODULE
imports, in its functions too (not MODULE itself), then for each case forks a child that runs
MODULE as `python -m` does (`runpy`, as __main__, sys.argv = [its path, *argv], in cwd), with
stdout and stderr going to files; an exception leaving MODULE prints its traceback and exits
1, as the interpreter does. RESULTS.json gets one list: per case the exit code (negative:
killed by that signal), stdout and stderr. Each child starts from the state a fresh interpreter
reaches after those imports, so it sees what a user's command sees, except what the imports
themselves print: a test keeps one real `python -m` run beside it for that.

A case with "path" runs that script instead, as `python PATH ARGV` does (`runpy.run_path`), its
imports done here first too, and the package attributes it reads (`dpjax.PrivacyPlan`: a lazy
export imports its module on first use). MODULE may then be '-' (no module). A case with
"module" runs that module instead of MODULE (its imports done here too). A case's "env" is set
in its child before it runs: only for what is read after the imports (XLA_FLAGS, read when jax
starts its backend: a device count of the child's own), not what a module reads when imported.

  python -m tests.forked_cli MODULE CASES.json RESULTS.json --together SECONDS

forks every case at once (processes that talk to each other: the hosts of a multi-process run)
and waits for them all; one still running after SECONDS gets SIGABRT (with PYTHONFAULTHANDLER=1
in the environment, every thread's Python stack goes to its stderr) and its result says
"timed_out".
"""

import ast
import importlib
import importlib.util
import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback


def preimport(module: str, skip: frozenset[str] = frozenset()) -> None:
  """Imports the modules `module` imports (absolute imports), in its functions too: a command
  imports its heavy modules where it needs them, so that its --help starts fast. Never those in
  `skip` (the modules the children run as __main__: imported here, a command's flags would be
  defined twice)."""
  spec = importlib.util.find_spec(module)
  with open(spec.origin, encoding='utf-8') as f:
    _import_all(ast.parse(f.read()), skip)


def preimport_path(path: str) -> None:
  """The same for the script `path`, and the attributes it reads of a module it imports
  whole (`import dpjax` ... `dpjax.PrivacyPlan`: a lazy export imports its module)."""
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read())
  _import_all(tree)
  aliases = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:  # `import a.b` binds a; `import a.b as c` binds c to a.b.
        name = alias.asname or alias.name.partition('.')[0]
        aliases[name] = alias.name if alias.asname else name
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
      module = sys.modules.get(aliases.get(node.value.id, ''))
      if module is not None:
        try:
          getattr(module, node.attr)
        except Exception:  # pylint: disable=broad-except
          pass  # Not an attribute of the module (or not at import time): the script will say.


def _import_all(tree: ast.AST, skip: frozenset[str] = frozenset()) -> None:
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != '__future__':
      names = [node.module] + [f'{node.module}.{alias.name}' for alias in node.names]
    else:
      continue
    for name in (name for name in names if name not in skip):
      try:
        importlib.import_module(name)
      except ImportError:  # `from package import function`: not a module.
        pass


class _SignalInFinaliser:
  def __init__(self, signum: int):
    self.signum = signum

  def __del__(self):
    _deliver(self.signum)


def _deliver(signum: int) -> None:
  """Sends `signum` to this process and runs bytecodes: Python calls the handler here."""
  os.kill(os.getpid(), signum)
  for _ in range(1000):
    pass


def _signal_after(spec: dict) -> None:
  """Wraps spec['after'] (module.function) to deliver spec['name'] once it returns."""
  module_name, name = spec['after'].rsplit('.', 1)
  module = importlib.import_module(module_name)
  function, signum = getattr(module, name), getattr(signal, spec['name'])

  def wrapped(*args, **kwargs):
    result = function(*args, **kwargs)
    if spec.get('in_finaliser'):
      _SignalInFinaliser(signum)  # Collected at once: __del__ runs now.
    else:
      _deliver(signum)
    return result

  setattr(module, name, wrapped)


def _child(module: str, case: dict, out: str, err: str) -> None:
  """In the forked child: MODULE as __main__; never returns."""
  code = 1
  argv, cwd, module = case['argv'], case['cwd'], case.get('module', module)
  os.environ.update(case.get('env', {}))
  try:
    for path, fd in ((out, 1), (err, 2)):
      os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    os.chdir(cwd)
    if 'signal' in case:
      _signal_after(case['signal'])
    if 'path' in case:  # As `python PATH ARGV`: the script's folder first on sys.path.
      sys.argv = [case['path'], *argv]
      sys.path.insert(0, os.path.dirname(os.path.abspath(case['path'])))
      runpy.run_path(case['path'], run_name='__main__')
    else:  # As `python -m`: the working directory first on sys.path.
      sys.path[0] = os.getcwd()
      sys.argv = [importlib.util.find_spec(module).origin, *argv]
      runpy.run_module(module, run_name='__main__', alter_sys=True)
    code = 0
  except SystemExit as e:  # As the interpreter: None is 0, a non-integer is printed and 1.
    if e.code is None or isinstance(e.code, int):
      code = e.code or 0
    else:
      print(e.code, file=sys.stderr)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # pylint: disable=broad-except
        pass
    os._exit(code & 0xFF)  # pylint: disable=protected-access


def _fork(module: str, case: dict, out: str, err: str) -> int:
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    _child(module, case, out, err)
  return pid


def _wait_all(pids: list[int], timeout: float) -> dict[int, int | None]:
  """{pid: wait status} of every child; SIGABRT to those still running after `timeout` s
  (their status None)."""
  statuses, deadline = {}, time.monotonic() + timeout
  while len(statuses) < len(pids) and time.monotonic() < deadline:
    pid, status = os.waitpid(-1, os.WNOHANG)
    if pid:
      statuses[pid] = status
    else:
      time.sleep(0.05)
  for pid in pids:
    if pid not in statuses:
      os.kill(pid, signal.SIGABRT)
      os.waitpid(pid, 0)
      statuses[pid] = None  # Timed out.
  return statuses


def run(module: str, cases: list[dict], together: float | None = None) -> list[dict]:
  """Each case's {'returncode', 'stdout', 'stderr'} (and 'timed_out' with `together`): one
  after the other, or all at once with `together` (seconds to wait for them all)."""
  modules = dict.fromkeys(case.get('module', module) for case in cases if 'path' not in case)
  for name in modules:
    if name != '-':
      preimport(name, skip=frozenset(modules))
  for path in dict.fromkeys(case['path'] for case in cases if 'path' in case):
    preimport_path(path)
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    files = [
      (os.path.join(tmp, f'{i}.out'), os.path.join(tmp, f'{i}.err')) for i in range(len(cases))
    ]
    if together is None:
      statuses = [os.waitpid(_fork(module, c, *f), 0)[1] for c, f in zip(cases, files)]
    else:
      pids = [_fork(module, c, *f) for c, f in zip(cases, files)]
      waited = _wait_all(pids, together)
      statuses = [waited[pid] for pid in pids]
    for status, (out, err) in zip(statuses, files):
      with (
        open(out, encoding='utf-8', errors='replace') as f_out,
        open(err, encoding='utf-8', errors='replace') as f_err,
      ):
        result = {
          'returncode': -signal.SIGABRT if status is None else os.waitstatus_to_exitcode(status),
          'stdout': f_out.read(),
          'stderr': f_err.read(),
        }
      if together is not None:
        result['timed_out'] = status is None
      results.append(result)
  return results


if __name__ == '__main__':
  with open(sys.argv[2], encoding='utf-8') as f:
    results = run(
      sys.argv[1], json.load(f), float(sys.argv[5]) if sys.argv[4:5] == ['--together'] else None
    )
  with open(sys.argv[3], 'w', encoding='utf-8') as f:
    json.dump(results, f)
