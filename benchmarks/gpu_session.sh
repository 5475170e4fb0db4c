#!/usr/bin/env bash
# One GPU session, end to end: build against the machine's own jax, run the
# GPU tests, check the kernel with compute-sanitizer, and benchmark.
#
#   benchmarks/gpu_session.sh [stage ...]   stages, run in this order: build tests graphs
#                                           quick formats reduction bench flax full variant
#                                           profile sanitize (default: build tests quick)
#
#   tests      the pytest suite ($TESTS: which files, default tests/); about 450 GPU cases
#   quick      bench_matmul.py --quick, every variant
#   formats    issue 6: bf16 and the fp16 group sizes against g128 and XLA's fp16/bf16
#              dots, 3 layers x m in {1, 16, 64} -> formats.json ($FORMATS_ARGS: more options)
#   reduction  issue 6: fp16 g128 over every layer and m (-> reduction.json; $REDUCTION_ARGS
#              narrows it, e.g. "--layers 70b.qkv 70b.down"), then its time against
#              results/h200-2026-12-02.json (the fp16 reduction) per (layer, m)
#   bench      bench_matmul.py $BENCH_ARGS
#   full       every layer, m and variant (more than one device call's 600 s: split it
#              with bench and --layers)
#   variant    a second build with $VARIANT_FLAGS (default -DJAX_MARLIN_L2_PREFETCH=0, the
#              copies without the explicit L2 prefetch; -DJAX_MARLIN_B_EVICT_FIRST=1 for the L2 hint),
#              compiled during `build`: the GPU tests ($VARIANT_TESTS, a -k filter) against it,
#              then fp16 g128 installed vs variant on $VARIANT_LAYERS at m in $VARIANT_MS
#              (bench_matmul.py $VARIANT_BENCH_ARGS, default --inner 4). With $SEED_SRC (a
#              source tree of an older commit, e.g. `git archive 2fc3eba`, the seed as ported)
#              that build joins the comparison, timed by this tree's bench_matmul.py;
#              $AB_BUILDS picks the builds (default: seed if built, installed, variant), the
#              first is the baseline of the comparisons. The SASS of the m = 1 and m = 64
#              fp16 g128 kernels of each build goes to sass.txt.
#   profile    Nsight Compute on the fp16 g128 kernel of each $PROFILE_CASES (layer:m, default
#              "70b.qkv:64 70b.qkv:1"), the installed build and, with $SEED_SRC, the seed
#              (its build starts in `build`), into ncu.txt: the second call's launch
#   sanitize   compute-sanitizer ($SANITIZE_TOOL, default memcheck; initcheck also finds
#              reads of the kernel's fp32 scratch before any block wrote them) over
#              benchmarks/sanitize_cases.py, limited to $SANITIZE_TIMEOUT seconds (240)
#
# Logs and results go to $OUT (the device tool's output folder) or ./gpu-out. The device
# tool returns at most 8 files: formats and reduction share one log, issue6.log.
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
  # The variant and the seed build in the background meanwhile.
  if has variant; then
    JAX_MARLIN_CUDA=ON SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90;CMAKE_CUDA_FLAGS=${VARIANT_FLAGS:--DJAX_MARLIN_L2_PREFETCH=0}" \
      python3 -m pip install --no-build-isolation --no-deps -q --target /tmp/variant -C build-dir=/tmp/build-variant . \
      > "$OUT/build-variant.log" 2>&1 &
    VARIANT_BUILD=$!
  fi
  if [ -n "${SEED_SRC:-}" ] && { has variant || has profile; }; then
    JAX_MARLIN_CUDA=ON SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90" \
      python3 -m pip install --no-build-isolation --no-deps -q --target /tmp/seed -C build-dir=/tmp/build-seed "$SEED_SRC" \
      > "$OUT/build-seed.log" 2>&1 &
    SEED_BUILD=$!
  fi
  (cd /tmp && python3 -c "import jax_marlin as jm; assert jm.HAS_CUDA; print('jax_marlin CUDA module OK')")
fi

if has tests; then
  step tests
  # From /tmp so that the installed package, not the source tree, is imported.
  (cd /tmp && python3 -m pytest -q -rs -s "$OLDPWD/${TESTS:-tests}" -p no:cacheprovider 2>&1) > "$OUT/tests.log"
  for dtype in float16 bfloat16; do  # largest errors against float64, per dtype
    grep -E "gpu rel err $dtype " "$OUT/tests.log" | sort -t: -k2 -g | tail -3
  done
  grep -E "gpu-vs-cpu diff" "$OUT/tests.log" | sort -t: -k2 -g | tail -2
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
  tail -3 "$OUT/tests.log"
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

if has formats; then
  step "issue 6 formats: bf16 g128 and fp16 g-1/g64/g32 against g128 and XLA's dots"
  python3 benchmarks/bench_matmul.py --quick --impls formats ${FORMATS_ARGS:-} --out "$OUT/formats.json" \
    >> "$OUT/issue6.log" 2>&1
  echo "exit $?, $(grep -c ' us ' "$OUT/issue6.log") rows logged"
  grep -E "jax_marlin_(bf16_g128|g32) " "$OUT/issue6.log" | tail -6
fi

if has reduction; then
  step "issue 6 fp32 reduction: fp16 g128 against results/h200-2026-12-02.json"
  python3 benchmarks/bench_matmul.py --impls jax_marlin_g128 ${REDUCTION_ARGS:-} \
    --out "$OUT/reduction.json" >> "$OUT/issue6.log" 2>&1
  echo "exit $?"
  python3 benchmarks/report.py --compare benchmarks/results/h200-2026-12-02.json \
    "$OUT/reduction.json" --impl jax_marlin_g128 >> "$OUT/issue6.log" 2>&1
  tail -7 "$OUT/issue6.log"
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

if has variant; then
  step "variant ${VARIANT_FLAGS:--DJAX_MARLIN_L2_PREFETCH=0}: GPU tests, then A/B against the installed build"
  wait "$VARIANT_BUILD" 2>/dev/null; tail -3 "$OUT/build-variant.log"
  (cd /tmp && PYTHONPATH=/tmp/variant python3 -m pytest -q -s "$OLDPWD/tests/test_gpu.py" \
    -k "${VARIANT_TESTS:-float64 or reduction or bit_identical or bias}" -p no:cacheprovider 2>&1) \
    > "$OUT/variant-tests.log"
  grep -E "^(FAILED|ERROR)|^E  " "$OUT/variant-tests.log" | head -10; tail -1 "$OUT/variant-tests.log"
  builds="installed variant"
  if [ -n "${SEED_SRC:-}" ]; then
    wait "$SEED_BUILD" 2>/dev/null; tail -2 "$OUT/build-seed.log"; builds="seed $builds"
  fi
  builds=${AB_BUILDS:-$builds}
  base=${builds%% *}
  for build in $builds; do
    pp=""; [ $build != installed ] && pp=/tmp/$build
    PYTHONPATH=$pp python3 benchmarks/bench_matmul.py --impls jax_marlin_g128 \
      --layers ${VARIANT_LAYERS:-70b.qkv 70b.down 8b.o} --ms ${VARIANT_MS:-1 16 64 128} \
      ${VARIANT_BENCH_ARGS:---inner 4} --out "$OUT/ab-$build.json" >> "$OUT/ab.log" 2>&1
    so=$(cd /tmp && PYTHONPATH=$pp python3 -c "import jax_marlin, glob, os; print(*glob.glob(os.path.dirname(jax_marlin.__file__) + '/_marlin_cuda*'))")
    # Kernels <threads, m blocks, n blocks, k blocks, stages, group blocks>: the m = 1 and
    # m = 64 tiles of fp16 g128 (the seed's names lack the scalar type).
    cuobjdump -sass "$so" | c++filt | awk -v b=$build '
      index($0, "Function : ") {
        p = index($0, "Marlin<__half, 256, 1, 8, 8, 4, 8>") || index($0, "Marlin<__half, 256, 4, 16, 4, 4, 8>") ||
            index($0, "Marlin<256, 1, 8, 8, 4, 8>") || index($0, "Marlin<256, 4, 16, 4, 4, 8>")
        if (p) print "##### " b ": " $0
        next
      }
      p' >> "$OUT/sass.txt"
  done
  for build in $builds; do
    [ $build = $base ] && continue
    echo "--- $build against $base"
    python3 benchmarks/report.py --compare "$OUT/ab-$base.json" "$OUT/ab-$build.json" \
      --impl jax_marlin_g128 | tee "$OUT/ab-$build-vs-$base.md" | tail -${AB_TAIL:-8}
  done
fi

if has profile; then
  step "Nsight Compute: ${PROFILE_CASES:=70b.qkv:64 70b.qkv:1}"
  builds=installed
  if [ -n "${SEED_SRC:-}" ]; then wait "$SEED_BUILD" 2>/dev/null; builds="seed installed"; fi
  for case in $PROFILE_CASES; do
    for build in $builds; do
      pp=""; [ $build != installed ] && pp=/tmp/$build
      echo "##### $build $case" >> "$OUT/ncu.txt"
      # The second of the two Marlin launches (the first belongs to the compile's warm-up call).
      PYTHONPATH=$pp ncu --clock-control none -k regex:Marlin --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats \
        python3 benchmarks/profile_case.py ${case%%:*} ${case##*:} >> "$OUT/ncu.txt" 2>&1
      grep -E "^##### |Duration|Registers Per|Warp Cycles Per Issued|DRAM Throughput" "$OUT/ncu.txt" | tail -4
    done
  done
fi

if has sanitize; then
  tool=${SANITIZE_TOOL:-memcheck}
  step "compute-sanitizer $tool on the Marlin kernels"
  # exit 9: the sanitizer found errors; 1: an output kept NaN (unwritten); 124: timeout.
  timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --tool "$tool" --kernel-name kns=Marlin \
    --error-exitcode 9 python3 benchmarks/sanitize_cases.py > "$OUT/sanitize.log" 2>&1
  echo "exit $?"; grep -c ": ok$" "$OUT/sanitize.log"; tail -3 "$OUT/sanitize.log"
fi
