#!/usr/bin/env bash
# GPU session driver (device machine), from the repository root:  bash benchmarks/run_gpu.sh STEP[,STEP...]
#   build   compile what the carried kernel cache (.kcache/) lacks (-j 15; BUILD_PRESET, default all; then the
#           benchmark's kernels unless BUILD_BENCH=0); the cache comes back as kcache.tgz.part-* (KCACHE_BACK=0: not;
#           KCACHE_PRESETS=bench,layers: those presets' kernels only; put the parts into .kc/ and carry ".kc")
#   bgbuild start `build` (BUILD_PRESET, -j BG_JOBS, default 10) in its own process session, so that it outlives
#           this call and fills .kcache/ on the warm machine while the other steps run; `bgwait` (a later step or call
#           on the same warm machine) waits for it (T_BGWAIT s) and shows its summary (log: /tmp/bgbuild.log)
#   tests   every `cuda` test (pytest -n 6); with `parity` in the same call the FLA layer-parity test runs in its
#           own process alongside all other steps (its Triton autotune results come back as fla-autotune-new.tgz)
#   parity  the FLA layer-parity test alone, timed (issue 9: < 120 s with the autotune cache carried in .gpu/)
#   decode  benchmarks/decode_paths.py (decode paths, state copies in the compiled HLO), plain and CUDA-graph
#   dgraph  the CUDA-graph (XLA command buffer) half of decode alone
#   bench   python -m benchmarks.bench (the benchmark of record; json/md/png and latest.json into $OUT)
#   train   examples/train_lm.py --backend tilelang (generation at batch 1 and 64) --train-backend tilelang, tracked by
#           a second run with the xla backward (same seed, data, steps): TRACK line, curves in $OUT/train_track.json
#   ncu     Nsight Compute counters of both chunk-prefill launches at B4 T4096 H32 (PROFILE_VARIANT=no_prefetch: a
#           profile_chunk.VARIANTS entry instead of the public op's kernels; also for ncusrc)
#   ncubwd  Nsight Compute counters of the three backward launches at B4 T4096 H32 ($OUT/ncu_bwd.txt; BWD_VARIANT=tma: etc., profile_chunk.BWD_LAUNCH_VARIANTS)
#   ptime   benchmarks/profile_chunk.py --time: each chunk launch of each kernel variant on the grid, FLA alongside
#           (PTIME_VARIANTS; first --accuracy over ACC_VARIANTS unless ACC_VARIANTS=none)
#   ttime   benchmarks/profile_chunk.py --train: the training step, xla VJP (dense / factored) vs backward kernels
#   tlaunch benchmarks/profile_chunk.py --train-launches: each training-forward and backward launch (TRAIN_SHAPES)
#   gacc    benchmarks/profile_chunk.py --grad-accuracy: the seven gradients vs fp64 per backward variant, FLA alongside
#           (GACC_VARIANTS, GACC_SEEDS)
#   ncusrc  per-SASS-instruction executed counts of the intra kernel at B4 T4096 H32 ($OUT/intra_sass.csv)
#   ncusrcb the same for one backward launch (NCU_BWD_LAUNCH: 7 dstate, 8 wy, 9 intra (default); $OUT/bwd_sass.csv)
#   smoke   a quick benchmark run (two shapes per section; SMOKE_SECTIONS, default prefill,decode) into /tmp/smoke
# Everything logs into $OUT/log.txt; the last lines of each step are echoed (the call returns the tail).
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source .gpu/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH GDN2_JAX_CACHE_DIR=$PWD/.kcache XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=$OUT/log.txt
# tests/test_gradient_audit_gpu.py appends its ratios (ours and FLA per gradient and seed) here
export GDN2_AUDIT_OUT=$OUT/gradaudit.txt
STEPS=",${1:-build,tests},"
step() { echo "=== [$(date +%T)] $*" | tee -a "$LOG"; }
quiet() { grep -v "TileLang:tilelang.*INFO\|^$"; }
has() { [[ "$STEPS" == *",$1,"* ]]; }
# the compiled-kernel cache travels packed (.kc/kcache.tgz, carry ".kc"): unpack it where GDN2_JAX_CACHE_DIR points
# (it comes back in parts of 15 MB, the run machine's limit per file being 16 MiB: kcache.tgz.part-aa, -ab, ...).
# .kc/kcache.txz (xz -9, made on the CPU machine: `tar -cf - -C CACHE . | xz -9 -T2 > .kc/kcache.txz`) packs the
# tests preset's 268 kernels and the benchmark's into 6 MB instead of 21, which fits beside .gpu/ in a call
if ls .kc/kcache.tgz.part-* >/dev/null 2>&1; then mkdir -p .kcache && cat .kc/kcache.tgz.part-* | tar -xz -C .kcache
elif [[ -f .kc/kcache.tgz ]]; then mkdir -p .kcache && tar -xzf .kc/kcache.tgz -C .kcache; fi
if [[ -f .kc/kcache.txz ]]; then mkdir -p .kcache && tar -xJf .kc/kcache.txz -C .kcache; fi
# the kernels of BUILD_PRESET (default all), then the benchmark's unless BUILD_BENCH=0: $1 parallel jobs, each command
# limited to $2 s; the exit status is the sum of the two commands'
build_kernels() {
  timeout "$2" python -m kernels.build --preset "${BUILD_PRESET:-all}" -j "$1"; local rc=$?
  if [[ "${BUILD_BENCH:-1}" == 1 ]]; then timeout "$2" python -m benchmarks.bench --precompile -j "$1"; rc=$((rc + $?)); fi
  return $rc
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv,noheader | tee -a "$LOG"

if has bgbuild; then
  step bgbuild
  rm -f /tmp/bgbuild.log
  export -f build_kernels
  setsid nohup bash -c "build_kernels ${BG_JOBS:-10} ${T_BUILD:-600}; echo BGBUILD_DONE rc=\$?" \
      > /tmp/bgbuild.log 2>&1 < /dev/null &
  echo "background build started (pid $!)" | tee -a "$LOG"
fi
if has bgwait; then
  step bgwait; t0=$(date +%s)
  if [[ ! -f /tmp/bgbuild.log ]]; then
    echo "bgwait: no background build on this machine (/tmp/bgbuild.log missing: a fresh machine?)" | tee -a "$LOG"
  else
    while ! grep -q BGBUILD_DONE /tmp/bgbuild.log && (( $(date +%s) - t0 < ${T_BGWAIT:-420} )); do sleep 5; done
    grep -q BGBUILD_DONE /tmp/bgbuild.log || echo "bgwait: still building after ${T_BGWAIT:-420} s" | tee -a "$LOG"
    grep "kernels for\|BGBUILD_DONE\|Error" /tmp/bgbuild.log | tee -a "$LOG"
  fi
  echo "waited $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
fi
if has build; then
  step build
  build_kernels 15 ${T_BUILD:-240} 2>&1 \
      | quiet | grep -v WARNING \
      | tee -a "$LOG" | grep "kernels for"
fi
if has parity && has tests && [[ -n "${PARITY_PARALLEL:-}" ]]; then  # alongside: correctness only
  ( timeout ${T_PARITY:-420} python -m pytest tests/test_flax_fla_parity.py -v -rs -p no:cacheprovider \
      > "$OUT/parity.part" 2>&1; echo "parity rc=$?" >> "$OUT/parity.part" ) &
  PARITY_PID=$!
fi
if has tests; then
  step tests
  timeout ${T_TESTS:-420} python -m pytest -m cuda -q -p no:cacheprovider -rs -n ${NPROC:-6} ${TEST_K:+-k "$TEST_K"} \
      --ignore=tests/test_flax_fla_parity.py 2>&1 | quiet | tee -a "$LOG" | tail -${TAIL_TESTS:-25}
fi
if has parity && [[ -z "${PARITY_PID:-}" ]]; then
  step parity; t0=$(date +%s)
  timeout ${T_PARITY:-200} python -m pytest tests/test_flax_fla_parity.py -v -rs -p no:cacheprovider 2>&1 \
      | quiet | tee -a "$LOG" | tail -12
  echo "parity wall: $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
fi
if has train; then
  step train
  timeout ${T_TRAIN:-240} python examples/train_lm.py --backend tilelang --show-hlo --steps 60 --eval-batches 2 \
      --gen-batch 1,64 --min-loss-drop 0 --checkpoint /tmp/ck.npz --train-backend tilelang --track-backend xla \
      --loss-log $OUT/train_track.json 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|^train ([a-z]*): *[0-9]\{1,2\}%" \
      | quiet | tee "$OUT/train.txt" | tee -a "$LOG" | tail -14
  rc=${PIPESTATUS[0]}  # the TRACK / FAIL lines may lie above the tail (generated text): shown again
  { grep "^TRACK \|^FAIL" "$OUT/train.txt"; echo "train exit status $rc"; } | tee -a "$LOG"
fi
if has decode; then
  step decode
  timeout ${T_DECODE:-150} python -m benchmarks.decode_paths --torch-first --trace "$OUT" 2>&1 | quiet \
      | tee -a "$LOG" | grep "DECODE\|TORCH\|==\|span"
fi
if has decode || has dgraph; then
  step decode-graph; mkdir -p "$OUT/g"
  GDN2_JAX_CUDA_GRAPH=1 XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL,DYNAMIC_SLICE_FUSION --xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_graph_min_graph_size=1 --xla_dump_to=$OUT/g/xla --xla_dump_hlo_module_re=.*scan.*" \
    timeout ${T_GRAPH:-120} python -m benchmarks.decode_paths --graph --B 1,16,128 --trace "$OUT/g" 2>&1 | quiet | tee -a "$LOG" \
    | grep "DECODE\|Error\|error\|==\|span" | tail -12
fi
if has smoke; then
  step smoke
  timeout ${T_SMOKE:-90} python -m benchmarks.bench --quick --sections ${SMOKE_SECTIONS:-prefill,decode} --time-budget 70 \
      --out /tmp/smoke 2>&1 | quiet | grep -v "^prefill {\|^decode {" | tee -a "$LOG" | tail -${TAIL_SMOKE:-30}
fi
if has bench; then
  step bench
  timeout ${T_BENCH:-420} python -m benchmarks.bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 | quiet | tee -a "$LOG" | tail -40
fi
if has ncu; then
  step ncu
  timeout ${T_NCU:-150} ncu --clock-control none --kernel-name main_kernel --launch-skip 4 --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      python -m benchmarks.profile_chunk --B 4 --T 4096 --H 32 2>&1 | quiet > "$OUT/ncu.txt"
  grep -E "main_kernel|Duration|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Theoretical Occ|Issued Ipc|No Eligible|Stall|DRAM Throughput|L1/TEX Hit|Dynamic Shared" "$OUT/ncu.txt" | head -40 | tee -a "$LOG"
fi
if has ncubwd; then
  step ncubwd
  timeout ${T_NCU:-150} ncu --clock-control none --kernel-name main_kernel --launch-skip 7 --launch-count 3 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      --section InstructionStats python -m benchmarks.profile_chunk --bwd-once --B 4 --T 4096 --H 32 2>&1 \
      | quiet > "$OUT/ncu_bwd.txt"
  grep -E "main_kernel|Duration|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Theoretical Occ|Issued Ipc|No Eligible|Stall|DRAM Throughput|L1/TEX Hit|Dynamic Shared|Executed Instructions" "$OUT/ncu_bwd.txt" | head -60 | tee -a "$LOG"
fi
if has ptime; then
  step ptime
  timeout ${T_BUILD:-240} python -m kernels.build --preset profile -j 15 2>&1 | quiet | grep "kernels for" | tee -a "$LOG"
  [[ "${ACC_VARIANTS:-}" != none ]] && timeout ${T_PTIME:-240} python -m benchmarks.profile_chunk --accuracy \
      --variants ${ACC_VARIANTS:-default,exact_diag,exact_self} 2>&1 | quiet | grep "ACCURACY\|Error" | tee -a "$LOG"
  timeout ${T_PTIME:-240} python -m benchmarks.profile_chunk --time --variants ${PTIME_VARIANTS:-default,exact_diag,bv64} 2>&1 \
      | quiet | grep "PROFILE\|Error" | tee -a "$LOG"
fi
if has ttime; then
  step ttime
  timeout ${T_TTIME:-300} python -m benchmarks.profile_chunk --train ${TRAIN_VARIANTS:+--variants $TRAIN_VARIANTS} \
      ${TRAIN_SHAPES:+--shapes "$TRAIN_SHAPES"} ${TRAIN_TRACE:+--trace} 2>&1 | quiet | grep "TRAIN\|Error" | tee -a "$LOG"
fi
if has tlaunch; then
  step tlaunch
  timeout ${T_TTIME:-300} python -m benchmarks.profile_chunk --train-launches ${TRAIN_SHAPES:+--shapes "$TRAIN_SHAPES"} \
      2>&1 | quiet | grep "TLAUNCH\|Error" | tee -a "$LOG"
fi
if has gacc; then
  step gacc
  timeout ${T_GACC:-240} python -m benchmarks.profile_chunk --grad-accuracy ${GACC_VARIANTS:+--variants $GACC_VARIANTS} \
      ${GACC_SEEDS:+--seeds $GACC_SEEDS} 2>&1 \
      | quiet | grep "GRADACC\|Error" | tee -a "$LOG"
fi
if has ncusrc; then
  step ncusrc
  timeout ${T_NCU:-150} ncu --clock-control none --kernel-name main_kernel --launch-skip 4 --launch-count 1 \
      --section SourceCounters --section InstructionStats --section WarpStateStats -f -o /tmp/intra_src \
      python -m benchmarks.profile_chunk --B 4 --T 4096 --H 32 2>&1 | quiet | tail -3 | tee -a "$LOG"
  ncu -i /tmp/intra_src.ncu-rep --page source --print-source sass --csv > "$OUT/intra_sass.csv" 2>&1
  ncu -i /tmp/intra_src.ncu-rep --page details > "$OUT/intra_details.txt" 2>&1
  wc -l "$OUT/intra_sass.csv" | tee -a "$LOG"; grep -E "Executed Instructions|Stall|Branch" "$OUT/intra_details.txt" | head -20 | tee -a "$LOG"
fi
if has ncusrcb; then  # the same for the backward launch NCU_BWD_LAUNCH (7 dstate, 8 wy, 9 intra; default 9)
  step ncusrcb
  timeout ${T_NCU:-150} ncu --clock-control none --kernel-name main_kernel --launch-skip ${NCU_BWD_LAUNCH:-9} \
      --launch-count 1 --section SourceCounters --section InstructionStats --section WarpStateStats -f -o /tmp/bwd_src \
      python -m benchmarks.profile_chunk --bwd-once --B 4 --T 4096 --H 32 2>&1 | quiet | tail -3 | tee -a "$LOG"
  ncu -i /tmp/bwd_src.ncu-rep --page source --print-source sass --csv > "$OUT/bwd_sass.csv" 2>&1
  ncu -i /tmp/bwd_src.ncu-rep --page details > "$OUT/bwd_details.txt" 2>&1
  wc -l "$OUT/bwd_sass.csv" | tee -a "$LOG"; grep -E "Executed Instructions|Stall|Branch" "$OUT/bwd_details.txt" | head -20 | tee -a "$LOG"
fi
if [[ -n "${PARITY_PID:-}" ]]; then  # (it ran alongside every step above: their timings are provisional)
  wait $PARITY_PID; step parity-in-parallel; quiet < "$OUT/parity.part" | tee -a "$LOG" | tail -12
  rm -f "$OUT/parity.part"
fi
# the run machine returns only a few files per call: pack the decode traces / XLA dumps into one
( cd "$OUT" && diag=$(ls -d g trace_*.json scan_hlo*.txt trace_summary.txt 2>/dev/null; true) \
    && [[ -n "$diag" ]] && tar -czf diag.tgz $diag && rm -rf $diag )
# what comes back for the next call: compiled kernels and FLA's new autotune results
# (KCACHE_PRESETS=bench,layers: only those presets' kernels, to keep the carried cache small)
keep=
if [[ "${KCACHE_BACK:-1}" == 1 && -n "${KCACHE_PRESETS:-}" ]]; then
  python - "$KCACHE_PRESETS" > /tmp/kcache-keep.txt <<'PY' && [[ -s /tmp/kcache-keep.txt ]] && keep=1
import sys
from benchmarks import bench_lib
from kernels import _compile, build
arch, root = _compile.device_arch(), _compile.cache_dir()
work = build.plan([c for p in sys.argv[1].split(",") for c in build.preset(p)], tuple(build.registry.OPS), arch)
work += [w for name, c in bench_lib.bench_kernel_configs(sweep=False) for w in build.plan([c], (name,), arch)]
paths = {_compile.library_path(build._pipe(name, kw, part).launches[i], a) for name, kw, part, i, a in work}
for path in sorted(p for p in paths if p.exists()):  # (the compiled ones: a preset may hold some not built here)
    print(path.relative_to(root))
PY
  [[ -n "$keep" ]] || echo "KCACHE_PRESETS: no list of kernels (see above); returning the whole cache" | tee -a "$LOG"
fi
if [[ -n "$keep" ]]; then tar -cz -C .kcache -T /tmp/kcache-keep.txt | split -b 15M - "$OUT/kcache.tgz.part-"
elif [[ "${KCACHE_BACK:-1}" == 1 ]]; then tar -cz -C .kcache . 2>/dev/null | split -b 15M - "$OUT/kcache.tgz.part-"; fi
( cd "$TRITON_CACHE_DIR" && ls */*.autotune.json >/dev/null 2>&1 && tar -czf "$OUT/fla-autotune-new.tgz" */*.autotune.json )
ls -la "$OUT" | tail -9
