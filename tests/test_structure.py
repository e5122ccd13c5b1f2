"""The package's shape: layers import only downward, no cycle, small functions and modules,
no private name imported across modules, no re-export kept for old names."""

import ast
import functools
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / 'dpjax'


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in ROOT.rglob('*.py'):
    parts = path.relative_to(ROOT.parent).with_suffix('').parts
    name = '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)
    out[name] = path
  return out


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
  """The module's syntax tree, parsed once for all the tests here (they only read it)."""
  return ast.parse(path.read_text())


def _type_checking_only(tree: ast.AST) -> set[int]:
  """ids of the import nodes under `if TYPE_CHECKING:` (not executed: no cycle)."""
  skip = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and getattr(node.test, 'id', '') == 'TYPE_CHECKING':
      skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
  return skip


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
  """Module -> the dpjax modules it imports (`if TYPE_CHECKING:` imports only if asked)."""
  return {name: set(targets) for name, targets in _import_graph(type_checking).items()}


@functools.cache
def _import_graph(type_checking: bool) -> dict[str, frozenset[str]]:
  """import_graph, computed once per session (callers get their own copy to change)."""
  modules = _modules()

  def resolve(name: str) -> str:
    while name not in modules and '.' in name:
      name = name.rsplit('.', 1)[0]
    return name

  graph = {}
  for name, path in modules.items():
    tree = _tree(path)
    skip = set() if type_checking else _type_checking_only(tree)
    targets = set()
    for node in ast.walk(tree):
      if id(node) in skip:
        continue
      if isinstance(node, ast.Import):
        targets |= {resolve(a.name) for a in node.names if a.name.startswith('dpjax')}
      elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('dpjax'):
        for a in node.names:
          full = f'{node.module}.{a.name}'
          targets.add(full if full in modules else resolve(node.module))
    targets.discard(name)
    graph[name] = frozenset(t for t in targets if t in modules)
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
  """One cycle of the graph (a list of modules, first = last), or []."""
  state = {}

  def visit(node, path):
    state[node] = 'open'
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 'open':
        return path[path.index(nxt) :] + [nxt]
      if nxt not in state:
        cycle = visit(nxt, path + [nxt])
        if cycle:
          return cycle
    state[node] = 'done'
    return []

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node, [node])
      if cycle:
        return cycle
  return []


def test_the_checker_finds_a_cycle():
  assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
  assert find_cycle({'a': {'b'}, 'b': set()}) == []


def test_no_import_cycle_among_dpjax_modules():
  graph = import_graph()
  # A package's __init__ re-exports its modules; those edges go downward by construction.
  for name in graph:
    graph[name] = {t for t in graph[name] if not name.startswith(t + '.')}
  assert len(graph) > 50
  assert find_cycle(graph) == []


# Each folder is a layer; a module imports only from its own layer or the ones below it.
# The entry points (`python -m dpjax.<command>`) and the public API sit at the top.
LAYERS = {'utils': -1, 'privacy': 0, 'data': 1, 'models': 1, 'trainer': 2, 'configs': 2}
TOP = 3
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 400


def layer(module: str) -> int:
  parts = module.split('.')
  return LAYERS.get(parts[1], TOP) if len(parts) > 1 else TOP


def test_every_import_goes_to_the_same_layer_or_below():
  upward = sorted(
    f'{m} -> {t}' for m, targets in import_graph().items() for t in targets if layer(t) > layer(m)
  )
  assert upward == []


def test_the_privacy_core_reads_no_config():
  """Samplers, batching, clipping, noise, the step, accounting, ghost clipping and auditing
  take typed arguments; only the trainer and the command lines read a config."""
  paths = list((ROOT / 'privacy').rglob('*.py'))
  assert len(paths) > 30
  for path in paths:
    assert 'ml_collections' not in path.read_text(), path
    names = {n.name for n in _functions(_tree(path))}
    assert 'from_config' not in names, path  # A config read without importing ml_collections.


# What runs a plan: it reads the plan's typed blocks (`trainer/planning/plan_blocks.py`), never the config.
# Every module of the loop package (the loop, its parts, `build`, `run_report`, ...).
BELOW_THE_PLAN = 'dpjax.trainer.loop.'


def _config_reads(tree: ast.AST) -> list[str]:
  """Where a module reads a config: a `.config` attribute (not `jax.config`), a name `config` or `cfg`, an import
  of ml_collections or of `config_fields`."""
  found = []
  for node in ast.walk(tree):
    jax_config = isinstance(node, ast.Attribute) and ast.unparse(node.value) == 'jax'
    if isinstance(node, ast.Attribute) and node.attr == 'config' and not jax_config:
      found.append(f'line {node.lineno}: .config')
    elif isinstance(node, ast.Name) and node.id in ('config', 'cfg'):
      found.append(f'line {node.lineno}: {node.id}')
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names = [a.name for a in node.names] + [getattr(node, 'module', None) or '']
      if any('ml_collections' in n or n.endswith('config_fields') for n in names):
        found.append(f'line {node.lineno}: imports {", ".join(names)}')
  return found


def test_nothing_below_the_plan_reads_a_config():
  """Issue 35 item 2: the loop, its parts, `build` and `run_report` read the plan's typed blocks
  only (`RunPlan.config` is written to config.json, by `RunPlan.config_json`). Fails on
  da06065, where `build` read `plan.config` 19 times, `run_report` and `LoopSettings.of_plan`
  too."""
  assert _config_reads(ast.parse('x = plan.config.loss')) == ['line 1: .config']
  assert _config_reads(ast.parse('import ml_collections\nconfig.get("a")'))[0].startswith(
    'line 1: imports ml_collections'
  )
  modules = {n: p for n, p in _modules().items() if n.startswith(BELOW_THE_PLAN)}
  assert {'training_loop', 'loop_parts', 'build', 'run_report'} <= {
    n.rsplit('.', 1)[1] for n in modules
  }
  found = {name: reads for name, path in modules.items() if (reads := _config_reads(_tree(path)))}
  assert found == {}


def _functions(tree):
  return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_over_80_lines_and_no_module_over_400():
  long = []
  for name, path in sorted(_modules().items()):
    text = path.read_text()
    if len(text.splitlines()) > MAX_MODULE_LINES:
      long.append(f'{name}: {len(text.splitlines())} lines')
    for f in _functions(_tree(path)):
      if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES:
        long.append(f'{name}.{f.name}: {f.end_lineno - f.lineno + 1} lines')
  assert long == []


def _private_imports(tree: ast.AST, modules) -> list[str]:
  """`from dpjax.x import _y` and `dpjax_module._y` where the module is imported by name."""
  found, aliases = [], {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('dpjax'):
      for a in node.names:
        full = f'{node.module}.{a.name}'
        if a.name.startswith('_'):
          found.append(full)
        elif full in modules:
          aliases[a.asname or a.name] = full
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name in modules and a.asname:
          aliases[a.asname] = a.name
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id in aliases
      and node.attr.startswith('_')
      and not node.attr.startswith('__')
    ):
      found.append(f'{aliases[node.value.id]}.{node.attr}')
  return found


def test_the_private_import_checker_sees_both_forms():
  modules = {'dpjax.a': None}
  tree = ast.parse('from dpjax.a import _x\nfrom dpjax import a\na._y()\n')
  assert _private_imports(tree, modules) == ['dpjax.a._x', 'dpjax.a._y']


def test_no_private_name_is_imported_across_modules():
  modules = _modules()
  found = sorted(
    f'{name}: {p}' for name, path in modules.items() for p in _private_imports(_tree(path), modules)
  )
  assert found == []


def _unused_dpjax_imports(tree: ast.AST) -> list[str]:
  used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
  return [
    a.asname or a.name
    for node in tree.body
    if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('dpjax')
    for a in node.names
    if (a.asname or a.name) not in used
  ]


def test_no_module_re_exports_names_it_does_not_use():
  """A package's `__init__` may name its public API; any other module that imports a dpjax name
  uses it (no re-exports kept so that old import paths still work)."""
  found = sorted(
    f'{name}: {n}'
    for name, path in _modules().items()
    if path.name != '__init__.py'
    for n in _unused_dpjax_imports(_tree(path))
  )
  assert _unused_dpjax_imports(ast.parse('from dpjax.a import b, c\nb()\n')) == ['c']
  assert found == []


def test_no_import_cycle_even_through_type_checking_imports():
  """Issue 35: accounting/accountant.py ↔ analyses.py was a cycle through an import under
  `if TYPE_CHECKING:` (the analyses now name the accountant's interface as a Protocol)."""
  graph = import_graph(type_checking=True)
  for name in graph:
    graph[name] = {t for t in graph[name] if not name.startswith(t + '.')}
  assert find_cycle(graph) == []


def test_the_code_is_laid_out_by_the_formatter():
  """`ruff format --check` (pyproject's settings) passes on the whole repository, so the
  size limits above hold for code a tool laid out, not for code packed to fit them."""
  done = subprocess.run(
    [sys.executable, '-m', 'ruff', 'format', '--check', '.'],
    cwd=ROOT.parent,
    capture_output=True,
    text=True,
    check=False,
  )
  assert done.returncode == 0, done.stdout + done.stderr


def test_the_runtime_package_imports_no_plotting_or_benchmark_tooling():
  """matplotlib and `dpjax_bench` (provenance) are extras of the experiments and benchmarks:
  nothing in dpjax imports them, so `pip install dpjax` needs neither."""
  found = []
  for name, path in sorted(_modules().items()):
    for node in ast.walk(_tree(path)):
      names = (
        [a.name for a in node.names]
        if isinstance(node, ast.Import)
        else [node.module or '']
        if isinstance(node, ast.ImportFrom)
        else []
      )
      found += [f'{name}: {n}' for n in names if n.split('.')[0] in ('matplotlib', 'dpjax_bench')]
  assert found == []
