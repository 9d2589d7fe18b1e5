#!/usr/bin/env bash
# GPU session driver (device machine): GPU tests + benchmark, logs under $OUT (at most 8 files come back).
#   bash benchmarks/run_gpu.sh early   # decode tests, decode bench + tile sweep, one chunk smoke test
#   bash benchmarks/run_gpu.sh final   # all TileLang GPU tests, layer parity + training example, full benchmark
# Carry the precompiled kernels: GDN2_JAX_CACHE_DIR=kernels/_cache python -m kernels.build --preset tests (etc.)
set -o pipefail
source .gpu/env.sh
export PYTHONPATH=.:$PYTHONPATH GDN2_JAX_CACHE_DIR=$PWD/kernels/_cache XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "${1:-early}" in
  early)
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
    timeout ${T_TESTS:-150} python -m pytest tests/test_tilelang_gpu.py -q -p no:cacheprovider -rs --maxfail=8 \
      -k "fused_recurrent_gdn2 or decode" 2>&1 | tee "$OUT/tests.txt" | tail -45
    timeout ${T_CHUNK:-60} python -m pytest tests/test_tilelang_gpu.py -q -p no:cacheprovider \
      -k "chunk_gdn2 and bfloat16-128-4-8-200" 2>&1 | tee "$OUT/chunk.txt" | tail -25
    timeout ${T_BENCH:-150} python -m benchmarks.bench --skip-prefill --skip-xla --skip-accuracy --decode-sweep \
      --out "$OUT" 2>&1 | tee "$OUT/bench.txt" | grep -v "^decode {\|^sweep {" | tail -30
    ;;
  final)
    # order = priority; each step has its own time limit so a slow one cannot starve the rest
    { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
      # compile whatever the carried cache lacks, in parallel (a no-op when kernels/_cache is warm)
      timeout ${T_BUILD:-60} python -m kernels.build --preset tests,bench,layers -j 14 2>&1 | grep -v INFO | tail -1
      timeout ${T_TESTS:-80} python -m pytest tests/test_tilelang_gpu.py -q -p no:cacheprovider -rs 2>&1 \
        | grep -v INFO; } 2>&1 | tee "$OUT/tests.txt" | tail -25
    timeout ${T_BENCH:-120} python -m benchmarks.bench --skip-graph --xla-max-tokens ${XLA_MAX:-65536} --out "$OUT" \
      ${BENCH_ARGS} 2>&1 | grep -v INFO | tee "$OUT/bench.txt" | grep -v "^decode {\|^prefill\|^sweep {" | tail -45
    timeout ${T_PARITY:-55} python -m pytest tests/test_flax_fla_parity.py -v -rs -p no:cacheprovider 2>&1 \
      | grep -v INFO | tee "$OUT/parity.log" | tail -8
    timeout ${T_TRAIN:-65} python examples/train_lm.py --backend tilelang --show-hlo --steps 30 --eval-batches 1 \
      --min-loss-drop 0 --checkpoint /tmp/ck.npz 2>&1 | tr '\r' '\n' | grep -v "step/s\|INFO" \
      | tee "$OUT/train.log" | tail -8
    ;;
esac
