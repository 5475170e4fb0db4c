#!/usr/bin/env bash
# One GPU session, end to end: build against the machine's own jax, run the
# GPU tests, check the kernel with compute-sanitizer, and benchmark.
#
#   benchmarks/gpu_session.sh [stage ...]     stages: build tests graphs sanitize
#                                             quick full evict   (default: build tests quick)
#
# Logs and results go to $OUT (the device tool's output folder) or ./gpu-out.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=${*:-build tests quick}
has() { [[ " $stages " == *" $1 "* ]]; }
step() { echo; echo "=== $* ($(date +%T))"; }

if has build; then
  step build
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
  # sm_90 only here: the shipped default also builds sm_80.
  JAX_MARLIN_CUDA=ON SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90" \
    python3 -m pip install --no-build-isolation --no-deps -q -v . > "$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }
  grep -E "jax_marlin:|registers|spill" "$OUT/build.log" | sort | uniq -c | sort -rn | head -20
  (cd /tmp && python3 -c "import jax_marlin as jm; assert jm.HAS_CUDA; print('jax_marlin CUDA module OK')")
fi

if has tests; then
  step tests
  # From /tmp so that the installed package, not the source tree, is imported.
  (cd /tmp && python3 -m pytest -q -rs -s "$OLDPWD/tests" -p no:cacheprovider 2>&1) > "$OUT/tests.log"
  grep -E "gpu rel err" "$OUT/tests.log" | sort -t: -k2 -g | tail -5
  tail -5 "$OUT/tests.log"
fi

if has graphs; then
  step "determinism with the custom call forced into CUDA graphs"
  (cd /tmp && XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE --xla_gpu_graph_min_graph_size=1 --xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" \
    python3 -m pytest -q "$OLDPWD/tests/test_gpu.py" -k bit_identical -p no:cacheprovider 2>&1 | tail -3)
  echo "command buffers holding jax_marlin_matmul in the optimized HLO:"
  grep -l "jax_marlin_matmul" /tmp/hlo/*after_optimizations.txt 2>/dev/null | xargs grep -c "command_buffer" 2>/dev/null | head
fi

if has sanitize; then
  step compute-sanitizer memcheck on the Marlin kernels
  timeout 300 compute-sanitizer --tool memcheck --kernel-name regex:Marlin --error-exitcode 9 \
    python3 benchmarks/sanitize_cases.py > "$OUT/sanitize.log" 2>&1
  echo "exit $?"; tail -5 "$OUT/sanitize.log"
fi

if has quick; then
  step benchmark --quick
  python3 benchmarks/bench_matmul.py --quick --out "$OUT/quick.json" 2>&1 | tee "$OUT/quick.log" | tail -40
fi

if has evict; then
  step "benchmark without the L2 evict-first hint (A/B)"
  JAX_MARLIN_CUDA=ON SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90;CMAKE_CUDA_FLAGS=-DJAX_MARLIN_B_EVICT_FIRST=0" \
    python3 -m pip install --no-build-isolation --no-deps -q --target /tmp/noevict -C build-dir=/tmp/build-noevict . \
    > "$OUT/build-noevict.log" 2>&1 || tail -20 "$OUT/build-noevict.log"
  PYTHONPATH=/tmp/noevict python3 benchmarks/bench_matmul.py --quick --out "$OUT/quick-noevict.json" 2>&1 \
    | tee "$OUT/quick-noevict.log" | grep jax_marlin
fi

if has full; then
  step benchmark full sweep
  python3 benchmarks/bench_matmul.py --out "$OUT/full.json" > "$OUT/full.log" 2>&1
  tail -3 "$OUT/full.log"
fi
