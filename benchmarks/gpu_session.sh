#!/usr/bin/env bash
# One GPU session, end to end: build against the machine's own jax, run the
# GPU tests, check the kernel with compute-sanitizer, and benchmark.
#
#   benchmarks/gpu_session.sh [stage ...]   stages, run in this order: build tests graphs
#                                           quick bench flax full evict sanitize
#                                           (default: build tests quick; bench takes $BENCH_ARGS)
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
  if has evict; then  # the hinted variant builds in the background meanwhile
    JAX_MARLIN_CUDA=ON SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90;CMAKE_CUDA_FLAGS=-DJAX_MARLIN_B_EVICT_FIRST=1" \
      python3 -m pip install --no-build-isolation --no-deps -q --target /tmp/evict -C build-dir=/tmp/build-evict . \
      > "$OUT/build-evict.log" 2>&1 &
    EVICT_BUILD=$!
  fi
  (cd /tmp && python3 -c "import jax_marlin as jm; assert jm.HAS_CUDA; print('jax_marlin CUDA module OK')")
fi

if has tests; then
  step tests
  # From /tmp so that the installed package, not the source tree, is imported.
  (cd /tmp && python3 -m pytest -q -rs -s "$OLDPWD/${TESTS:-tests}" -p no:cacheprovider 2>&1) > "$OUT/tests.log"
  grep -E "gpu rel err" "$OUT/tests.log" | sort -t: -k2 -g | tail -5
  tail -5 "$OUT/tests.log"
fi

if has graphs; then
  step "determinism with the custom call forced into CUDA graphs"
  # XLA logs each command it records into a command buffer (CUDA graph).
  (cd /tmp && XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE --xla_gpu_graph_min_graph_size=1" \
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_cmd=2,command_buffer_thunk=2,command_buffer_conversion_pass=2,command_buffer_scheduling=2 \
    python3 -m pytest -q -s "$OLDPWD/tests/test_gpu.py" -k bit_identical -p no:cacheprovider > "$OUT/graphs.log" 2>&1)
  tail -2 "$OUT/graphs.log"
  echo "log lines naming the custom call in command-buffer code: $(grep -i 'command' "$OUT/graphs.log" | grep -ci 'jax_marlin\|custom')"
  grep -i 'command' "$OUT/graphs.log" | grep -i 'jax_marlin\|custom' | head -3
fi

if has quick; then
  step benchmark --quick
  python3 benchmarks/bench_matmul.py --quick --out "$OUT/quick.json" 2>&1 | tee "$OUT/quick.log" | tail -40
fi

if has bench; then
  step "benchmark: $BENCH_ARGS"
  python3 benchmarks/bench_matmul.py $BENCH_ARGS --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  tail -3 "$OUT/bench.log"
fi

if has flax; then
  step "examples/flax_transformer.py"
  python3 examples/flax_transformer.py 2>&1 | tee "$OUT/flax_example.log" | tail -15
fi

if has full; then
  step benchmark full sweep
  python3 benchmarks/bench_matmul.py --out "$OUT/full.json" > "$OUT/full.log" 2>&1
  tail -3 "$OUT/full.log"
fi

if has evict; then
  # Only at m > 16: with nvcc 13.0 the hinted build is miscompiled in some
  # small-batch tiles (ffi/marlin_kernel.cu, JAX_MARLIN_B_EVICT_FIRST).
  step "A/B: the L2 evict-first hint on weight loads"
  wait "$EVICT_BUILD" 2>/dev/null; tail -3 "$OUT/build-evict.log"
  for variant in installed evict; do
    pp=""; [ $variant = evict ] && pp=/tmp/evict
    PYTHONPATH=$pp python3 benchmarks/bench_matmul.py --impls jax_marlin --ms 32 64 128 \
      --layers 70b.qkv 70b.gate_up 70b.down --out "$OUT/ab-$variant.json" 2>&1 | tail -18
  done
fi

if has sanitize; then
  step compute-sanitizer memcheck on the Marlin kernels
  timeout ${SANITIZE_TIMEOUT:-120} compute-sanitizer --tool memcheck --kernel-name kns=Marlin --error-exitcode 9 \
    python3 benchmarks/sanitize_cases.py > "$OUT/sanitize.log" 2>&1
  echo "exit $?"; grep -c True "$OUT/sanitize.log"; tail -3 "$OUT/sanitize.log"
fi
