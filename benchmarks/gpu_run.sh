#!/usr/bin/env bash
# Build, test and benchmark jax_marlin on a GPU machine, in stages.
#
#   benchmarks/gpu_run.sh [stage ...]      (default: build tests quick)
#
#   build     pip install this tree with CUDA (sm_90 only) against the machine's jax
#   tests     the pytest suite, GPU cases included ($TESTS: files, default tests/)
#   sanitize  compute-sanitizer ($SANITIZE_TOOL, default memcheck) over tests/sanitize_cases.py ($SANITIZE_CASES: its mode)
#   quick     bench_matmul.py --quick: 3 layers x m in {1, 16, 64}
#   sweep     the README's sweep: every layer x m in {1 .. 1024} x jax_marlin fp16/bf16 g128,
#             xla_fp16, xla_int4 -> gpu-out/sweep.json ($SWEEP_LAYERS: a subset; the records
#             of earlier runs into the same file are kept, so a sweep can be split over calls)
#   backward  bench_backward.py: dy @ W^T (jm.matmul's vjp) against the float16 vjp at
#             m in {16, 256, 4096} on the 70B/8B layers, and one QLoRA training step on a
#             float16 vs a 4-bit base -> gpu-out/backward.json
#   report    tables and plot from gpu-out/sweep.json, and the README's table (README.md)
#   ab        kernel_bench.cu (no JAX) on fp16 g128: this tree against the ffi/ of $AB_SRC
#             (another source tree, e.g. `git worktree add /tmp/base main`), built side by
#             side and run in turns ($AB_CASES: m:k:n cases, $AB_ROUNDS rounds)
#
# Logs and results go to gpu-out/ (ignored by git, so it survives between calls on one
# machine) and, at the end, are copied to $OUT when that is set.
set -uo pipefail
cd "$(dirname "$0")/.."
COPY_TO=${OUT:-}
OUT=$PWD/gpu-out
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=${*:-build tests quick}
has() { [[ " $stages " == *" $1 "* ]]; }
step() { echo; echo "=== $* ($(date +%T))"; }
status=0

if has build; then
  step build
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
  JAX_MARLIN_CUDA=ON SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90" \
    python3 -m pip install --no-build-isolation --no-deps -q -v . > "$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }
  grep -E "spill" "$OUT/build.log" | sort | uniq -c | sort -rn | head -5
  (cd /tmp && python3 -c "import jax, jax_marlin as jm; assert jm.HAS_CUDA; print('jax', jax.__version__, jax.devices())")
fi

if has tests; then
  step tests
  # From /tmp so that the installed package, not the source tree, is imported.
  (cd /tmp && python3 -m pytest -q -rs "$OLDPWD/${TESTS:-tests}" -p no:cacheprovider) \
    > "$OUT/tests.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
  tail -3 "$OUT/tests.log"
fi

if has sanitize; then
  step "compute-sanitizer --tool ${SANITIZE_TOOL:-memcheck}"
  # racecheck's default report mode segfaulted at start in a JAX process
  # (2026-12-07, compute-sanitizer 2025.3.1); the hazard mode ran.
  tool_args=(--tool "${SANITIZE_TOOL:-memcheck}")
  [ "${SANITIZE_TOOL:-memcheck}" = racecheck ] && tool_args+=(--racecheck-report hazard)
  # SANITIZE_CASES: sanitize_cases.py's mode (default all; random: the seeded
  # random combinations of tests/test_combinations.py).
  (cd /tmp && timeout 300 compute-sanitizer "${tool_args[@]}" \
    python3 "$OLDPWD/tests/sanitize_cases.py" ${SANITIZE_CASES:-}) > "$OUT/sanitize.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cases," "$OUT/sanitize.log"
fi

if has quick; then
  step "bench_matmul --quick"
  python3 benchmarks/bench_matmul.py --quick --out "$OUT/quick.json" 2>&1 | tail -40
fi

if has sweep; then
  step "sweep ${SWEEP_LAYERS:-all layers}"
  python3 benchmarks/bench_matmul.py ${SWEEP_LAYERS:+--layers $SWEEP_LAYERS} --append \
    --out "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1 || status=1
  tail -3 "$OUT/sweep.log"
fi

if has backward; then
  step "bench_backward"
  python3 benchmarks/bench_backward.py --out "$OUT/backward.json" 2>&1 | tee "$OUT/backward.log" \
    | tail -60
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if has report; then
  step report
  python3 benchmarks/report.py "$OUT/sweep.json" --readme README.md || status=1
  cp README.md "$OUT/README.md"
fi

if has ab; then
  step "kernel_bench: this tree against ${AB_SRC:?set AB_SRC to a source tree}"
  for name in base new; do
    src=$([ $name = base ] && echo "$AB_SRC" || echo "$PWD"); d=/tmp/kernel-ab/$name
    mkdir -p $d
    nvcc_() { nvcc -O3 -std=c++17 -arch=sm_90 -I"$src/ffi" "$@"; }
    # fp16 g128 only; the other instances are stubs (kernel_bench times fp16 g128).
    ( nvcc_ -DMARLIN_SCALAR=half -DMARLIN_GROUP_BLOCKS=8 -DMARLIN_ZEROS=0 -c "$src/ffi/marlin_instance.cu" -o $d/inst.o &
      nvcc_ -c benchmarks/kernel_bench_stubs.cu -o $d/stubs.o &
      nvcc_ -c "$src/ffi/marlin_kernel.cu" -o $d/launcher.o &
      nvcc_ -c benchmarks/kernel_bench.cu -o $d/bench.o &
      wait
      nvcc -arch=sm_90 $d/*.o -o $d/kernel_bench ) > "$OUT/ab-build-$name.log" 2>&1 &
  done
  wait
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for name in base new; do
      echo "--- $name, round $round"
      /tmp/kernel-ab/$name/kernel_bench --check ${AB_CASES:-1:8192:10240 64:8192:10240 128:8192:10240} \
        || status=1
    done
  done 2>&1 | tee "$OUT/ab.log"
fi
if [ -n "$COPY_TO" ] && [ "$COPY_TO" != "$OUT" ]; then
  mkdir -p "$COPY_TO" && cp -r "$OUT"/. "$COPY_TO"/
fi
exit $status
