"""dpjax.planner: σ is the calibration training uses, ε meets the target, σ·C/b; errors; CLI.

Small N (1000) and one or two epochs keep every calibration around a second of CPU.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from dpjax.trainer.planning import plan as plan_lib
from dpjax import planner
from dpjax.privacy import precision
from dpjax.privacy import rounding
from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import calibration
from dpjax.trainer.planning import batch_size_plan

N, EPS, DELTA, EPOCHS = 1000, 2.0, 1e-5, 2
SIZES = (50, 200, 1000)


@pytest.fixture(scope='module')
def plan():
  config = batch_size_plan.base_config(clip_norm=2.0)
  return batch_size_plan.plan_batch_sizes(N, EPS, DELTA, EPOCHS, SIZES, config=config)


@pytest.mark.slow
def test_sigma_is_the_calibration_training_uses(plan):
  """Each σ is calibrate_noise_multiplier called directly on the same sampler, steps and B (and
  the sensitivity 1 + η training pays for at that B), and make_accountant's ε at that σ is below
  the target and within the calibration tolerance."""
  assert [r.batch_size for r in plan.rows] == list(SIZES)
  for row in plan.rows[:2]:
    sampler = samplers.sampler_class('poisson')(num_examples=N, batch_size=row.batch_size)
    steps = EPOCHS * math.ceil(N / row.batch_size)
    assert row.num_steps == steps and row.steps_per_epoch == math.ceil(N / row.batch_size)
    s = 1 + rounding.eta(row.max_batch_size, precision.matmul_format('default'))
    direct = calibration.calibrate_noise_multiplier(
      sampler, EPS, DELTA, steps, sensitivity=s, max_batch_size=row.max_batch_size
    )
    assert row.noise_multiplier == direct
    eps = (
      accountant_lib.Accountant(
        sampler, direct, DELTA, max_batch_size=row.max_batch_size, num_steps=steps, sensitivity=s
      )
      .final_report(estimates=False)
      .epsilon
    )
    assert row.epsilon == eps
  for row in plan.rows:
    assert row.bound == 'upper' and row.accountant == 'pld'
    assert EPS * (1 - calibration.DEFAULT_EPSILON_RTOL) <= row.epsilon <= EPS


def test_full_batch_is_the_gaussian_mechanism(plan):
  """b = N with Poisson: q = 1, every step is the Gaussian mechanism, E of them; E Gaussians
  with σ/(1 + η) compose to one with σ/((1 + η)√E), whose exact ε (Balle & Wang 2018) is at most
  the target."""
  from dpjax.privacy.accounting import balls_and_bins

  row = plan.rows[-1]
  assert row.num_steps == EPOCHS
  eta = rounding.eta(row.max_batch_size, precision.matmul_format('default'))
  exact = balls_and_bins.deterministic_epsilon(row.noise_multiplier / (1 + eta), EPOCHS, DELTA)
  assert exact <= EPS and exact == pytest.approx(row.epsilon, abs=2e-3)


def test_effective_noise_and_run_noise(plan):
  for row in plan.rows:
    b, q = row.batch_size, row.batch_size / N
    assert row.effective_noise == pytest.approx(row.noise_multiplier * 2.0 / b, rel=1e-12)
    assert row.run_noise == pytest.approx(
      row.noise_multiplier / (q * math.sqrt(row.num_steps)), rel=1e-12
    )
  # σ grows with b, more slowly than b: σ·C/b falls; the full batch has the least.
  sigmas = [r.noise_multiplier for r in plan.rows]
  assert sigmas == sorted(sigmas)
  assert plan.best_batch_size == N
  assert 'decreases at every step' in plan.message()


def test_iterate_error_compares_dp_sgd_and_bandmf_at_the_target_epsilon(plan):
  """The planner's iterate error is (σC/b)²·(T + 1)/2 for DP-SGD (the prefix sums of T noisy
  means, C = I) and that × the strategy's expected error for BandMF, whose σ is calibrated by
  its own accountant (cyclic Poisson, k = 4 groups and bands): a planner that ignored the
  mechanism would give BandMF DP-SGD's σ or its error; BandMF's error differs from both."""
  for row in plan.rows:
    noise = row.noise_multiplier * 2.0 / row.batch_size
    assert row.iterate_error == pytest.approx(noise**2 * (row.num_steps + 1) / 2, rel=1e-12)
  config = batch_size_plan.base_config(clip_norm=2.0, sampler='cyclic_poisson')
  config.sampler.num_groups = 4
  config.privacy.noise, config.privacy.num_bands = 'bandmf', 4
  mf = batch_size_plan.plan_batch_sizes(N, EPS, DELTA, EPOCHS, (50,), config=config).rows[0]
  assert mf.noise_multiplier > plan.rows[0].noise_multiplier  # Cyclic Poisson amplifies less.
  from dpjax.privacy.correlated import strategy  # pylint: disable=import-outside-toplevel

  ratio = strategy.for_run('bandmf', mf.num_steps, num_bands=4).expected_error()
  noise = mf.noise_multiplier * 2.0 / 50
  assert mf.iterate_error == pytest.approx(noise**2 * (mf.num_steps + 1) / 2 * ratio, rel=1e-9)
  assert ratio < 0.8


def test_flat_from_and_best_batch_size():
  def row(b, sigma, steps):
    return batch_size_plan.PlanRow(
      b,
      1,
      steps,
      sigma,
      sigma / b,
      sigma / (b / 100 * math.sqrt(steps)),
      1.0,
      'upper',
      'pld',
      None,
      0.0,
      0.0,
    )

  # run noise: 10, 4.2, 4.0, 4.3 -> within 10% of 4.0 from the second row on.
  rows = (
    row(1, 10 / 100 * 10, 100),
    row(10, 4.2 / 10 * 10, 100),
    row(50, 4.0 / 2 * 10, 100),
    row(100, 4.3 * 10, 100),
  )
  plan = batch_size_plan.Plan(100, 1.0, 1e-5, 1, 'poisson', 'pld', 1.0, rows)
  assert [r.run_noise for r in rows] == pytest.approx([10, 4.2, 4.0, 4.3])
  assert plan.flat_from == 10
  assert plan.best_batch_size == 50  # σ/b: 1.0, 0.42, 0.4, 0.43.
  assert 'does not decrease monotonically' in plan.message()
  assert 'from b = 10 on' in plan.message() and 'At b = 1 the run needs 2.5x' in plan.message()
  falling = batch_size_plan.Plan(100, 1.0, 1e-5, 1, 'poisson', 'pld', 1.0, rows[:2])
  assert falling.flat_from == 10 and 'still falls at the end of the grid' in falling.message()


def test_default_batch_sizes():
  assert batch_size_plan.default_batch_sizes(60000)[:3] == [32, 64, 128]
  assert batch_size_plan.default_batch_sizes(60000)[-2:] == [32768, 60000]
  assert batch_size_plan.default_batch_sizes(64) == [32, 64]
  assert batch_size_plan.default_batch_sizes(5) == [1, 2, 4, 5]
  assert batch_size_plan.default_batch_sizes(1) == [1]


@pytest.mark.parametrize(
  'kwargs, match',
  [
    (dict(num_examples=0), r'--num_examples must be an integer >= 1'),
    (dict(target_epsilon=0.0), r'--epsilon must be a finite number > 0'),
    (dict(target_epsilon=math.inf), r'--epsilon must be a finite number > 0'),
    (dict(delta=1.0), r'--delta must be a finite number > 0 and < 1'),
    (dict(num_epochs=0), r'--epochs must be an integer >= 1'),
    (dict(batch_sizes=[10, 2000]), r'--batch_sizes entry must be an integer >= 1 and <= 1000'),
    (dict(batch_sizes=[]), r'--batch_sizes must list at least one'),
    (
      dict(config=batch_size_plan.base_config(clip_norm=-1.0)),
      r'--clip_norm must be a finite number > 0',
    ),
    (dict(config=batch_size_plan.base_config(sampler='bogus')), r"--sampler 'bogus' is unknown"),
    (
      dict(config=batch_size_plan.base_config(sampler='shuffle', accountant='monte_carlo')),
      r'monte_carlo',
    ),
  ],
)
def test_bad_input_raises_before_compute(kwargs, match, monkeypatch):
  def no_compute(*args, **kw):
    raise AssertionError('calibration ran before validation')

  monkeypatch.setattr(plan_lib, 'make_accountant', no_compute)
  args = dict(num_examples=N, target_epsilon=EPS, delta=DELTA, num_epochs=EPOCHS, batch_sizes=[100])
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    batch_size_plan.plan_batch_sizes(**args)


@pytest.mark.slow
def test_cli_end_to_end(tmp_path, capsys):
  out_json, out_png = tmp_path / 'plan.json', tmp_path / 'plan.png'
  assert (
    planner.main(
      [
        '--num_examples',
        '1000',
        '--epsilon',
        '2',
        '--delta',
        '1e-5',
        '--epochs',
        '1',
        '--batch_sizes',
        '1000,500',
        '--clip_norm',
        '0.5',
        '--physical_batch_size',
        '1024',
        '--json',
        str(out_json),
      ]
    )
    == 0
  )
  text = capsys.readouterr().out
  assert 'σ·C/b' in text and '<- smallest σ·C/b' in text and 'seed 003' in text
  d = json.loads(out_json.read_text())
  assert [r['batch_size'] for r in d['rows']] == [500, 1000]
  assert d['clip_norm'] == 0.5 and d['num_epochs'] == 1 and d['best_batch_size'] == 1000
  for r in d['rows']:
    assert r['effective_noise'] == pytest.approx(r['noise_multiplier'] * 0.5 / r['batch_size'])
    assert r['epsilon'] <= 2.0
  assert json.loads(json.dumps(batch_size_plan.Plan.from_dict(d).to_dict())) == d  # The whole plan.
  # Plotting lives in experiments/ (the library never imports matplotlib): JSON -> PNG.
  script = os.path.join(
    os.path.dirname(__file__), '..', '..', 'experiments', '05_batch_size_planner', 'plot_plans.py'
  )
  subprocess.run(
    [sys.executable, script, str(out_json), '--out', str(out_png)], check=True, capture_output=True
  )
  assert out_png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_cli_config_and_usage_errors(tmp_path, capsys):
  # N from the flag, sampler/ε/δ/epochs/C from the config; deterministic order: σ/(1 + η) is the
  # same for every b (no amplification; η of B = b), so σ·C/b is about proportional to 1/b.
  out_json = tmp_path / 'det.json'
  assert (
    planner.main(
      [
        '--config',
        'configs/digits_mlp.py',
        '--num_examples',
        '1000',
        '--sampler',
        'deterministic',
        '--batch_sizes',
        '100,500',
        '--json',
        str(out_json),
      ]
    )
    == 0
  )
  text = capsys.readouterr().out
  assert 'ε = 3' in text and '20 epochs' in text and 'sampler deterministic' in text
  assert 'without amplification' in text
  rows = json.loads(out_json.read_text())['rows']
  accounted = [
    r['noise_multiplier']
    / (1 + rounding.eta(r['max_batch_size'], precision.matmul_format('default')))
    for r in rows
  ]
  assert accounted[0] == pytest.approx(accounted[1], rel=1e-6)
  assert rows[0]['effective_noise'] == pytest.approx(5 * rows[1]['effective_noise'], rel=1e-2)
  for argv, match in [
    (['--epsilon', '1', '--delta', '1e-5', '--epochs', '1'], 'missing --num_examples'),
    (
      [
        '--num_examples',
        '100',
        '--epsilon',
        '1',
        '--delta',
        '1e-5',
        '--epochs',
        '1',
        '--batch_sizes',
        '10,x',
      ],
      '--batch_sizes must be comma-separated integers',
    ),
    (
      ['--num_examples', '100', '--epsilon', '-1', '--delta', '1e-5', '--epochs', '1'],
      '--epsilon must be a finite number > 0',
    ),
    (
      [
        '--num_examples',
        '100',
        '--epsilon',
        '1',
        '--delta',
        '1e-5',
        '--epochs',
        '1',
        '--json',
        str(tmp_path / 'no' / 'x.json'),
      ],
      '--json',
    ),
    (
      ['--num_examples', '100', '--epsilon', '0', '--delta', '1e-5', '--epochs', '1'],
      '--epsilon must be a finite number > 0, got 0.0',
    ),
    (
      ['--config', 'configs/digits_mlp.py:runlocal', '--num_examples', '100'],
      '--epochs must be given',
    ),
  ]:
    with pytest.raises(SystemExit) as e:
      planner.main(argv)
    assert e.value.code == 2
    assert match in capsys.readouterr().err
