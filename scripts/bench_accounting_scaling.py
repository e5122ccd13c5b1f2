"""Accounting speed as the number of steps T grows: ε time and calibration time.

Question: how long does `dpjax.trainer.planning.plan.make_accountant` take to give the ε of
a run, and to calibrate σ for a target ε, for each sampler and accountant, as
T grows from 1e2 to 1e5 steps?

Setup: configs/digits_mlp.py's config with the sampler and accountant
overridden, b = 100, one epoch (num_epochs = 1) of T steps, i.e. N = T·b (so
q = 1/T for Poisson and fixed size: one pass over the data at every T; the
per-step PLD shrinks as q does, which is why some ε times fall with T; see
scripts/bench_accounting.py for Poisson at fixed q), δ = 1e-5, the automatic
cap B. Two timed tasks:

* epsilon: `make_accountant(config with σ = 1)` then `.epsilon(T)` (the
  attached ε, estimates=False, as training asks for it at a checkpoint);
* calibration: `make_accountant(config with target_epsilon = 3, σ unset)`,
  which calibrates σ and checks the final ε.

Times are CPU seconds (user + system of the worker and its children, e.g. the
random-allocation subprocess) because the machine is shared: wall time is
recorded too but depends on the load. Each (sampler, accountant, task) runs
in a worker subprocess walking T upwards; a T that uses more than `--timeout`
CPU seconds (or 20× that in wall time) is killed and recorded as
"timeout > X s CPU", and a fresh worker goes on with the next T (cost is not
monotone in T: balls-and-bins uses random allocation only for T <= 100);
after two timeouts in a row the larger T are skipped. Fast cases are repeated
(median of up to 5 runs, within ~3 CPU s). The random-allocation caches
(in-process and on disk) and the max-test caches are cleared before every
run, so each time is a cold one; the worker's import time is excluded. The
Monte-Carlo accountant gets 1e6 samples (its default 1e5 cannot certify
δ = 1e-5 and raises a ValueError saying so).

Balls-and-bins targets (issue 15; `--balls-and-bins-targets`, ~3 min): the
default `python -m dpjax.account ... --json` command (provable ε, max-test and
random-allocation lower bounds; Monte Carlo is opt-in) from a cold cache, N =
1e6: b = 1000 (T = 1000) σ = 1 with E = 1 and E = 3, b = 100 (T = 1e4) σ = 0.8;
the E = 1 command again (warm cache); and σ calibration for ε = 1 at T = 1000
(`calibration.calibrate_noise_multiplier`, cold cache). Wall seconds (the
issue's budgets are wall time: 60 s, 60 s, 5 min, 2 min), ε and the issue's
acceptance range [independent lower, independent upper × 1.05] per case. Writes
scripts/results/accounting_scaling_balls_and_bins.json.

Run:
  python scripts/bench_accounting_scaling.py             # T = 1e2 … 1e5, ~10 CPU min
  python scripts/bench_accounting_scaling.py --balls-and-bins-targets
  python scripts/bench_accounting_scaling.py --steps 100,1000 --timeout 30   # quicker
  python scripts/bench_accounting_scaling.py --plot-only # redraw the PNG from the JSON

Writes scripts/results/accounting_scaling.json and accounting_scaling.png.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from dpjax_bench import (
  provenance,
)  # Light (no jax): the parent stays free of the accountant it times.

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(HERE, 'results', 'accounting_scaling.json')
BATCH_SIZE = 100
DELTA = 1e-5
NOISE_MULTIPLIER = 1.0
TARGET_EPSILON = 3.0
MONTE_CARLO_SAMPLES = 1_000_000
SAMPLERS = (
  'poisson',
  'fixed_size',
  'fixed_size_with_replacement',
  'deterministic',
  'shuffle',
  'balls_and_bins',
)
TASKS = ('epsilon', 'calibration')
_REPEAT_BUDGET_SECONDS = 3.0
_MAX_REPEATS = 5
_WALL_FACTOR = 20  # A hard wall-clock cap of 20 × the CPU timeout, against hangs.


# ---------------------------------------------------------------------------------------------
# Worker: one (sampler, accountant, task), T ascending, one JSON line per T
# ---------------------------------------------------------------------------------------------


def _config(sampler: str, accountant: str, task: str):
  from dpjax.trainer.commands.cli import load_config_file as load_config  # pylint: disable=g-import-not-at-top

  config = load_config(os.path.join(REPO, 'configs', 'digits_mlp.py'))
  config.sampler.name = sampler
  config.sampler.batch_size = BATCH_SIZE
  config.sampler.max_batch_size = 0  # Automatic cap, as a user gets it.
  config.num_epochs = 1
  config.num_steps = 0
  config.privacy.delta = DELTA
  config.privacy.accountant = accountant
  config.privacy.group_size = 1
  if task == 'epsilon':
    config.privacy.noise_multiplier = NOISE_MULTIPLIER
    config.privacy.target_epsilon = 0
  else:
    config.privacy.noise_multiplier = None
    config.privacy.target_epsilon = TARGET_EPSILON
  return config


def _fresh_caches() -> None:
  """Cold start for every timed run: no memoised random-allocation PLD or max-test pair."""
  from dpjax.privacy.accounting import max_test, random_allocation  # pylint: disable=g-import-not-at-top

  os.environ['DPJAX_CACHE_DIR'] = tempfile.mkdtemp(prefix='dpjax_bench_cache_')
  random_allocation._memo.clear()  # pylint: disable=protected-access
  for fn in (
    max_test._cached_binned_pair,  # pylint: disable=protected-access
    max_test._cached_composed_pld,
  ):  # pylint: disable=protected-access
    fn.cache_clear()


def _cpu_seconds() -> float:
  """CPU time of this process (all threads) and of its finished children (random allocation)."""
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return time.process_time() + children.ru_utime + children.ru_stime


def _run_once(sampler: str, accountant: str, task: str, num_steps: int) -> dict:
  from dpjax.trainer.planning.plan import make_accountant  # pylint: disable=g-import-not-at-top

  config = _config(sampler, accountant, task)
  num_examples = num_steps * BATCH_SIZE  # ceil(N/b) = T steps per epoch.
  # The default 1e5 Monte-Carlo samples cannot certify δ = 1e-5 (a ValueError asks for
  # > 760091); 1e6 is the round number that can.
  kwargs = {'monte_carlo_samples': MONTE_CARLO_SAMPLES} if accountant == 'monte_carlo' else {}
  _fresh_caches()
  start, cpu_start = time.perf_counter(), _cpu_seconds()
  acct = make_accountant(config, num_examples, **kwargs)
  report = acct.epsilon_at(num_steps, estimates=False)
  seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
  return dict(
    seconds=seconds,
    cpu_seconds=cpu,
    epsilon=report.epsilon,
    noise_multiplier=acct.noise_multiplier,
    bound=report.bound,
    resolved_accountant=report.accountant,
    method=report.details.get('method'),
    num_examples=num_examples,
    steps_per_epoch=acct.steps_per_epoch,
    max_batch_size=acct.max_batch_size,
  )


def worker(spec: dict) -> None:
  import dpjax.privacy.accounting  # pylint: disable=g-import-not-at-top,unused-import

  print(json.dumps({'ready': True}), flush=True)
  for num_steps in spec['steps']:
    row: dict = {'num_steps': num_steps}
    try:
      runs = [_run_once(spec['sampler'], spec['accountant'], spec['task'], num_steps)]
      while (
        len(runs) < _MAX_REPEATS
        and sum(r['cpu_seconds'] for r in runs) + runs[0]['cpu_seconds'] <= _REPEAT_BUDGET_SECONDS
      ):
        runs.append(_run_once(spec['sampler'], spec['accountant'], spec['task'], num_steps))
      row.update(runs[-1])
      row['all_seconds'] = [r['seconds'] for r in runs]
      row['seconds'] = statistics.median(row['all_seconds'])
      row['cpu_seconds'] = statistics.median(r['cpu_seconds'] for r in runs)
      row['status'] = 'ok'
    except Exception as e:  # pylint: disable=broad-except
      row.update(status='error', error=f'{type(e).__name__}: {e}')
    print(json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------------------
# Parent: workers with per-T timeouts
# ---------------------------------------------------------------------------------------------


def _reader(stream, lines: queue.Queue) -> None:
  for line in stream:
    lines.put(line)
  lines.put(None)


def _session_cpu_seconds(session: int) -> float:
  """CPU seconds (user + system) of every live process in `session`, plus their reaped children."""
  tick = os.sysconf('SC_CLK_TCK')
  total = 0
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()
    except OSError:
      continue  # Exited meanwhile.
    # After the command name: state ppid pgrp session ... utime(14) stime cutime cstime (1-based).
    if int(fields[3]) == session:
      total += sum(int(x) for x in fields[11:15])
  return total / tick


def _run_worker(spec: dict, cpu_timeout: float) -> tuple[list[dict], bool]:
  """Rows the worker finished; True if the next T was killed for exceeding `cpu_timeout`."""
  proc = subprocess.Popen(
    [sys.executable, os.path.abspath(__file__), '--worker', json.dumps(spec)],
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
    cwd=REPO,
    start_new_session=True,
  )
  lines: queue.Queue = queue.Queue()
  threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
  rows, timed_out = [], False
  try:
    if lines.get(timeout=600) is None:  # Imports only.
      raise RuntimeError('worker died during import')
    for _ in spec['steps']:
      cpu_start, wall_start = _session_cpu_seconds(proc.pid), time.perf_counter()
      line = None
      while True:
        try:
          line = lines.get(timeout=0.5)
          break
        except queue.Empty:
          cpu = _session_cpu_seconds(proc.pid) - cpu_start
          if cpu > cpu_timeout or time.perf_counter() - wall_start > _WALL_FACTOR * cpu_timeout:
            timed_out = True
            break
      if timed_out:
        break
      if line is None:
        rows.append(dict(num_steps=spec['steps'][len(rows)], status='error', error='worker exited'))
        break
      rows.append(json.loads(line))
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)  # The worker and its random-allocation children.
    proc.wait()
  return rows, timed_out


def run_combo(
  sampler: str, accountant: str, task: str, steps: list[int], cpu_timeout: float
) -> list[dict]:
  """Rows for every T of one combo.

  A T killed for CPU time is 'timeout' and a fresh worker continues with the
  next T (costs are not monotone in T: balls-and-bins switches method at
  T = 100); after two timeouts in a row the larger T are 'skipped'.
  """
  rows, todo, streak = [], list(steps), 0
  while todo:
    spec = dict(sampler=sampler, accountant=accountant, task=task, steps=todo)
    done, timed_out = _run_worker(spec, cpu_timeout)
    rows += done
    todo = todo[len(done) :]
    if done and done[-1].get('error') == 'worker exited':
      break
    if timed_out:
      streak = streak + 1 if not done else 1
      rows.append(
        dict(
          num_steps=todo[0],
          status='timeout',
          timeout_cpu_seconds=cpu_timeout,
          note=f'timeout > {cpu_timeout:g} s CPU',
        )
      )
      todo = todo[1:]
      if streak >= 2:
        break
    else:
      streak = 0
  for num_steps in todo:
    rows.append(
      dict(
        num_steps=num_steps,
        status='skipped',
        note='not run: two T in a row timed out, or the worker died',
      )
    )
  for row in rows:
    _log(sampler, accountant, task, row)
  return rows


def _log(sampler, accountant, task, row):
  status = row['status']
  what = (
    f'{row["seconds"]:.3g} s wall, {row["cpu_seconds"]:.3g} s CPU '
    f'(ε={row["epsilon"]:.4g}, σ={row["noise_multiplier"]:.4g})'
    if status == 'ok'
    else row.get('note') or row.get('error')
  )
  print(
    f'{sampler:28s} {accountant:12s} {task:12s} T={row["num_steps"]:>7d}: {what}',
    file=sys.stderr,
    flush=True,
  )


def combos(samplers: list[str]) -> list[tuple[str, str]]:
  from dpjax.privacy import samplers as samplers_lib  # pylint: disable=g-import-not-at-top

  return [(s, a) for s in samplers for a in samplers_lib.sampler_class(s).accountants]


# ---------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------


def plot(results: dict, path: str) -> None:
  """CPU time vs T, log-log: colour = sampler, marker = accountant, ε solid, calibration dashed."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.lines import Line2D  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
  colors = {s: plt.cm.tab10(i) for i, s in enumerate(SAMPLERS)}
  markers = {'pld': 'o', 'rdp': 's', 'monte_carlo': 'D'}
  names = sorted(
    {(r['sampler'], r['accountant']) for r in results['rows']},
    key=lambda sa: (SAMPLERS.index(sa[0]), sa[1]),
  )
  timeout = results['timeout_cpu_seconds']
  for ax, task, line in zip(axes, TASKS, ('-', '--')):
    for sampler, accountant in names:
      rows = [
        r
        for r in results['rows']
        if (r['sampler'], r['accountant'], r['task']) == (sampler, accountant, task)
      ]
      ok = [(r['num_steps'], r['cpu_seconds']) for r in rows if r['status'] == 'ok']
      if ok:
        ax.plot(*zip(*ok), line, marker=markers[accountant], color=colors[sampler], ms=5)
      for r in rows:
        if r['status'] in ('timeout', 'error'):
          ax.plot(
            [r['num_steps']],
            [timeout],
            '^' if r['status'] == 'timeout' else 'X',
            color=colors[sampler],
            ms=10,
            mec='k',
            mew=0.5,
          )
    ax.axhline(timeout, color='0.5', lw=0.8, ls=':')
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xlabel('T (steps; one epoch, N = 100·T, q = 1/T)')
    ax.grid(True, which='both', alpha=0.3)
    ax.set_title(
      {
        'epsilon': f'ε at σ = {NOISE_MULTIPLIER:g} (solid)',
        'calibration': f'calibrate σ for ε = {TARGET_EPSILON:g} (dashed)',
      }[task]
    )
  axes[0].annotate(
    'balls-and-bins: random-allocation PLD\nonly for T ≤ 100, then deterministic',
    xy=(100, 7),
    xytext=(140, 0.3),
    fontsize=7,
    arrowprops=dict(arrowstyle='->', lw=0.6),
  )
  axes[0].set_ylabel('CPU time (s), median of repeats')
  handles = [
    Line2D([], [], color=colors[s], marker=markers[a], label=f'{s} / {a}') for s, a in names
  ]
  handles += [
    Line2D([], [], color='0.3', ls='-', label='ε'),
    Line2D([], [], color='0.3', ls='--', label='calibration'),
    Line2D([], [], color='0.3', marker='^', ls='', ms=9, label=f'timeout (> {timeout:g} s CPU)'),
  ]
  axes[1].legend(
    handles=handles,
    fontsize=7,
    loc='upper left',
    bbox_to_anchor=(1.01, 1.0),
    title='sampler / accountant',
    title_fontsize=7,
  )
  fig.suptitle(
    f'dpjax accounting CPU time vs T (δ = {DELTA:g}, b = {BATCH_SIZE}, '
    f'make_accountant on configs/digits_mlp.py)'
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


# (name, flags, E, acceptance range from the issue: the library's adaptive [lower, upper × 1.05]).
BNB_CASES = (
  (
    'T=1000, E=1, sigma=1',
    ['--batch-size', '1000', '--epochs', '1', '--noise-multiplier', '1'],
    (0.1364, 0.1422 * 1.05),
    60.0,
  ),
  (
    'T=1000, E=3, sigma=1',
    ['--batch-size', '1000', '--epochs', '3', '--noise-multiplier', '1'],
    (0.2407, 0.2505 * 1.05),
    60.0,
  ),
  (
    'T=10000, E=1, sigma=0.8',
    ['--batch-size', '100', '--epochs', '1', '--noise-multiplier', '0.8'],
    (0.0592, 0.0619 * 1.05),
    300.0,
  ),
)


def _calibrate_cold(cache: str) -> dict:
  """σ for ε = 1 at T = 1000 (N = 1e6, b = 1000), cold cache, timed in a fresh process."""
  code = (
    'import json, time\n'
    'from dpjax.privacy import samplers\n'
    'from dpjax.privacy.accounting import accountant, calibration\n'
    's = samplers.sampler_class("balls_and_bins")(num_examples=10**6, batch_size=1000)\n'
    't = time.perf_counter()\n'
    'sigma = calibration.calibrate_noise_multiplier(s, 1.0, 1e-5, 1000,\n'
    '                                               max_batch_size=None)\n'
    'seconds = time.perf_counter() - t\n'
    'eps = accountant.Accountant(s, sigma, 1e-5, max_batch_size=None).epsilon(1000)\n'
    'print(json.dumps(dict(noise_multiplier=sigma, epsilon=eps, seconds=seconds)))\n'
  )
  env = dict(os.environ, DPJAX_CACHE_DIR=cache)
  start = time.perf_counter()
  out = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, env=env, cwd=REPO, check=True
  )
  row = json.loads(out.stdout.strip().splitlines()[-1])
  row['wall_seconds_with_imports'] = time.perf_counter() - start
  return row


def balls_and_bins_targets(out_path: str) -> dict:
  """The issue-15 cases, each from a cold cache (a fresh directory), as a user runs them."""
  results = dict(
    question='provable balls-and-bins ε of the default `python -m dpjax.account` command at '
    'realistic T, from a cold cache; calibration at T = 1000',
    setting=dict(
      num_examples=10**6,
      delta=DELTA,
      command='python -m dpjax.account '
      '--sampler balls_and_bins --num-examples 1000000 --delta 1e-5 --json ...',
    ),
    machine=dict(
      provenance.machine(), time=time.strftime('%Y-%m-%d %H:%M:%S'), git=provenance.git_state()
    ),
    rows=[],
  )
  base = [
    sys.executable,
    '-m',
    'dpjax.account',
    '--sampler',
    'balls_and_bins',
    '--num-examples',
    '1000000',
    '--delta',
    '1e-5',
    '--json',
  ]
  for name, flags, (low, high), budget in BNB_CASES:
    for cache_state in ('cold', 'warm') if name.startswith('T=1000, E=1') else ('cold',):
      if cache_state == 'cold':
        cache = tempfile.mkdtemp(prefix='dpjax_bench_cache_')
      start = time.perf_counter()
      out = subprocess.run(
        base + flags,
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
        env=dict(os.environ, DPJAX_CACHE_DIR=cache),
      )
      seconds = time.perf_counter() - start
      report = json.loads(out.stdout)
      row = dict(
        case=name,
        cache=cache_state,
        wall_seconds=seconds,
        budget_seconds=budget,
        epsilon=report['epsilon'],
        bound=report['bound'],
        method=report['details']['method'],
        epsilon_lower=report['epsilon_lower'],
        random_allocation_lower=report['details'].get('random_allocation_lower'),
        grid=report['details'].get('random_allocation_grid'),
        acceptance_range=[low, high],
        in_range=low <= report['epsilon'] <= high,
        within_budget=seconds < budget,
        load_average_after=os.getloadavg(),
      )
      results['rows'].append(row)
      print(json.dumps(row), file=sys.stderr, flush=True)
  row = _calibrate_cold(tempfile.mkdtemp(prefix='dpjax_bench_cache_'))
  row.update(
    case='calibration, target ε = 1, T = 1000, E = 1',
    cache='cold',
    budget_seconds=120.0,
    within_budget=row['seconds'] < 120.0,
    load_average_after=os.getloadavg(),
  )
  results['rows'].append(row)
  print(json.dumps(row), file=sys.stderr, flush=True)
  results['machine']['load_average_after'] = os.getloadavg()
  os.makedirs(os.path.dirname(out_path), exist_ok=True)
  with open(out_path, 'w') as f:
    json.dump(results, f, indent=1)
  return results


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--steps', default='100,1000,10000,100000', help='comma-separated T')
  parser.add_argument('--samplers', default=','.join(SAMPLERS))
  parser.add_argument('--tasks', default=','.join(TASKS))
  parser.add_argument(
    '--timeout',
    type=float,
    default=30.0,
    help='CPU seconds allowed per (combo, T), worker and its children',
  )
  parser.add_argument('--out', default=DEFAULT_OUT)
  parser.add_argument('--plot-only', action='store_true')
  parser.add_argument('--worker', help=argparse.SUPPRESS)
  parser.add_argument(
    '--balls-and-bins-targets',
    action='store_true',
    help='only the issue-15 balls-and-bins cases (module docstring)',
  )
  args = parser.parse_args()
  if args.worker:
    worker(json.loads(args.worker))
    return
  if args.balls_and_bins_targets:
    out = os.path.join(HERE, 'results', 'accounting_scaling_balls_and_bins.json')
    balls_and_bins_targets(out)
    print(f'wrote {out}', file=sys.stderr)
    return
  png = os.path.splitext(args.out)[0] + '.png'
  if args.plot_only:
    with open(args.out) as f:
      plot(json.load(f), png)
    return
  steps = sorted(int(float(s)) for s in args.steps.split(','))
  start = time.perf_counter()
  results = dict(
    question='ε and calibration time per sampler/accountant as T grows (one epoch of T steps)',
    setting=dict(
      config='configs/digits_mlp.py',
      batch_size=BATCH_SIZE,
      num_epochs=1,
      num_examples='100·T',
      delta=DELTA,
      noise_multiplier=NOISE_MULTIPLIER,
      target_epsilon=TARGET_EPSILON,
      max_batch_size='auto',
      estimates=False,
    ),
    timeout_cpu_seconds=args.timeout,
    steps=steps,
    machine=dict(
      provenance.machine(), time=time.strftime('%Y-%m-%d %H:%M:%S'), git=provenance.git_state()
    ),
    rows=[],
  )
  for sampler, accountant in combos(args.samplers.split(',')):
    for task in args.tasks.split(','):
      for row in run_combo(sampler, accountant, task, steps, args.timeout):
        results['rows'].append(dict(sampler=sampler, accountant=accountant, task=task, **row))
      results['seconds'] = time.perf_counter() - start
      results['machine']['load_average_after'] = os.getloadavg()
      os.makedirs(os.path.dirname(args.out), exist_ok=True)
      with open(args.out, 'w') as f:
        json.dump(results, f, indent=1)
  plot(results, png)
  print(f'wrote {args.out} and {png} in {time.perf_counter() - start:.0f} s', file=sys.stderr)


if __name__ == '__main__':
  main()
