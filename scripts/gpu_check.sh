#!/usr/bin/env bash
# One pass of the checks that need a GPU, for a lent machine with jax[cuda] preinstalled and no
# network: the pinned pure-Python dependencies travel as wheels in .whl/ (scripts/README.md,
# "GPU checks"). Benchmarks first (each bounded), then the suite (or the tests listed in a file)
# with JAX_PLATFORMS=cuda until its time runs out; JSON and the log go under $OUT (./gpu_out).
#   [BENCH_MODELS="mlp cnn"] [CLIP_S=170] [FORMS_MODELS="cnn wrn vit"] [FORMS_S=120]
#   [FORMS_METHODS="all_ghost"] [E2E_S=0] [E2E_CONFIGS=wrn_synthetic]
#   bash scripts/gpu_check.sh [suite_seconds] [test_list_file]
# CLIP_S bounds bench_clipping (WRN-16-4 and ViT compile six programs each: give them ~300 s);
# FORMS_MODELS runs bench_clipping --forms, one process per model bounded by FORMS_S each (the
# FLOP rule's forms against the measured ones; FORMS_METHODS adds the forced forms);
# E2E_S > 0 also runs bench_e2e (the trainer against its kernel) for that long; suite_seconds = 0
# skips the suite. Programs that compile to the same text are compiled once: the persistent
# compilation cache is on (JAX_COMPILATION_CACHE_DIR, a fresh folder).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
SUITE_S=${1:-240}
TESTS=()
if [ -n "${2:-}" ]; then mapfile -t TESTS < "$2"; fi
rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$(mktemp -d)}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
nvidia-smi -L
python3 - <<'PY' || exit 4
import jax, flax, optax, numpy, scipy, dp_accounting, ml_collections, orbax.checkpoint
import dpjax.privacy.dp_step, dpjax.train
print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__,
      'numpy', numpy.__version__, 'devices', jax.devices())
PY
for model in ${FORMS_MODELS:-}; do
  # shellcheck disable=SC2086
  timeout "${FORMS_S:-120}" python3 scripts/bench_clipping.py --forms --models "$model" \
    --repeats 7 --form-methods nonprivate ${FORMS_METHODS:-} \
    --out "$OUT/bench_clipping_forms_${model}_gpu.json" 2>&1 | grep -v cuda_timer | tail -4
done
if [ "${E2E_S:-0}" -gt 0 ]; then
  # shellcheck disable=SC2086
  timeout "$E2E_S" python3 scripts/bench_e2e.py --repeats 3 --configs ${E2E_CONFIGS:-digits_mlp wrn_synthetic} \
    --out "$OUT/e2e_gpu.json" 2>&1 | tail -12
fi
BENCH_MODELS=${BENCH_MODELS-mlp cnn wrn transformer vit}
if [ -n "$BENCH_MODELS" ]; then
  # shellcheck disable=SC2086
  timeout "${CLIP_S:-170}" python3 scripts/bench_clipping.py --models $BENCH_MODELS --repeats 7 \
    --verify-below-s 5 --out "$OUT/bench_clipping_gpu.json" 2>&1 | grep -v cuda_timer | tail -25
  [ "${LIBRARY_S:-60}" -gt 0 ] && timeout "${LIBRARY_S:-60}" python3 scripts/bench_library.py --rounds 5 --out "$OUT/bench_library_gpu.json" \
    2>&1 | tail -12
fi
[ "$SUITE_S" -gt 0 ] || exit 0
# -v: each result is logged as it ends, so a run cut off by its time still reports them.
timeout "$SUITE_S" python3 -m pytest -n 12 -v -p no:cacheprovider -rf --tb=short \
  --durations=15 --timeout=150 --junitxml="$OUT/junit_gpu.xml" "${TESTS[@]}" 2>&1 \
  | tee "$OUT/pytest_gpu.log" | grep -v PASSED | tail -70
echo "suite exit ${PIPESTATUS[0]}"
