"""The package's import graph has no cycle, counting imports inside functions."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / 'dpjax'


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in ROOT.rglob('*.py'):
    parts = path.relative_to(ROOT.parent).with_suffix('').parts
    name = '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)
    out[name] = path
  return out


def _type_checking_only(tree: ast.AST) -> set[int]:
  """ids of the import nodes under `if TYPE_CHECKING:` (not executed: no cycle)."""
  skip = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and getattr(node.test, 'id', '') == 'TYPE_CHECKING':
      skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
  return skip


def import_graph() -> dict[str, set[str]]:
  modules = _modules()

  def resolve(name: str) -> str:
    while name not in modules and '.' in name:
      name = name.rsplit('.', 1)[0]
    return name

  graph = {}
  for name, path in modules.items():
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
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
    graph[name] = {t for t in targets if t in modules}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
  """One cycle of the graph (a list of modules, first = last), or []."""
  state = {}

  def visit(node, path):
    state[node] = 'open'
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 'open':
        return path[path.index(nxt):] + [nxt]
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


def test_the_mechanism_reads_no_config():
  """Samplers, batching, clipping, noise, accounting, ghost clipping and auditing take typed
  arguments; only the trainer and the command lines read a config."""
  mechanism = ['samplers.py', 'batching.py', 'clipping.py', 'noise.py', 'privacy_plan.py',
               'nnx_model.py']
  paths = [ROOT / m for m in mechanism] + [p for d in ('accounting', 'ghost_clipping',
                                                        'auditing') for p in (ROOT / d).rglob('*.py')]
  for path in paths:
    assert 'ml_collections' not in path.read_text(), path
