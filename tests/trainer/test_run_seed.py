"""The run's secret seed (issue 24, item 1): drawn by default, stored privately, never released.

On the main before this change the default config had seed = 0: rerunning dpjax on the
released run's dataset reproduced its parameters bit for bit (the first test failed there).
"""

import contextlib
import io
import json
import os
import re
import shutil
import stat

import jax
import numpy as np
import pytest

from dpjax.trainer.workdir import checkpoints
from dpjax.trainer.planning import plan as plan_lib
from dpjax.privacy import privacy_plan
from dpjax.trainer.workdir import run_seed
from dpjax import train
from tests.run_configs import small_config


def _default(**overrides):
  """small_config with the default seed (None: drawn from OS entropy), 3 steps."""
  return small_config(**{'seed': None, 'num_steps': 3, 'checkpoint_every_steps': 3, **overrides})


def _flat(params):
  return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(params)])


def _released(workdir):
  step = checkpoints.read_metadata(str(workdir))[-1]['step']
  return _flat(checkpoints.read_state(str(workdir), step)['params'])


def _two_default_runs(root) -> str:
  out = io.StringIO()
  with pytest.MonkeyPatch.context() as patch:  # Their own seed record (root/state).
    patch.setenv('DPJAX_STATE_DIR', str(root / 'state'))
    with contextlib.redirect_stdout(out):
      train.train_and_evaluate(_default(), str(root / 'victim'))
    train.train_and_evaluate(_default(), str(root / 'attacker_d'))
  return out.getvalue()


@pytest.fixture
def default_runs(shared_result):
  """Two runs of the default config (each draws its seed), and what the first printed, once per
  test session. The tests only read them (a resume works on a copy)."""
  return shared_result('default_runs', _two_default_runs)


@pytest.mark.slow
def test_an_attacker_rerunning_the_public_config_cannot_reproduce_the_release(default_runs):
  """The attack: the adversary knows the code, the config and every record but one, reruns
  dpjax on D and on D minus the record, and compares with the released parameters. With a
  public seed one rerun matched bit for bit; with a drawn seed neither does."""
  root, _ = default_runs
  victim, attacker = _released(root / 'victim'), _released(root / 'attacker_d')
  assert not np.array_equal(victim, attacker)
  seeds = {run_seed.stored_seed(str(root / name)).value for name in ('victim', 'attacker_d')}
  assert len(seeds) == 2


@pytest.mark.slow
def test_the_seed_is_stored_privately_and_nowhere_else(default_runs):
  root, out = default_runs
  workdir = root / 'victim'
  record = json.load(open(workdir / 'private' / 'seed.json'))
  seed = record['seed']
  assert record['source'] == 'drawn' and 2**20 < seed < 2**63  # 63 random bits.
  assert stat.S_IMODE(os.stat(workdir / 'private' / 'seed.json').st_mode) == 0o600
  assert stat.S_IMODE(os.stat(workdir / 'private').st_mode) == 0o700
  assert 'Seed: drawn from OS entropy' in out and 'holds only if' not in out
  assert json.load(open(workdir / 'config.json'))['seed'] is None
  meta = checkpoints.read_metadata(str(workdir))[-1]
  assert 'seed' not in meta and meta['seed_source'] == 'drawn'
  assert meta['fingerprint']['seed_sha256'] == privacy_plan.seed_digest(seed)
  for directory, _, files in os.walk(workdir):
    if os.path.basename(directory) == 'private':
      continue
    for name in files:
      with open(os.path.join(directory, name), 'rb') as f:
        assert str(seed).encode() not in f.read(), os.path.join(directory, name)


@pytest.mark.slow
def test_a_resume_reuses_the_stored_seed_and_a_missing_or_other_seed_is_refused(
  default_runs, tmp_path, capsys
):
  workdir = str(tmp_path / 'run')
  shutil.copytree(default_runs[0] / 'victim', workdir)  # A finished run of _default().
  seed = run_seed.stored_seed(workdir).value
  longer = train.train_and_evaluate(_default(num_steps=4), workdir)  # Resumes, same seed.
  capsys.readouterr()
  reference = train.train_and_evaluate(
    small_config(seed=seed, num_steps=4, checkpoint_every_steps=3), str(tmp_path / 'given')
  )
  np.testing.assert_array_equal(_flat(longer['params']), _flat(reference['params']))
  _assert_given_seed_is_used_and_labelled(seed, tmp_path / 'given', capsys.readouterr().out)
  with pytest.raises(plan_lib.PlanError, match='seed: another seed'):
    train.train_and_evaluate(_default(num_steps=5, seed=seed + 1), workdir)
  os.remove(run_seed.seed_path(workdir))
  with pytest.raises(plan_lib.PlanError, match='private/seed.json is missing'):
    train.train_and_evaluate(_default(num_steps=5), workdir)


def _assert_given_seed_is_used_and_labelled(seed, workdir, out):
  """A seed given by the config is the run's, stored as such, and labelled on the start and
  Final lines (was test_a_given_seed_is_used_and_labelled_on_the_start_and_final_lines, with
  a run of its own: now the given-seed run of the resume test)."""
  assert (
    f'Seed: {seed}, given by the config: the privacy guarantee holds only if this seed is secret'
    in out
  )
  final = [line for line in out.splitlines() if line.startswith('Final:')][0]
  assert 'ε holds only if that seed is secret' in final
  assert run_seed.stored_seed(str(workdir)) == run_seed.RunSeed(seed, 'config')


def test_drawn_seeds_use_all_64_bits_of_the_prng_key():
  """jax.random.PRNGKey keeps 32 bits without x64; the root key must keep all of them."""
  from dpjax.privacy import prng  # pylint: disable=import-outside-toplevel

  a, b = prng.noise_key(5, 0), prng.noise_key(5 + 2**40, 0)
  assert not np.array_equal(jax.random.key_data(a), jax.random.key_data(b))
  assert np.array_equal(
    jax.random.key_data(prng.root_key(5)), jax.random.key_data(jax.random.PRNGKey(5))
  )


@pytest.mark.slow
def test_each_run_gets_its_own_run_id_and_drawn_seeds_are_not_recorded(default_runs):
  """Two default runs (drawn seeds): each keeps its own run id in private/run.json (0600), and
  the seed record stays empty (drawn seeds are 63 secret bits: no other run has them). Fails on
  467e31c (checked): there was no run id."""
  from dpjax.trainer.workdir import run_identity  # pylint: disable=import-outside-toplevel

  root, _ = default_runs
  ids = [run_identity.stored(str(root / name)) for name in ('victim', 'attacker_d')]
  assert all(re.fullmatch('[0-9a-f]{32}', i.run_id) and i.earlier == () for i in ids)
  assert ids[0].run_id != ids[1].run_id
  assert stat.S_IMODE(os.stat(run_identity.run_path(str(root / 'victim'))).st_mode) == 0o600
  assert not os.path.exists(root / 'state' / 'seeds.jsonl')


def test_a_run_id_is_drawn_at_each_start_from_scratch_and_read_back_otherwise(tmp_path):
  """`run_identity`: a fresh start draws a new id and remembers the one it replaces; a resume
  or an export reads it back; a workdir from before run ids gets one, kept; a damaged file is
  one line. New module: on 467e31c this failed on its import (checked)."""
  from dpjax.trainer.workdir import run_identity  # pylint: disable=import-outside-toplevel

  workdir = str(tmp_path / 'run')
  assert run_identity.stored(workdir) is None
  first = run_identity.fresh(workdir)
  assert re.fullmatch('[0-9a-f]{32}', first.run_id) and first.earlier == ()
  assert run_identity.kept(workdir) == run_identity.stored(workdir) == first
  again = run_identity.fresh(workdir)  # Started again from scratch (no checkpoint here).
  assert again.run_id != first.run_id and again.earlier == (first.run_id,)
  assert run_identity.fresh(workdir).earlier == (again.run_id, first.run_id)
  older = str(tmp_path / 'older')
  os.makedirs(older)
  assert run_identity.kept(older) == run_identity.kept(older) != first
  with open(run_identity.run_path(workdir), 'w') as f:
    f.write('{"run_id": "../etc"}')
  with pytest.raises(
    ValueError,
    match=r'private/run.json: unreadable run id \(ValueError\); '
    'remove it',
  ):
    run_identity.stored(workdir)
  assert run_identity.fresh(workdir).earlier == ()  # A fresh start replaces it.


def test_the_seed_record_tells_runs_apart_by_their_run_id_never_by_their_path(
  tmp_path, monkeypatch
):
  """Issue 34 item 8, the functions that decide (`seed_record.start_warnings`,
  `exported_by_another_run`): a given seed's digest used by another run gives one line naming
  its workdir, whatever the path: a workdir deleted and trained again in the same path is
  another run. A start from scratch again of a run this workdir held that never exported is no
  reuse; a row without a run id (an older dpjax) is another run; the record holds digests,
  never the seed; a record that cannot be written gives one warning line, never an error.
  Fails on 467e31c (checked): the same path was exempt, whatever the run."""
  from dpjax.trainer.workdir import seed_record  # pylint: disable=import-outside-toplevel

  monkeypatch.setenv('DPJAX_STATE_DIR', str(tmp_path / 'state'))
  a, b, c, d = (letter * 32 for letter in 'abcd')
  digest = privacy_plan.seed_digest(1234567)
  first, second = os.path.realpath(tmp_path / 'first'), os.path.realpath(tmp_path / 'second')
  reuse = ' used this same given seed: two runs that share a seed share their sampling and noise'
  assert seed_record.start_warnings(digest, first, a) == []
  (line,) = seed_record.start_warnings(digest, second, b)
  assert line.startswith(f'seed: the run in {first}{reuse}')
  assert seed_record.start_warnings(privacy_plan.seed_digest(7), second, b) == []  # Other seed.
  seed_record.append(digest, seed_record.EXPORT, first, a, '/release/a')
  (line,) = seed_record.start_warnings(digest, first, c)  # `first` deleted, trained again.
  assert line.startswith(
    f'seed: an earlier run in this same workdir {first} (deleted, or '
    f'started again from scratch) (and 1 more){reuse}'
  )
  assert seed_record.exported_by_another_run(digest, a) is None  # Its own export.
  for other in (c, None):  # Another run in the same path; a workdir older than run ids.
    assert seed_record.exported_by_another_run(digest, other)['out'] == '/release/a'
  alone = privacy_plan.seed_digest(99)
  assert seed_record.start_warnings(alone, first, c) == []
  assert seed_record.start_warnings(alone, first, d, (c,)) == []  # c never exported: no reuse.
  with open(tmp_path / 'state' / 'seeds.jsonl', 'a') as f:  # An older dpjax's row, same path.
    f.write(json.dumps({'seed_sha256': alone, 'event': 'train', 'workdir': first}) + '\n')
  (line,) = seed_record.start_warnings(alone, first, 'e' * 32, (d, c))
  assert line.startswith(
    f'seed: the run in {first} (recorded by an older dpjax, without a run id){reuse}'
  )
  text = (tmp_path / 'state' / 'seeds.jsonl').read_text()
  assert '1234567' not in text and digest in text
  (tmp_path / 'file').write_text('')
  monkeypatch.setenv('DPJAX_STATE_DIR', str(tmp_path / 'file' / 'state'))
  (line,) = seed_record.start_warnings(digest, first, a)
  assert 'cannot be read or written (NotADirectoryError' in line
