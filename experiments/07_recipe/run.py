"""The DP training recipe on digits: baseline / +augmult / +EMA / +both / fine-tuned, same ε.

Question: at one ε, how much do augmentation multiplicity (dpjax/privacy/augmult.py),
EMA of the parameters (dpjax/privacy/ema.py) and fine-tuning from a non-privately
pretrained model (dpjax/trainer/planning/finetune.py) change the test accuracy of the digits
MLP, and is the difference larger than the seed-to-seed spread?

Setup. Digits' training split is cut in two halves by a fixed permutation: A
is "public" (pretraining, non-private, 30 epochs of plain SGD) and B is the
private set. Every private run trains on B only, with the same sampler, b, C,
number of steps and the σ calibrated by `dpjax.trainer.planning.plan.make_plan` to the same
target ε (δ = 1e-5), so the ε of every row is identical and covers B only;
augmult and EMA change nothing the accountant sees (asserted below: the same
σ and ε for every variant). 'finetune' starts from the pretrained parameters
(read back from an .npz through `finetune.load_pretrained`), all trainable;
'finetune_head' freezes the hidden layer (only the head is clipped and noised).

Until dpjax.train integrates these modules, the loop is written here over
`dpjax.trainer.planning.plan.make_plan` + `dpjax.privacy.batching.Batcher` + `dpjax.privacy.dp_step.DPStep`
(given `augmult`, the step's loss is the view-mean loss and `accumulate` takes each row's
views, made here on the host).

Run (≈ 3-6 minutes on the shared 2-core CPU):
  nice -n 10 python experiments/07_recipe/run.py
Writes results.json and recipe.png beside this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
from dpjax.configs import digits_mlp  # pylint: disable=g-import-not-at-top
from dpjax.privacy import augmult
from dpjax.privacy import batching
from dpjax.data import arrays
from dpjax.data import sources as data
from dpjax.privacy import dp_step
from dpjax.privacy import ema
from dpjax.trainer.planning import finetune
from dpjax.models import factory as models
from dpjax.trainer.planning import optimizers
from dpjax.trainer.planning import plan as plan_lib
from dpjax.privacy import losses
from dpjax.privacy import prng

HERE = os.path.dirname(os.path.abspath(__file__))
SPLIT_SEED = 1234  # The fixed public/private split of digits' training set.


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str
  num_views: int = 0  # augmult K (0 = off).
  ema_decay: float = 0.0
  finetune: bool = False
  freeze: tuple[str, ...] = ()
  learning_rate: float = 2.0  # Fine-tuning uses a smaller step (chosen once, not per seed).


VARIANTS = (
  Variant('baseline'),
  Variant('augmult', num_views=8),
  Variant('ema', ema_decay=0.95),
  Variant('augmult+ema', num_views=8, ema_decay=0.95),
  Variant('finetune', finetune=True, learning_rate=0.5),
  Variant('finetune_head', finetune=True, freeze=('Dense_0/',), learning_rate=0.5),
)


def base_config(seed: int, epsilon: float, num_steps: int, sigma: float | None = None):
  """The shared config; σ None: calibrated to `epsilon`, else fixed (and ε then reported)."""
  c = digits_mlp.get_config()
  c.seed = seed
  c.num_epochs, c.num_steps = 0, num_steps
  c.sampler.batch_size = 128
  c.sampler.physical_batch_size = 64
  c.privacy.target_epsilon = epsilon if sigma is None else 0.0
  c.privacy.noise_multiplier = sigma
  c.privacy.clip_norm = 1.0
  c.augmult.crop_padding = 1  # Digits: ±1 pixel shifts; no flips (a mirrored 2 is not a 2).
  c.augmult.flip = False
  return c


def halves(source: arrays.ArraySource) -> tuple[arrays.ArraySource, arrays.ArraySource]:
  """(public A, private B): a fixed permutation of the training split cut in two."""
  order = np.random.default_rng(SPLIT_SEED).permutation(len(source))
  a, b = np.sort(order[: len(order) // 2]), np.sort(order[len(order) // 2 :])
  return tuple(
    arrays.ArraySource(source.images[i], source.labels[i], source.preprocess) for i in (a, b)
  )


def evaluate(model, params, source, batch_size=256) -> float:
  correct = total = 0.0
  for start in range(0, len(source), batch_size):
    idx = np.arange(start, min(start + batch_size, len(source)))
    batch = source.gather(idx)
    batch['weight'] = np.ones(len(idx), np.float32)
    out = losses.eval_step(model, params, batch)
    correct += float(out['correct'])
    total += float(out['num_examples'])
  return correct / total


def pretrain(config, public, epochs: int = 30):
  """Non-private SGD on the public half through the same pipeline; returns params."""
  config = config.copy_and_resolve_references()
  config.privacy.enabled = False
  config.num_steps = epochs * -(-len(public) // config.sampler.batch_size)
  config.sampler.name = 'shuffle'
  params, _ = train(config, public, Variant('pretrain', learning_rate=0.5))
  return params


def train(config, train_source, variant: Variant, init=None):
  """One run of `variant`; returns (params to evaluate, info)."""
  config = config.copy_and_resolve_references()
  config.optimizer.learning_rate = variant.learning_rate
  plan = plan_lib.make_plan(config, train_source)
  batcher = batching.Batcher(
    plan.sampler,
    plan.perf.physical_batch_size,
    plan.privacy.max_batch_size if plan.private else plan.max_batch_size,
  )
  model = models.make_model(config.model, train_source.num_classes, train_source.input_shape)
  params = prng.init_params(model, config.seed, train_source.input_shape)
  eval_model = model
  if init is not None:
    params = init
    if variant.freeze:
      model, params = finetune.make_finetune(model, params, freeze=variant.freeze)
  optimizer = optimizers.make_optimizer(config.optimizer, plan.num_steps)
  k = variant.num_views
  views = None
  if k > 1:
    augmult.check_config(
      k, config.augmult.crop_padding, config.augmult.flip, train_source.input_shape
    )
    views = augmult.Augmult(k, config.augmult.crop_padding, config.augmult.flip)
  if plan.private:  # σ, C, b, B and the seed from the run's privacy plan.
    step = dp_step.DPStep.from_plan(model, optimizer, plan.privacy, clipping='vmap', augmult=views)
  else:
    step = dp_step.DPStep.non_private(
      model,
      optimizer,
      plan.sampler.expected_batch_size,
      plan.seed,
      clipping='vmap',
      augmult=views,
    )
  opt_state = optimizer.init(params)
  averaged = ema.init(params) if variant.ema_decay else None
  ema_update = jax.jit(ema.update, static_argnums=2)
  for t in range(plan.num_steps):
    acc = step.init_accumulator(params)
    for indices, weights in batcher.logical_batch(t).physical_batches():
      batch = train_source.gather(indices)
      batch['weight'] = weights
      if k > 1:
        batch['x'] = augmult.make_views(
          batch['x'],
          indices,
          t,
          seed=config.seed,
          num_views=k,
          crop_padding=config.augmult.crop_padding,
          flip=config.augmult.flip,
        )
      acc = step.accumulate(params, acc, batch)
    params, opt_state, _ = step.apply(params, opt_state, acc, t)
    if averaged is not None:
      averaged = ema_update(averaged, params, variant.ema_decay)
  final = averaged.params if averaged is not None else params
  if eval_model is not model:
    final = model.full_params(final)
  info = {
    'num_steps': plan.num_steps,
    'noise_multiplier': plan.privacy.noise_multiplier if plan.private else None,
    'epsilon': plan.privacy.final_report(estimates=False).epsilon if plan.private else None,
  }
  return final, info


def run_variant(
  variant: Variant,
  seed: int,
  epsilon: float,
  num_steps: int,
  pretrained_npz: str | None = None,
  sigma: float | None = None,
):
  """Test accuracy and ε of one (variant, seed) on the private half."""
  config = base_config(seed, epsilon, num_steps, sigma)
  train_source, test_source = data.make_sources(config.data, seed=seed)
  _, private = halves(train_source)
  init = None
  if variant.finetune:
    model = models.make_model(config.model, private.num_classes, private.input_shape)
    template = prng.init_params(model, seed, private.input_shape)
    init = finetune.load_pretrained(pretrained_npz, template)
  params, info = train(config, private, variant, init)
  model = models.make_model(config.model, private.num_classes, private.input_shape)
  return {
    'variant': variant.name,
    'seed': seed,
    'test_accuracy': evaluate(model, params, test_source),
    **info,
  }


def augmentation_control(seed: int, num_steps: int = 120) -> dict[str, float]:
  """Non-private test accuracy on B with and without augmult: is the augmentation itself useful?"""
  out = {}
  for variant in (
    Variant('baseline', learning_rate=0.5),
    Variant('augmult', num_views=8, learning_rate=0.5),
  ):
    config = base_config(seed, 1.0, num_steps)
    config.privacy.enabled = False
    config.sampler.name = 'shuffle'
    train_source, test_source = data.make_sources(config.data, seed=seed)
    _, private = halves(train_source)
    params, _ = train(config, private, variant)
    model = models.make_model(config.model, private.num_classes, private.input_shape)
    out[variant.name] = evaluate(model, params, test_source)
  return out


def pretrain_npz(path: str, seed: int = 0) -> None:
  """Pretrains on the public half and saves the parameters as an .npz."""
  config = base_config(seed, 1.0, 1)
  train_source, _ = data.make_sources(config.data, seed=seed)
  public, _ = halves(train_source)
  finetune.save_npz(path, pretrain(config, public))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument('--seeds', type=int, default=3)
  parser.add_argument('--epsilon', type=float, default=4.0)
  parser.add_argument('--num_steps', type=int, default=60)
  parser.add_argument('--out', default=HERE)
  args = parser.parse_args(argv)
  rows = []
  start = time.time()
  with tempfile.TemporaryDirectory() as tmp:
    npz = os.path.join(tmp, 'pretrained.npz')
    pretrain_npz(npz)
    config = base_config(0, 1.0, 1)
    train_source, test_source = data.make_sources(config.data)
    public, _ = halves(train_source)
    model = models.make_model(config.model, public.num_classes, public.input_shape)
    pretrained_acc = evaluate(
      model,
      finetune.load_pretrained(npz, prng.init_params(model, 0, public.input_shape)),
      test_source,
    )
    print(f'pretrained on the public half (no fine-tuning): {pretrained_acc:.4f}', flush=True)
    for variant in VARIANTS:
      for seed in range(args.seeds):
        row = run_variant(variant, seed, args.epsilon, args.num_steps, npz)
        rows.append(row)
        print(json.dumps(row), flush=True)
  control = [augmentation_control(seed) for seed in range(args.seeds)]
  print('non-private control (no DP):', control, flush=True)
  sigmas = {round(r['noise_multiplier'], 12) for r in rows}
  epsilons = {round(r['epsilon'], 9) for r in rows}
  assert len(sigmas) == 1 and len(epsilons) == 1, (sigmas, epsilons)  # Same ε for every row.
  summary = {}
  base = np.array([r['test_accuracy'] for r in rows if r['variant'] == 'baseline'])
  for variant in VARIANTS:
    acc = np.array([r['test_accuracy'] for r in rows if r['variant'] == variant.name])
    diff = acc - base  # Paired by seed (same sampler, noise and init streams).
    summary[variant.name] = {
      'mean': float(acc.mean()),
      'std': float(acc.std(ddof=1)),
      'min': float(acc.min()),
      'max': float(acc.max()),
      'diff_vs_baseline_mean': float(diff.mean()),
      'diff_vs_baseline_std': float(diff.std(ddof=1)),
    }
  result = {
    'question': 'test accuracy at the same ε: baseline / +augmult / +EMA / +both / fine-tuned',
    'setup': {
      'dataset': 'sklearn digits; private = half B of the training split (seed '
      f'{SPLIT_SEED}), public = half A (pretraining only)',
      'model': 'MLP 64 tanh',
      'batch_size': 128,
      'num_steps': args.num_steps,
      'clip_norm': 1.0,
      'delta': 1e-5,
      'target_epsilon': args.epsilon,
      'epsilon': rows[0]['epsilon'],
      'noise_multiplier': rows[0]['noise_multiplier'],
      'augmult': 'K = 8, crop_padding 1, no flip',
      'ema_decay': 0.95,
      'optimizer': 'sgd, constant lr 2.0 (fine-tuning 0.5)',
      'seeds': args.seeds,
    },
    'pretrained_public_only_accuracy': pretrained_acc,
    'summary': summary,
    'rows': rows,
    'nonprivate_augmentation_control': {
      'what': 'non-private SGD (lr 0.5, 120 steps, b = 128, shuffle) on B, without / with '
      'augmult K = 8 (crop_padding 1): the augmentation alone, no clipping or noise',
      'per_seed': control,
    },
    'commit': subprocess.run(
      ['git', 'rev-parse', 'HEAD'], capture_output=True, text=True, cwd=HERE, check=False
    ).stdout.strip(),
    'machine': '2-core CPU shared with other agents',
    'seconds': time.time() - start,
  }
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'results.json'), 'w') as f:
    json.dump(result, f, indent=2)
  plot(result, os.path.join(args.out, 'recipe.png'))
  for name, s in summary.items():
    print(
      f'{name:14s} {s["mean"]:.4f} ± {s["std"]:.4f}   Δ vs baseline '
      f'{s["diff_vs_baseline_mean"]:+.4f} ± {s["diff_vs_baseline_std"]:.4f}'
    )
  return 0


def plot(result, path):
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  names = list(result['summary'])
  fig, ax = plt.subplots(figsize=(7, 3.5))
  for i, name in enumerate(names):
    accs = [r['test_accuracy'] for r in result['rows'] if r['variant'] == name]
    ax.scatter([i] * len(accs), accs, color='C0', alpha=0.6, s=18)
    s = result['summary'][name]
    ax.errorbar(i, s['mean'], yerr=s['std'], color='C1', capsize=4, marker='_', ms=14)
  ax.axhline(
    result['pretrained_public_only_accuracy'],
    color='gray',
    ls=':',
    label='pretrained on public half, no fine-tuning',
  )
  ax.set_xticks(range(len(names)), names, rotation=20)
  ax.set_ylabel('test accuracy')
  setup = result['setup']
  ax.set_title(
    f'digits MLP, private half, ε = {setup["epsilon"]:.2f} (δ = 1e-5), '
    f'{setup["num_steps"]} steps, {setup["seeds"]} seeds'
  )
  ax.legend(loc='lower right', fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == '__main__':
  sys.exit(main())
