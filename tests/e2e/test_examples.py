"""The examples of the README's "Use dpjax in your own training loop" run and report ε."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ('own_loop_nnx', 'own_loop_linen', 'regression', 'next_token')


@pytest.mark.slow
@pytest.mark.parametrize('name', EXAMPLES)
def test_example_runs_and_ends_with_its_epsilon(name, tmp_path):
  proc = subprocess.run(
    [sys.executable, str(ROOT / 'examples' / f'{name}.py'), '--quick'],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  last = proc.stdout.strip().splitlines()[-1]
  match = re.match(r'ε = (\d+\.\d+) \(upper bound, (pld|rdp)\), δ = ', last)
  assert match, proc.stdout
  epsilon = float(match.group(1))
  # The calibrated examples meet their target (3, 1, 8) from below; the linen one has σ = 8.
  target = {'own_loop_nnx': 3.0, 'regression': 1.0, 'next_token': 8.0}.get(name)
  assert 0 < epsilon <= (target or 1.0), last
  if target:
    assert epsilon > 0.95 * target, last  # Calibrated: close to the budget, not far below.


def test_readme_shows_the_nnx_example_code():
  readme = (ROOT / 'README.md').read_text()
  section = readme.split('## Use dpjax in your own training loop')[1].split('\n## ')[0]
  code = (ROOT / 'examples' / 'own_loop_nnx.py').read_text()
  loop = code.split('# --- dpjax: everything that enters ε comes from one plan. ---')[1].split(
    '# --- end of dpjax. ---'
  )[0]
  for line in loop.strip().splitlines():
    assert line.strip() in section, line


def test_readme_shows_the_dropout_example_code():
  """The README's dropout snippet is examples/own_loop_dropout.py's code (whose model, loss and
  keys tests/privacy/test_stateful_layers.py runs). Fails on da06065: no such section."""
  readme = (ROOT / 'README.md').read_text()
  section = readme.split('### Dropout and BatchNorm in your own loop')[1].split('\n## ')[0]
  snippet = section.split('```python\n')[1].split('```')[0]
  code = (ROOT / 'examples' / 'own_loop_dropout.py').read_text()
  lines = [line.strip() for line in snippet.splitlines() if line.strip() not in ('', '...')]
  assert len(lines) > 15
  for line in lines:
    assert line in code, line
