"""dpjax_bench.provenance: what a measurement records beside its numbers."""

import json
import os
import subprocess

from dpjax_bench import provenance


def test_git_state_is_the_checkouts_head():
  """REPO is this checkout's root (it was the folder above it when provenance moved up a level:
  every benchmark then wrote its JSON outside the repository and git_state read no repository)."""
  assert os.path.isfile(os.path.join(provenance.REPO, 'pyproject.toml'))
  assert os.path.isdir(os.path.join(provenance.REPO, 'scripts', 'results'))
  head = subprocess.run(
    ['git', 'rev-parse', 'HEAD'], cwd=provenance.REPO, capture_output=True, text=True, check=False
  ).stdout.strip()
  state = provenance.git_state()
  assert state['head'] == (head or None)
  assert isinstance(state['dpjax_uncommitted_changes'], list)


def test_write_json_round_trips_and_timed_measures(tmp_path):
  path = str(tmp_path / 'r.json')
  record = {'machine': provenance.machine(), 'x': [1.5, None]}
  provenance.write_json(path, record)
  assert json.load(open(path)) == json.loads(json.dumps(record))
  value, seconds = provenance.timed(lambda: sum(range(1000)))
  assert value == 499500 and seconds >= 0
  median, times = provenance.median_seconds(lambda: None, 3)
  assert len(times) == 3 and min(times) <= median <= max(times)
