"""DP-SGD MLP on scikit-learn's bundled digits (1797 8x8 images; offline).

The embedded default: it needs no download and trains in about a minute on
two CPU cores. Poisson sampling with PLD accounting, δ = 1e-5.

Run:
  python -m dpjax.train --config configs/digits_mlp.py --workdir workdirs/digits_mlp
Smoke run (a few steps):
  python -m dpjax.train --config configs/digits_mlp.py:runlocal --workdir /tmp/smoke
"""

import ml_collections
from ml_collections import config_dict

from dpjax import models


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = config_dict.placeholder(int)  # None: a secret seed drawn from OS entropy (kept in
  #   <workdir>/private/seed.json). Sampling, truncation, noise and init derive from it. An int
  #   here is used as is, but ε then holds only if it is secret: every run of a sweep needs its own.

  # --- Data ------------------------------------------------------------------
  c.data = ml_collections.ConfigDict()
  c.data.source = 'digits'  # digits | tfds | npz | memmap | synthetic
  c.data.name = ''  # TFDS dataset name (source='tfds'), e.g. 'mnist'.
  c.data.data_dir = ''  # Prepared TFDS data_dir (source='tfds'); never downloaded.
  c.data.path = ''  # .npz file with x_train, y_train, x_test, y_test (source='npz'), or a
  #   directory holding <split>/x.npy, <split>/y.npy (source='memmap').
  c.data.train_split = 'train'
  c.data.test_split = 'test'
  c.data.image_key = 'image'  # Feature names in TFDS/npz records.
  c.data.label_key = 'label'
  c.data.num_examples = 0  # Training-set size (source='synthetic' only).
  c.data.input_shape = (8, 8, 1)  # Per-example shape (source='synthetic' only).
  c.data.num_classes = 10  # Synthetic only; read from the data otherwise.
  c.data.scale = 16.0  # Raw values are divided by this (digits pixels are 0..16).
  c.data.mean = (0.0,)  # Public per-channel constants, applied after scaling:
  c.data.std = (1.0,)  #   x = (raw / scale - mean) / std. Never fitted on data.
  c.data.label_format = 'int'  # int | one_hot

  # --- Sampler and batching (the accountant reads the same fields) -----------
  c.sampler = ml_collections.ConfigDict()
  c.sampler.name = 'poisson'  # poisson | balls_and_bins | shuffle | deterministic |
  #                             fixed_size | fixed_size_with_replacement
  c.sampler.batch_size = 256  # Expected logical batch size b (q = b/N for Poisson).
  c.sampler.physical_batch_size = 64  # Rows per jitted call P (static shape); 0 = the largest
  #   that fits the device (chosen at start from XLA's memory analysis, B resolved before it).
  c.sampler.max_batch_size = 0  # Cap B on the logical batch (multiple of P); 0 = auto.

  # --- Privacy ---------------------------------------------------------------
  c.privacy = ml_collections.ConfigDict()
  c.privacy.enabled = True  # False: non-private baseline through the same pipeline.
  c.privacy.clip_norm = 1.0  # C: per-example gradients are clipped to this L2 norm.
  c.privacy.noise_multiplier = config_dict.placeholder(float)  # σ; None: calibrate to target.
  c.privacy.target_epsilon = 3.0  # ε budget at the last step; 0 = none (then σ must be set).
  #   σ None + target: σ is calibrated to meet the target. σ set + target: the run is
  #   refused if it would end above the target.
  c.privacy.delta = 1e-5  # Must be < 1/N (refused otherwise); a warning above 1/(10·N).
  c.privacy.allow_large_delta = False  # True accepts δ >= 1/N (a weak guarantee: see README).
  c.privacy.accountant = 'auto'  # auto | pld | rdp | monte_carlo
  c.privacy.group_size = 1  # k: guarantee for groups of k examples.
  c.privacy.monte_carlo_workers = config_dict.placeholder(int)  # Processes drawing the
  #   balls-and-bins Monte-Carlo samples; None = the available cores (the estimate does not
  #   depend on it).
  c.privacy.random_allocation_timeout = 300.0  # Seconds for the provable balls-and-bins bound
  #   (random allocation, cached on disk); past it the deterministic bound is attached, labelled.
  c.privacy.clipping = 'auto'  # auto | vmap | ghost: how per-example norms are computed.

  # --- Model and optimiser ---------------------------------------------------
  c.model = models.default_model_config('mlp')  # Every field documented there.
  c.model.hidden_sizes = (64,)  # Small: the noise norm grows with √(#params).

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = 'sgd'  # sgd | adam
  c.optimizer.learning_rate = 1.0
  c.optimizer.momentum = 0.0  # sgd only; 0 disables.
  c.optimizer.schedule = 'constant'  # constant | cosine (linear warm-up, then cosine decay to 0
  #   at the last step) | step (piecewise constant); see dpjax/optimizers.py.
  c.optimizer.warmup_steps = 0  # cosine only: steps of linear warm-up from 0.
  c.optimizer.decay_steps = ()  # step only: steps at which the rate is multiplied by
  c.optimizer.decay_factor = 0.1  #   decay_factor (in (0, 1]).

  # --- Recipe: augmentation multiplicity, EMA, fine-tuning (none enters ε) ---
  c.augmult = ml_collections.ConfigDict()
  c.augmult.num_views = 0  # K views per example, gradient averaged over views before the one
  #   clipping (De et al. 2022); 0 or 1 = off. See dpjax/augmult.py.
  c.augmult.crop_padding = 0  # Images: reflect-pad by this many pixels, crop back (0 = no crop).
  c.augmult.flip = False  # Images: random horizontal flip.
  c.ema_decay = 0.0  # EMA of the parameters, decay min(d, (1+t)/(10+t)); 0 = off. dpjax/ema.py.
  c.init_from = ''  # Pretrained params: an .npz ('/'-joined keys), a dpjax workdir or a
  #   checkpoint step directory; '' = train from the initialisation. dpjax/finetune.py.
  c.init_from_rules = ()  # ((regex, replacement), ...) renaming the file's keys; '' drops one.
  c.freeze = ()  # Regexes on '/'-joined parameter paths: frozen (no gradient, noise, clip cost).
  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 0  # r: LoRA adapters W + (alpha/r)·A·B on lora.targets; 0 = no LoRA.
  c.lora.alpha = 1.0  # alpha > 0.
  c.lora.targets = ()  # Regexes on kernel paths (Dense, Conv, attention); their W is frozen.

  # --- Devices ---------------------------------------------------------------
  c.num_devices = 0  # Data-parallel devices (mesh axis 'data'): 0 = all (every host's);
  #   n > 0 = the first n (single process only). P must be a multiple of it.
  c.precision = 'default'  # default | highest | bfloat16 (dpjax.precision): default = the
  #   backend's matmul precision (float32 on CPU, TF32 on recent NVIDIA GPUs); highest =
  #   float32 everywhere; bfloat16 = float32 master weights, bf16 compute. Examples are
  #   clipped to C / (1 + margin of the mode) so each contribution as summed stays <= C.
  c.steps_per_call = 0  # Logical steps per compiled call (dpjax.multi_step; one dispatch for
  #   S steps, same results): 0 = 16 when the data and the physical loop are on the device,
  #   else 1. Calls also end at every log, eval and checkpoint.
  c.compilation_cache_dir = ''  # Persistent XLA cache (dpjax.compilation_cache): '' =
  #   $DPJAX_CACHE_DIR or ~/.cache/dpjax/xla; 'none' = off; else a directory.

  # --- Length and periodic actions -------------------------------------------
  c.num_epochs = 40  # Exactly one of num_epochs / num_steps is > 0 (the other 0);
  c.num_steps = 0  #   an epoch is ceil(N/b) steps.
  c.log_every_steps = 20
  c.eval_every_steps = 100  # Also evaluated at the first and the last step.
  c.checkpoint_every_steps = 100  # Also saved at the last step.
  c.keep_checkpoints = 3

  # --- Empirical privacy audit (dpjax.auditing; README "Auditing") -------------
  c.audit = ml_collections.ConfigDict()
  c.audit.num_canaries = 0  # m gradient canaries, each in the data by a fair coin; 0 = off.
  #   They are m extra rows (N + m examples for sampler and accountant), so the audit
  #   settings belong to the run's privacy fingerprint.
  c.audit.kind = 'gradient'  # gradient: a canary's gradient is a fixed direction of norm > C.
  c.audit.confidence = 0.95  # 1 - β: the ε lower bound holds with at least this probability.
  c.audit.every_checkpoint = False  # Also audit at every checkpoint (else the last step only).

  if arg == 'runlocal':
    c.num_epochs = 0
    c.num_steps = 5
    c.eval_every_steps = 5
    c.checkpoint_every_steps = 2
  return c
