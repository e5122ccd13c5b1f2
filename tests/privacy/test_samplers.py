"""Statistical tests of the samplers (fixed seeds; each could fail if wrong).

Every test compares against the law the sampler must follow: χ² goodness of
fit for batch sizes and per-example inclusion counts, exact
once-per-epoch coverage, and distinctness. p-value thresholds are 1e-4 so a
correct sampler fails with negligible probability at the fixed seeds, while a
wrong law (e.g. a biased q or a non-uniform assignment) is rejected.
"""

import math
import time
import tracemalloc

import ml_collections
import numpy as np
import pytest
from scipy import stats

from dpjax.trainer.planning import plan as plan_lib
from dpjax.privacy import sampler_base
from dpjax.privacy import samplers

P_MIN = 1e-4


def make(name, num_examples, batch_size, seed=0):
  config = ml_collections.ConfigDict(
    {'seed': seed, 'sampler': {'name': name, 'batch_size': batch_size}}
  )
  return plan_lib.make_sampler(config, num_examples)


def binomial_chi2_pvalue(sizes, n, p):
  """χ² test of observed sizes against Binomial(n, p), pooling sparse tails."""
  sizes = np.asarray(sizes)
  lo, hi = stats.binom.ppf([1e-3, 1 - 1e-3], n, p).astype(int)
  edges = np.arange(lo, hi + 2)
  observed = np.array(
    [(sizes < lo).sum()] + [np.sum(sizes == k) for k in edges[:-1]] + [(sizes > hi).sum()]
  )
  probs = np.concatenate(
    [[stats.binom.cdf(lo - 1, n, p)], stats.binom.pmf(edges[:-1], n, p), [stats.binom.sf(hi, n, p)]]
  )
  expected = probs * len(sizes)
  # Merge bins with expected count < 5 into neighbours.
  obs_m, exp_m, acc_o, acc_e = [], [], 0.0, 0.0
  for o, e in zip(observed, expected):
    acc_o += o
    acc_e += e
    if acc_e >= 5:
      obs_m.append(acc_o)
      exp_m.append(acc_e)
      acc_o = acc_e = 0.0
  obs_m[-1] += acc_o
  exp_m[-1] += acc_e
  exp_m = np.array(exp_m) * sum(obs_m) / sum(exp_m)
  return stats.chisquare(obs_m, exp_m).pvalue


def inclusion_counts(sampler, steps):
  counts = np.zeros(sampler.num_examples, dtype=np.int64)
  for t in range(steps):
    np.add.at(counts, sampler.indices(t), 1)
  return counts


@pytest.mark.parametrize('name', samplers.SAMPLER_NAMES)
def test_indices_are_a_pure_function_of_seed_and_step(name):
  s = make(name, 1000, 50, seed=3)
  again = make(name, 1000, 50, seed=3)
  # Out of order, and across an epoch boundary: no replay is needed.
  for t in (57, 3, 20, 0, 57):
    np.testing.assert_array_equal(s.indices(t), again.indices(t))
  if name != 'deterministic':
    other = make(name, 1000, 50, seed=4)
    assert not all(np.array_equal(s.indices(t), other.indices(t)) for t in range(5))
  idx = s.indices(7)
  assert idx.dtype == np.int64 and np.all(np.diff(idx) >= 0)
  assert idx.min(initial=0) >= 0 and idx.max(initial=0) < 1000


def test_poisson_batch_sizes_follow_binomial():
  s = make('poisson', 2000, 100, seed=1)
  sizes = [len(s.indices(t)) for t in range(3000)]
  assert binomial_chi2_pvalue(sizes, 2000, 0.05) > P_MIN
  assert np.mean(sizes) == pytest.approx(100, abs=4 * math.sqrt(100 * 0.95 / 3000))


def test_poisson_inclusion_frequency_and_distinctness():
  n, q, steps = 500, 0.1, 2000
  s = make('poisson', n, int(q * n), seed=2)
  for t in range(20):
    idx = s.indices(t)
    assert len(np.unique(idx)) == len(idx)
  counts = inclusion_counts(s, steps)
  # Each count ~ Binomial(steps, q) independently: Σ z² ~ χ²(n).
  z2 = ((counts - steps * q) ** 2 / (steps * q * (1 - q))).sum()
  assert stats.chi2.sf(z2, n) > P_MIN and stats.chi2.cdf(z2, n) > P_MIN
  # Joint inclusion of two examples ~ q² (independence).
  both = sum(np.isin([0, 1], s.indices(t)).all() for t in range(steps))
  assert both == pytest.approx(steps * q * q, abs=5 * math.sqrt(steps * q * q))


def test_poisson_rejects_a_biased_sampler():
  """The χ² test used above has power: a sampler with q' = 1.1 q fails it."""
  rng = np.random.default_rng(0)
  sizes = rng.binomial(2000, 0.055, size=3000)
  assert binomial_chi2_pvalue(sizes, 2000, 0.05) < P_MIN


def test_poisson_cost_does_not_grow_with_dataset_size():
  small, large = make('poisson', 10_000, 256), make('poisson', 10**9, 256)

  def per_step(s):
    start = time.perf_counter()
    for t in range(200):
      s.indices(t)
    return time.perf_counter() - start

  per_step(small)
  assert per_step(large) < 5 * per_step(small) + 0.05


@pytest.mark.parametrize('name', ['balls_and_bins', 'shuffle', 'deterministic'])
def test_epoch_samplers_use_every_example_exactly_once_per_epoch(name):
  n, b = 1003, 40  # b does not divide n.
  s = make(name, n, b, seed=5)
  assert s.steps_per_epoch == math.ceil(n / b)
  for epoch in range(3):
    batches = [s.indices(epoch * s.steps_per_epoch + t) for t in range(s.steps_per_epoch)]
    np.testing.assert_array_equal(np.sort(np.concatenate(batches)), np.arange(n))
  if name != 'balls_and_bins':
    sizes = [len(s.indices(t)) for t in range(s.steps_per_epoch)]
    assert sizes == [b] * (s.steps_per_epoch - 1) + [n - (s.steps_per_epoch - 1) * b]


def test_deterministic_is_dataset_order():
  s = make('deterministic', 10, 4)
  assert [s.indices(t).tolist() for t in range(4)] == [
    [0, 1, 2, 3],
    [4, 5, 6, 7],
    [8, 9],
    [0, 1, 2, 3],
  ]


def test_balls_and_bins_sizes_are_binomial_and_bins_uniform():
  n, b = 600, 30
  s = make('balls_and_bins', n, b, seed=7)
  bins = s.steps_per_epoch
  epochs = 150
  sizes, position = [], np.zeros((n, bins), dtype=np.int64)
  for e in range(epochs):
    for t in range(bins):
      idx = s.indices(e * bins + t)
      sizes.append(len(idx))
      position[idx, t] += 1
  assert binomial_chi2_pvalue(sizes, n, 1 / bins) > P_MIN
  # The bin of each example is uniform over the T bins, independently per epoch.
  pooled = position.sum(axis=0)
  assert stats.chisquare(pooled).pvalue > P_MIN
  per_example = stats.chisquare(position[:50], axis=1).pvalue
  assert stats.kstest(per_example, 'uniform').pvalue > P_MIN
  # Different epochs use different assignments.
  assert not np.array_equal(s.indices(0), s.indices(bins))


def test_shuffle_positions_are_uniform_across_epochs():
  n, b = 60, 10
  s = make('shuffle', n, b, seed=11)
  batch_of = np.zeros((n, s.steps_per_epoch), dtype=np.int64)
  for e in range(600):
    for t in range(s.steps_per_epoch):
      batch_of[s.indices(e * s.steps_per_epoch + t), t] += 1
  assert stats.chisquare(batch_of.ravel()).pvalue > P_MIN


def test_fixed_size_without_replacement():
  n, b, steps = 300, 30, 3000
  s = make('fixed_size', n, b, seed=13)
  for t in range(50):
    idx = s.indices(t)
    assert len(idx) == b and len(np.unique(idx)) == b
  counts = inclusion_counts(s, steps)
  assert counts.sum() == b * steps
  # Counts are Binomial(steps, b/N) marginally (negatively correlated; the χ² sum
  # has a slightly smaller variance, so only an upper-tail test is exact).
  z2 = ((counts - steps * b / n) ** 2 / (steps * b / n * (1 - b / n))).sum()
  assert stats.chi2.sf(z2, n) > P_MIN


def test_fixed_size_with_replacement():
  n, b, steps = 50, 20, 4000
  s = make('fixed_size_with_replacement', n, b, seed=17)
  distinct = [len(np.unique(s.indices(t))) for t in range(steps)]
  assert all(len(s.indices(t)) == b for t in range(10))
  expected_distinct = n * (1 - (1 - 1 / n) ** b)
  assert np.mean(distinct) == pytest.approx(expected_distinct, abs=0.05)
  # Birthday problem: Pr[no duplicate] = Π_{i<b} (1 − i/N) ≈ 0.0143.
  p_distinct = np.prod(1 - np.arange(b) / n)
  observed = np.sum(np.array(distinct) == b)
  assert stats.binomtest(observed, steps, p_distinct).pvalue > P_MIN
  counts = inclusion_counts(s, steps)
  assert stats.chisquare(counts).pvalue > P_MIN  # Multinomial, uniform.


def test_expected_batch_sizes_and_probabilities():
  assert make('poisson', 1000, 64).expected_batch_size == pytest.approx(64)
  assert make('poisson', 1000, 64).sampling_probability == pytest.approx(0.064)
  bb = make('balls_and_bins', 1000, 64)
  assert bb.steps_per_epoch == 16 and bb.sampling_probability == pytest.approx(1 / 16)
  assert bb.expected_batch_size == pytest.approx(1000 / 16)
  assert make('shuffle', 1000, 64).expected_batch_size == 64


@pytest.mark.parametrize(
  'name,batch_size,message',
  [
    ('bogus', 10, 'sampler.name'),
    ('poisson', 2000, 'sampler.batch_size'),
    ('shuffle', 0, 'sampler.batch_size'),
    ('fixed_size', 2.5, 'sampler.batch_size'),
  ],
)
def test_bad_input_names_the_field(name, batch_size, message):
  with pytest.raises(ValueError, match=message):
    make(name, 1000, batch_size)


def test_negative_step_is_rejected():
  with pytest.raises(ValueError, match='step'):
    make('poisson', 100, 10).indices(-1)


def test_uniform_permutation_is_numpys_permutation_in_int32():
  """Same draws as rng.permutation (unchanged law and streams), 4 bytes per index."""
  for n in (1, 2, 1003):
    order = sampler_base.uniform_permutation(sampler_base.sampler_generator(9, 1, 2), n)
    reference = sampler_base.sampler_generator(9, 1, 2).permutation(n)
    assert order.dtype == np.int32
    np.testing.assert_array_equal(order, reference)


def traced_peak_bytes(fn):
  """Peak bytes allocated (numpy buffers are traced by tracemalloc) while fn runs."""
  tracemalloc.start()
  try:
    fn()
    return tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()


@pytest.mark.parametrize(
  'name', ['poisson', 'fixed_size', 'fixed_size_with_replacement', 'deterministic']
)
def test_per_step_samplers_allocate_o_of_b_at_n_1e8(name):
  s = make(name, 10**8, 256, seed=1)
  for step in (0, 390_626):  # Also past the first epoch.
    peak = traced_peak_bytes(lambda: s.indices(step))
    assert peak < 200_000, peak  # O(N) would be >= 4e8 bytes.


@pytest.mark.parametrize('name', ['balls_and_bins', 'shuffle'])
def test_epoch_samplers_keep_4_bytes_per_example_for_one_epoch(name):
  """The documented index structure: an int32 permutation plus T + 1 int64 offsets."""
  n, b = 2_000_000, 256
  s = make(name, n, b, seed=2)
  documented = 4 * n + 8 * (s.steps_per_epoch + 1)
  tracemalloc.start()
  try:
    s.indices(0)
    current, peak = tracemalloc.get_traced_memory()
    # Kept: the structure itself; transient: the multinomial's T probabilities and sizes.
    assert documented <= current <= documented + 50_000
    assert peak <= documented + 32 * s.steps_per_epoch + 50_000
    tracemalloc.reset_peak()
    s.indices(s.steps_per_epoch)  # The next epoch replaces the cached one.
    current, peak = tracemalloc.get_traced_memory()
    assert documented <= current <= documented + 50_000
    assert peak <= documented + 32 * s.steps_per_epoch + 50_000  # Never two epochs at once.
  finally:
    tracemalloc.stop()


def test_no_module_outside_samplers_branches_on_a_sampler_name():
  """Accounting asks the sampler class (its `analysis` and privacy facts), never its name:
  no string constant equal to a sampler name appears in dpjax's code outside samplers.py,
  except as a documented default argument value (e.g. the planner's sampler='poisson'), as
  config values (the field declarations of config_fields.py, the configs in configs/) and in
  names.py, the registry's names without its imports (for fast command lines; a test holds it
  equal to samplers.SAMPLER_NAMES)."""
  import ast  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel

  root = pathlib.Path(samplers.__file__).parent
  found = []
  for path in sorted(root.rglob('*.py')):
    if path.name in ('samplers.py', 'names.py', 'config_fields.py') or 'configs' in path.parts:
      continue
    tree = ast.parse(path.read_text())
    defaults = {
      id(d)
      for node in ast.walk(tree)
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
      for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
    }
    found += [
      f'{path.relative_to(root)}:{node.lineno}: {node.value!r}'
      for node in ast.walk(tree)
      if isinstance(node, ast.Constant)
      and node.value in samplers.SAMPLER_NAMES
      and id(node) not in defaults
    ]
  assert not found, found


@pytest.mark.parametrize('name', samplers.SAMPLER_NAMES)
def test_every_sampler_names_an_analysis_the_accountant_has(name):
  from dpjax.privacy.accounting import analyses  # pylint: disable=import-outside-toplevel

  cls = samplers.sampler_class(name)
  assert cls.analysis in analyses.ANALYSES
  assert set(cls.group_accountants) <= set(cls.accountants) | {'pld'}


def test_the_names_the_flags_offer_are_the_registries():
  """`names` lists the samplers and accountants without importing them; these are the ones."""
  from dpjax.privacy import names  # pylint: disable=import-outside-toplevel
  from dpjax.privacy import samplers  # pylint: disable=import-outside-toplevel
  from dpjax.privacy.accounting import accountant  # pylint: disable=import-outside-toplevel

  assert names.SAMPLER_NAMES == samplers.SAMPLER_NAMES  # The registry's keys, in its order.
  assert all(samplers.sampler_class(name).name == name for name in names.SAMPLER_NAMES)
  assert accountant.ACCOUNTANTS is names.ACCOUNTANTS
  with pytest.raises(ValueError, match='valid: auto, pld, rdp, monte_carlo'):
    accountant.resolve_accountant('poisson', 'nope')
