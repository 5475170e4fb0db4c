#!/usr/bin/env bash
# The decode kernel on a GPU machine, in one call: build decode_bench and the
# package, check the kernel, time it against the Marlin kernel (independent
# calls, dependent chains, CUDA graphs), time a Llama-3-8B block's projections
# with and without the elementwise kernels between them (block_bench), sweep
# its configurations, run the GPU tests, time the prefill kernel against
# cuBLAS and the Marlin kernel, time a Llama-3-8B decode step through JAX, and
# run compute-sanitizer.
#
#   benchmarks/decode_run.sh [stage ...]   build check sweep gsweep time block tests prefill pncu psrc dsrc l2 probe pab pprobe step sanitize zp full jzp lab ab abstep
#
# Stage ab (after build) times variants of the decode kernel against the
# tree's: VARIANTS="x.diff y.cu" names patches of ffi/decode_kernel.cu or
# whole replacements of it; each is built into block_bench and decode_bench
# (as "tree" is), checked against float64 on every configuration of a few
# shapes, and timed side by side (block_bench --layers at AB_MS, default
# "1 8 16"; decode_bench --chain on the 8B layers at m = 1 and 16). Stage
# abstep builds the package once per variant and times the JAX decode step
# (bench_decode_step.py $AB_STEP_ARGS, default --ms 1 8) with each, under each
# of $AB_SETTINGS (default: the environment as it is) and $AB_XLA_FLAGS. With
# AB_ZEROS=1 (AB_ACT_ORDER=1), stage ab also times every variant with zero
# points (act-order).
#
# With NVCC_CACHE=prebuilt/nvcc (carried to the machine), what
# benchmarks/prebuild.sh compiled beforehand on a machine without a GPU is
# taken instead of compiled, where sources and compiler match: the benchmarks'
# objects, and the package's wheel for this jax. COMPILE_ONLY=1 is that script's
# mode: the named stages compile into NVCC_CACHE and run nothing.
#
# Logs go to $OUT (or ./gpu-out). With LOGS_ARCHIVE=1 the files this run
# writes there end up in one file, $OUT/logs.tar.gz, at exit (also when the
# script is stopped by a signal, as `timeout` does), for runners that return
# only a few files of a folder; files that were there before stay as they are.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
archive_logs() {
  local part list
  part=$(mktemp /tmp/logs.XXXXXX.tar.gz) && list=$(mktemp) || return
  (cd "$OUT" && find . -maxdepth 1 -type f -newer "$STARTED" ! -name logs.tar.gz -print0 > "$list" &&
    tar czf "$part" --null -T "$list" && xargs -0 rm -f < "$list") && mv "$part" "$OUT/logs.tar.gz"
  rm -f "$list" "$STARTED"
}
if [ "${LOGS_ARCHIVE:-0}" = 1 ]; then
  STARTED=$(mktemp)  # the run's logs are the files newer than this
  trap archive_logs EXIT
  # Bash runs the EXIT trap on `exit`, not when a signal ends it.
  trap 'exit 143' TERM INT
fi
export PYTHONUNBUFFERED=1
stages=${*:-build check time block sweep step tests sanitize}
# With COMPILE_ONLY=1 (benchmarks/prebuild.sh, on a machine without a GPU), a
# stage only compiles what it would run, into NVCC_CACHE, and runs nothing.
has() {
  [[ " $stages " == *" $1 "* ]] || return 1
  [ "${COMPILE_ONLY:-0}" = 1 ] || return 0
  case $1 in
    build) return 0 ;;  # the stage itself skips what needs the GPU
    probe) build_probe ;;
    ab) ab_build ;;
    pab) pab_build ;;
    pprobe) pprobe_build ;;
    dsrc) dsrc_build ;;
  esac
  return 1
}
if [ "${COMPILE_ONLY:-0}" = 1 ] && [ -z "${NVCC_CACHE:-}" ]; then
  echo "COMPILE_ONLY=1 compiles into NVCC_CACHE: set it"; exit 2
fi
step() { echo; echo "=== $* ($(date +%T))"; }
BIN=/tmp/decode_bench
# NVCC_CACHE (see the top): the benchmarks' nvcc is benchmarks/nvcc_cache/nvcc;
# the package's CMake build keeps the real one (CUDACXX).
if [ -n "${NVCC_CACHE:-}" ]; then
  export CUDACXX=${CUDACXX:-$(command -v nvcc)}
  mkdir -p "$NVCC_CACHE"
  NVCC_CACHE=$(realpath "$NVCC_CACHE") && export NVCC_CACHE
  export NVCC_CACHE_LOG=${NVCC_CACHE_LOG:-$OUT/nvcc-cache.log}
  PATH=$PWD/benchmarks/nvcc_cache:$PATH
fi
# prefill_bench from the kernel sources in FFI_DIR into OUTPUT (sm_90a: wgmma),
# with any further nvcc arguments. Compiled (OUTPUT-bench.o, OUTPUT-kernel.o:
# what NVCC_CACHE can hold) and linked with cuBLAS in separate steps.
build_prefill_bench() {
  local ffi_dir=$1 output=$2
  shift 2
  local cc=(nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I"$ffi_dir" "$@")
  "${cc[@]}" -c benchmarks/prefill_bench.cu -o "$output-bench.o" &&
    "${cc[@]}" -c "$ffi_dir/prefill_sm90.cu" -o "$output-kernel.o" || return 1
  [ "${COMPILE_ONLY:-0}" = 1 ] ||
    nvcc -gencode=arch=compute_90a,code=sm_90a "$output-bench.o" "$output-kernel.o" -lcublas -o "$output"
}

# decode_bench's objects in /tmp/db, compiled in the background (the caller
# waits): the Marlin kernel's instances, its launcher, the prefill and decode
# kernels, the benchmark. The decode kernel's nvcc output goes to LOG, and
# further arguments to its nvcc: compile_decode_objects LOG [nvcc args].
F="-std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 -Iffi"
compile_decode_objects() {
  local log=$1
  shift
  mkdir -p /tmp/db
  for s in half nv_bfloat16; do for g in -1 2 4 8; do for z in 0 1; do
    nvcc $F -DMARLIN_SCALAR=$s -DMARLIN_GROUP_BLOCKS=$g -DMARLIN_ZEROS=$z -c ffi/marlin_instance.cu -o /tmp/db/i_${s}_${g}_$z.o &
  done; done; done
  nvcc $F "$@" -c ffi/decode_kernel.cu -o /tmp/db/decode.o > "$log" 2>&1 &
  nvcc $F -c ffi/marlin_kernel.cu -o /tmp/db/launcher.o &
  nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi -c ffi/prefill_sm90.cu -o /tmp/db/prefill.o &
  nvcc $F -c benchmarks/decode_bench.cu -o /tmp/db/bench.o &
}

# Files of "case value" lines, one per variant, as one table: each case and its
# values side by side.
side_by_side() {
  paste "$@" | awk '{printf "%-16s", $1; for (i = 2; i <= NF; i += 2) printf " %8s", $i; print ""}'
}

# A decode_bench log's rows as "m:k:n value" files: PREFIX.us (independent
# calls) and PREFIX.graph (a CUDA graph of dependent calls, with --chain):
# decode_columns LOG PREFIX.
decode_columns() {
  grep -E "^ +[0-9]" "$1" | awk '{print $1 ":" $2 ":" $3, $5}' > "$2.us"
  grep -E "^ +[0-9]" "$1" | awk '{print $1 ":" $2 ":" $3, $NF}' > "$2.graph"
}

# 70B and 8B layers (k:n) of the kernel-level stages (check, time, sweep, ...);
# DECODE_LAYERS replaces them, e.g. SmolLM2-135M's as stored (k padded to 640
# for g128): DECODE_LAYERS="640:960 640:576 640:3072 1536:576" ... sweep.
LAYERS=${DECODE_LAYERS:-"8192:10240 8192:8192 8192:57344 28672:8192 4096:6144 4096:4096 4096:28672 14336:4096"}
# The zero-point and act-order cost table's cases (m:k:n), through the launcher.
COST_CASES=$(for m in 1 16 64 256; do
  for l in 8192:10240 28672:8192 4096:6144 14336:4096 8192:57344 4096:28672; do echo -n "$m:$l "; done
done)

# The package's sources and the jax and nvcc it builds with, as one hash: a
# wheel prebuilt for the same stamp installs in place of a build.
package_stamp() {
  { python3 -c "import jax; print(jax.__version__)"; nvcc --version | tail -1
    find CMakeLists.txt pyproject.toml README.md LICENSE NOTICE ffi jax_marlin -type f \
      \( -name '*.py' -o -name '*.c[cu]' -o -name '*.cuh' -o -name '*.h' -o ! -path '*/*' \) -print0 |
      LC_ALL=C sort -z | xargs -0 sha256sum; } |
    sha256sum | cut -c1-32
}

# The package with CUDA (sm_90) against this machine's jax, log in LOG: from
# the prebuilt wheel when its stamp matches, else built here; with COMPILE_ONLY=1
# the wheel is built into the cache instead of installed.
build_package() {
  local log=$1 wheels="" stamp=""
  if [ -n "${NVCC_CACHE:-}" ]; then wheels=$(dirname "$NVCC_CACHE")/wheel stamp=$(package_stamp); fi
  if [ "${COMPILE_ONLY:-0}" = 1 ] && [ "$(cat "$wheels/STAMP" 2>/dev/null)" = "$stamp" ] &&
    ls "$wheels"/jax_marlin-*.whl > /dev/null 2>&1; then
    echo "package: the prebuilt wheel is current (stamp $stamp)" > "$log"
  elif [ "${COMPILE_ONLY:-0}" = 1 ]; then  # (NVCC_CACHE is set: checked at the top)
    rm -rf "$wheels" && mkdir -p "$wheels" &&
      JAX_MARLIN_CUDA=ON SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90" \
        python3 -m pip wheel --no-build-isolation --no-deps -q -v -w "$wheels" . > "$log" 2>&1 &&
      echo "$stamp" > "$wheels/STAMP"
  elif [ -n "$wheels" ] && [ "$(cat "$wheels/STAMP" 2>/dev/null)" = "$stamp" ]; then
    echo "package: the prebuilt wheel (stamp $stamp)" > "$log"
    python3 -m pip install --no-deps --no-index --force-reinstall -q "$wheels"/jax_marlin-*.whl >> "$log" 2>&1
  else
    JAX_MARLIN_CUDA=ON SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90" \
      python3 -m pip install --no-build-isolation --no-deps -q -v . > "$log" 2>&1
  fi
}

# Waits for the background jobs other than PID (the package's build, which may
# run on meanwhile).
wait_except() { while [ "$(jobs -rp | grep -v "^$1$" | wc -l)" -gt 0 ]; do wait -n; done; }

# decode_bench, block_bench and prefill_bench of the tree (objects in /tmp/db),
# beside the background job PID (or "none"), which they do not wait for.
build_benchmarks() {
  compile_decode_objects "$OUT/ptxas.txt" -Xptxas -v
  build_prefill_bench ffi /tmp/prefill_bench > "$OUT/prefill-build.log" 2>&1 &
  nvcc $F -c benchmarks/block_bench.cu -o /tmp/block_bench.o &
  wait_except "$1"
  [ "${COMPILE_ONLY:-0}" = 1 ] && return 0
  nvcc -arch=sm_90 /tmp/db/*.o -o $BIN || return 1
  nvcc -arch=sm_90 $(ls /tmp/db/*.o | grep -v bench.o) /tmp/block_bench.o -o /tmp/block_bench
}

# How many compiles NVCC_CACHE served so far, and how many ran here.
cache_summary() {
  [ -n "${NVCC_CACHE:-}" ] && [ "${COMPILE_ONLY:-0}" != 1 ] &&
    echo "nvcc cache: $(grep -c '^hit' "$NVCC_CACHE_LOG") compiles taken, $(grep -c '^miss' "$NVCC_CACHE_LOG") run here," \
      "$(grep -c '^pass' "$NVCC_CACHE_LOG") passed through (links) ($(nvcc --version | tail -1))"
  return 0
}

build_probe() { nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/stream_probe.cu -o /tmp/stream_probe; }

# The variants of stages ab and abstep: /tmp/ab/<name>.cu, names in $names.
ab_sources() {
  names="tree"
  mkdir -p /tmp/ab && cp ffi/decode_kernel.cu /tmp/ab/tree.cu
  for v in ${VARIANTS:-}; do
    name=$(basename "${v%.*}")
    case "$v" in
      *.cu) cp "$v" "/tmp/ab/$name.cu" ;;
      *) cp ffi/decode_kernel.cu "/tmp/ab/$name.cu" && patch -s "/tmp/ab/$name.cu" "$v" || { echo "$v does not apply"; continue; } ;;
    esac
    names="$names $name"
  done
}

# The variants' objects (/tmp/ab/<name>.o, ptxas reports in $OUT/ab-ptxas-<name>.txt)
# and their decode_bench and block_bench, linked with the build stage's objects.
ab_build() {
  ab_sources
  # (-Iffi: a variant outside ffi/ includes the kernel's headers from there.)
  for n in $names; do nvcc $F -Xptxas -v -c "/tmp/ab/$n.cu" -o "/tmp/ab/$n.o" > "$OUT/ab-ptxas-$n.txt" 2>&1 & done
  wait
  [ "${COMPILE_ONLY:-0}" = 1 ] && return 0
  local others
  others=$(ls /tmp/db/*.o | grep -v -e /decode.o -e /bench.o)
  for n in $names; do
    echo "$n: $(grep -c 'bytes spill stores' "$OUT/ab-ptxas-$n.txt") instances, $(grep -cE ' [1-9][0-9]* bytes spill stores' "$OUT/ab-ptxas-$n.txt") spilling"
    nvcc -arch=sm_90 $others "/tmp/ab/$n.o" /tmp/db/bench.o -o "/tmp/ab/decode_bench_$n" &&
      nvcc -arch=sm_90 $others "/tmp/ab/$n.o" /tmp/block_bench.o -o "/tmp/ab/block_bench_$n" || return 1
  done
}

# Stage pab's prefill_bench per variant, /tmp/pab/<name>/prefill_bench; names in $pnames.
pab_build() {
  pnames="tree"
  for v in ${PVARIANTS:-}; do pnames="$pnames $(basename "${v%.*}")"; done
  set -- ${PVARIANTS:-}
  for n in $pnames; do
    d=/tmp/pab/$n && rm -rf "$d" && mkdir -p "$d" && cp -r ffi "$d/"
    if [ "$n" != tree ]; then patch -s -d "$d" -p1 < "$1" || { echo "$1 does not apply"; return 1; }; shift; fi
    build_prefill_bench "$d/ffi" "$d/prefill_bench" -Xptxas -v > "$OUT/pab-build-$n.log" 2>&1 &
  done
  wait
}

# Stage pprobe's prefill_bench per part left out, /tmp/pprobe/<k>/prefill_bench
# (experiments/prefill-probe.diff at PREFILL_PROBE = k = 1..6).
pprobe_build() {
  for k in 1 2 3 4 5 6; do
    d=/tmp/pprobe/$k && rm -rf "$d" && mkdir -p "$d" && cp -r ffi "$d/" &&
      patch -s -d "$d" -p1 < benchmarks/experiments/prefill-probe.diff || { echo "prefill-probe.diff does not apply"; return 1; }
    build_prefill_bench "$d/ffi" "$d/prefill_bench" -DPREFILL_PROBE=$k > "$OUT/pprobe-build-$k.log" 2>&1 &
  done
  wait
}

# One prefill_bench case of stages pab and pprobe, fp16 g128, median of 5
# trials: CASE is "KxN:m" (the launcher's configuration) or
# "KxN:m:tile:splits" (forced). Prints "configuration us", with "x" after it
# where the check against float64 failed; appends the output to LOG.
prefill_case_us() {
  local bin=$1 c=$2 log=$3 shape m tile splits
  IFS=: read -r shape m tile splits <<< "$c"
  local args=(--no-self-test --shapes "$shape" --m "$m" --dtype fp16 --group 128 --trials 5)
  [ -n "$tile" ] && args+=(--tile "$tile" --splits "${splits:-1}")
  # "fp16  128   8192x8192     64 64x256/4     28.73 ..." (prefill_bench's table row)
  timeout 60 "$bin" "${args[@]}" 2>&1 | tee -a "$log" |
    awk '/^(fp16|bf16) / && !seen {print $5, $6 (/CHECK FAILED/ ? "x" : ""); seen = 1}'
}

# bench_matmul.py ARGS within TIMEOUT seconds into $OUT/NAME.json (rewritten
# after every m) and NAME.log, then the targets' scorecard of what it measured:
# stages full and jzp.
scored_matmul() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 benchmarks/bench_matmul.py "$@" --out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  echo "bench_matmul: exit $?, $(grep -c ' us ' "$OUT/$name.log") rows"
  [ -f "$OUT/$name.json" ] && python3 benchmarks/targets.py "$OUT/$name.json"
}

# decode_bench with the decode kernel compiled with -lineinfo, for stage dsrc.
dsrc_build() {
  compile_decode_objects "$OUT/dsrc-build.log" -lineinfo
  wait
  [ "${COMPILE_ONLY:-0}" = 1 ] || nvcc -arch=sm_90 /tmp/db/*.o -o /tmp/decode_bench_lineinfo
}

if has build; then
  step build
  [ "${COMPILE_ONLY:-0}" = 1 ] ||
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
  # BUILD_PACKAGE=0: the benchmarks' objects only (no package; the stages
  # that run JAX then need one from an earlier build on the machine).
  PIP=none
  if [ "${BUILD_PACKAGE:-1}" != 0 ]; then
    build_package "$OUT/build.log" &
    PIP=$!
  fi
  build_benchmarks $PIP || exit 1
  wait
  grep -E "registers|spill" "$OUT/ptxas.txt" | sort | uniq -c
  cache_summary
  # (wait_except may already have reaped pip: its log and the import, or the
  # wheel's stamp, tell.)
  if [ "$PIP" != none ] && [ "${COMPILE_ONLY:-0}" = 1 ]; then
    ls "$(dirname "$NVCC_CACHE")"/wheel/STAMP > /dev/null || { tail -30 "$OUT/build.log"; exit 1; }
  elif [ "$PIP" != none ]; then
    (cd /tmp && python3 -c "import jax_marlin as jm; assert jm.HAS_CUDA; print('jax_marlin CUDA module OK')") ||
      { tail -30 "$OUT/build.log"; exit 1; }
    grep -m1 '^package: the prebuilt wheel' "$OUT/build.log"
  fi
fi

if has check; then
  step "check: decode kernel against float64 (six 64-column chunks), bias, repeats"
  {
    for g in 128 -1 32 64; do
      $BIN --check --group $g --reps 4 1:4096:4096 3:8192:1024 8:1024:2048 9:4096:4096 16:4096:6144
      $BIN --check --group $g --bf16 --reps 4 1:4096:4096 9:2048:1024 16:4096:6144
    done
    $BIN --check --group -1 --reps 4 1:640:192 5:576:256 16:640:192 2:640:1536
    $BIN --check --group 64 --reps 4 1:576:256 13:640:192
    $BIN --check --group 128 --reps 4 1:28672:8192 16:28672:8192 16:14336:4096 1:8192:57344
    # The Llama-3 output head, a row of the measured table.
    $BIN --check --group 128 --reps 4 1:4096:128256 5:4096:128256 16:4096:128256
    # Every configuration of a few shapes.
    $BIN --check --sweep --group 128 --reps 4 16:4096:4096 1:2048:3072
    $BIN --check --sweep --group -1 --reps 4 7:4096:1024
    $BIN --check --sweep --group 32 --bf16 --reps 4 12:1024:512
  } > "$OUT/check.log" 2>&1
  echo "checks: $(grep -c '  check' "$OUT/check.log") run, $(grep -c FAILED "$OUT/check.log") failed"
  grep -E "FAILED|error|Error" "$OUT/check.log" | head -20
  grep "  check" "$OUT/check.log" | awk '{for(i=1;i<=NF;i++) if($i=="err") print $(i+1)}' | sort -g | tail -1 | sed 's/^/worst rel err: /'
fi

if has time; then
  cases=""
  step "time: launcher (decode kernel) against JAX_MARLIN_DECODE=0 (Marlin), fp16 g128"
  for m in 1 4 8 16; do cases="$cases $(for l in $LAYERS; do echo -n "$m:$l "; done)"; done
  $BIN --chain $cases > "$OUT/time-decode.log" 2>&1
  JAX_MARLIN_DECODE=0 $BIN --chain $cases > "$OUT/time-marlin.log" 2>&1
  paste <(grep -E "^ +[0-9]" "$OUT/time-decode.log") <(grep -E "^ +[0-9]" "$OUT/time-marlin.log" | awk '{print $5, $7, $8}') > "$OUT/time.txt"
  echo "   m      k      n   config   us  TB/s  chain  graph | marlin: us chain graph"
  cat "$OUT/time.txt"
fi

if has block; then
  step "block: an 8B block's projections with and without the elementwise kernels between them"
  # --layers: each projection alone too, plain and in each fused form.
  /tmp/block_bench --layers 1 4 8 16 32 64 | tee "$OUT/block.txt"
fi

if has sweep; then
  # SWEEP_ARGS: more decode_bench arguments, e.g. "--any-warps --check" (every
  # warp count the kernel allows, each checked against float64).
  step "sweep: every decode configuration, fp16 g128, m = 1, 4, 8 and 16 ${SWEEP_ARGS:-}"
  $BIN --sweep --reps 100 ${SWEEP_ARGS:-} $(for l in $LAYERS; do echo -n "1:$l 4:$l 8:$l 16:$l "; done) > "$OUT/sweep.log" 2>&1
  echo "decode_bench: exit $?, $(grep -c '^  check ' "$OUT/sweep.log") checks"
  grep -E "^ +[0-9]|sweep|FAILED" "$OUT/sweep.log"
fi

if has step; then
  step "Llama-3-8B decode step through JAX"
  python3 benchmarks/bench_decode_step.py --out "$OUT/step.json" 2>&1 | tee "$OUT/step.log" | tail -5
  python3 benchmarks/targets.py "$OUT/step.json" | grep -E "^\| "
  JAX_MARLIN_DECODE=0 python3 benchmarks/bench_decode_step.py --ms 1 16 2>&1 | tail -2 | sed 's/^/marlin only: /'
fi

if has tests; then
  # Every GPU test, in 8 processes (tests/conftest.py turns JAX's preallocation off under
  # xdist): about 300 s on an H100 (2026-12-06).
  step "GPU tests (decode, prefill and Marlin kernels through JAX, fusions, layers, models)"
  (cd /tmp && timeout ${TESTS_TIMEOUT:-360} python3 -m pytest -q -n 8 -m gpu "$OLDPWD/tests" -p no:cacheprovider 2>&1) > "$OUT/tests.log"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10
  tail -1 "$OUT/tests.log"
  # The Marlin kernel's own tiles at every m, with the Hopper kernels off.
  (cd /tmp && JAX_MARLIN_DECODE=0 JAX_MARLIN_PREFILL=0 timeout 120 python3 -m pytest -q -n 8 -m gpu -k "float64 and not decode" "$OLDPWD/tests/test_primitive.py" -p no:cacheprovider 2>&1) >> "$OUT/tests.log"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | tail -5
  tail -1 "$OUT/tests.log" | sed 's/^/marlin only: /'
fi

if has prefill; then
  step "prefill kernel against cuBLAS fp16 (prefill_bench, fp16 g128)"
  timeout ${PREFILL_TIMEOUT:-100} /tmp/prefill_bench --no-self-test --m 64,128,256,1024,4096 --dtype fp16 --group 128 > "$OUT/prefill.log" 2>&1
  echo "exit $?"; sed -n '/^SUMMARY/,$p' "$OUT/prefill.log" | tail -8
  step "launcher at m >= 64: prefill kernel against JAX_MARLIN_PREFILL=0 (Marlin)"
  pc=$(for m in 64 128 256 1024; do for l in 8192:10240 28672:8192 4096:6144 4096:28672; do echo -n "$m:$l "; done; done)
  $BIN --reps 50 $pc > "$OUT/time-prefill.log" 2>&1
  JAX_MARLIN_PREFILL=0 $BIN --reps 50 $pc > "$OUT/time-prefill-marlin.log" 2>&1
  paste <(grep -E "^ +[0-9]" "$OUT/time-prefill.log" | awk '{print $1, $2, $3, $5}') <(grep -E "^ +[0-9]" "$OUT/time-prefill-marlin.log" | awk '{print $5}')
fi

if has pncu; then
  # One prefill launch's throughputs, occupancy and stall summary (the best
  # 8192 x 8192 launch at m = 64 by default); psrc below goes per instruction.
  step "Nsight Compute on the prefill kernel (${PNCU_SHAPE:=8192x8192}, m = ${PNCU_M:=64}, fp16 g128)"
  [ -x /tmp/prefill_bench ] || build_prefill_bench ffi /tmp/prefill_bench > "$OUT/prefill-build.log" 2>&1
  timeout 150 ncu --clock-control none --kernel-name regex:prefill_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    /tmp/prefill_bench --no-self-test --shapes "$PNCU_SHAPE" --m "$PNCU_M" --dtype fp16 --group 128 \
    --trials 1 > "$OUT/prefill-ncu.txt" 2>&1
  echo "exit $?"
  grep -E "Duration|Throughput|Pipe|Eligible|Issued Warp|Active Warps|Stall|Grid Size|Registers" \
    "$OUT/prefill-ncu.txt" | head -40
fi

if has psrc; then
  # Where the prefill kernel's warps stall, per SASS instruction (Nsight Compute's
  # full set and its source page), on PSRC_CASES ("shape:m ...", fp16 g128, the
  # table's configuration), with shared-memory wavefronts and bank conflicts.
  step "Nsight Compute source view of the prefill kernel (${PSRC_CASES:=8192x8192:64 4096x4096:64 8192x8192:128})"
  [ -x /tmp/prefill_bench ] || build_prefill_bench ffi /tmp/prefill_bench -lineinfo > "$OUT/prefill-build.log" 2>&1
  for c in $PSRC_CASES; do
    r=/tmp/psrc-${c/:/-m}
    timeout 120 ncu --clock-control none --set full --import-source no --kernel-name regex:prefill_kernel \
      --launch-skip 3 --launch-count 1 -f -o "$r" /tmp/prefill_bench --no-self-test --shapes "${c%%:*}" \
      --m "${c##*:}" --dtype fp16 --group 128 --trials 1 > /dev/null 2>&1
    echo "--- $c: exit $?"
    ncu -i "$r.ncu-rep" --print-details all --section WarpStateStats --section SpeedOfLight \
      --section MemoryWorkloadAnalysis_Tables 2>&1 | grep -E "prefill_kernel|Duration|Stall|stall|Shared|shared|Bank|bank|Throughput" | head -60
    ncu -i "$r.ncu-rep" --page source --csv --print-source sass > "$r.csv" 2>&1 ||
      { head -5 "$r.csv"; ncu --help | grep -A4 -E "page|print-source"; }
    python3 benchmarks/ncu_source_top.py "$r.csv" 30 2>&1 | head -45
  done
  cat /tmp/psrc-*.csv | gzip > "$OUT/psrc-csv.gz"
fi

if has probe; then
  # stream_probe.cu: the decode kernel's weight walk with no arithmetic, and an
  # 8B decode step's weight stream as a kernel per projection against one
  # persistent kernel with grid barriers (no build stage needed).
  step "stream_probe (weight streams without arithmetic)"
  build_probe && timeout 120 /tmp/stream_probe 2>&1 | tee "$OUT/probe.txt"
fi

if has dsrc; then
  # Where the decode kernel's warps stall, per SASS instruction, on DSRC_CASES
  # ("m:k:n" or "m:k:n:flag", flag a decode_bench option without its dashes:
  # zeros, act-order), fp16 g128, the table's configuration; built here, the
  # decode kernel with -lineinfo.
  step "Nsight Compute source view of the decode kernel (${DSRC_CASES:=16:4096:28672 16:4096:28672:zeros})"
  dsrc_build || { cat "$OUT/dsrc-build.log"; exit 1; }
  for c in $DSRC_CASES; do
    IFS=: read -r m k n flag <<< "$c"
    r=/tmp/dsrc-$m-$k-$n-${flag:-sym}
    timeout 120 ncu --clock-control none --set full --import-source no --kernel-name regex:decode_kernel \
      --launch-skip 3 --launch-count 1 -f -o "$r" /tmp/decode_bench_lineinfo --reps 2 ${flag:+--$flag} \
      "$m:$k:$n" > /dev/null 2>&1
    echo "--- $c: exit $?"
    ncu -i "$r.ncu-rep" --print-details all --section SpeedOfLight --section LaunchStats \
      --section Occupancy --section SchedulerStats 2>&1 |
      grep -E "Duration|Registers Per|Achieved Occupancy|Memory Throughput|Issued Warp|Eligible Warps|No Eligible" | head -12
    ncu -i "$r.ncu-rep" --page source --csv --print-source sass > "$r.csv" 2>&1
    python3 benchmarks/ncu_source_top.py "$r.csv" 20 2>&1 | head -32
  done
fi

if has l2; then
  # What L2 delivers to the SMs through bulk copies, for the question of
  # whether the prefill kernel's 64-row tiles are bound by L2 (l2_probe.cu).
  step "l2: bulk copies from L2 and from HBM, one block per SM (l2_probe)"
  nvcc -O3 -std=c++17 -arch=sm_90 -Iffi benchmarks/l2_probe.cu -o /tmp/l2_probe && timeout 60 /tmp/l2_probe
fi

if has pab; then
  # Prefill-kernel variants: PVARIANTS="x.diff ..." patches of ffi/prefill_sm90.cuh,
  # each built into its own prefill_bench beside the tree's; first timed side
  # by side at fixed configurations (PAB_CASES, "KxN:m" at the launcher's
  # choice or "KxN:m:tile:splits"; default the 8 layers at m = 64 and 128, and
  # a stream-K launch), then self-tested (every tile, split and stream-K form
  # against float64, symmetric and with zero points), with PAB_SANITIZE=1 run
  # under compute-sanitizer memcheck on a split and a stream-K launch, and
  # swept at PAB_M (every tile and split per layer, fp16 g128; PAB_M=none: no
  # sweep), the best time per layer side by side. PAB_SWEEP_ARGS: more
  # prefill_bench arguments for the sweep (--zeros: weights with zero points).
  step "pab: prefill-kernel variants (${PVARIANTS:-none}) against the tree's"
  pab_build || exit 1
  for n in $pnames; do
    echo "$n: $(grep -cE ' [1-9][0-9]* bytes spill stores' "$OUT/pab-build-$n.log") spilling instances," \
      "$(grep -c C7515 "$OUT/pab-build-$n.log") with serialized wgmmas (C7515)"
  done
  echo "us a launch (fp16 g128, median of 5 trials; x: a failed check), in the order: $pnames"
  layers="8192x10240 8192x8192 8192x57344 28672x8192 4096x6144 4096x4096 4096x28672 14336x4096"
  for c in ${PAB_CASES:-$(for m in 64 128; do for l in $layers; do echo "$l:$m"; done; done) 8192x10240:512}; do
    row="$c"
    for n in $pnames; do
      us=$(prefill_case_us "/tmp/pab/$n/prefill_bench" "$c" "$OUT/pab-cases-$n.log")
      row="$row | ${us:-failed}"
    done
    echo "$row"
  done | tee "$OUT/pab-cases.txt"
  for n in $pnames; do
    timeout 150 "/tmp/pab/$n/prefill_bench" --self-test --quick > "$OUT/pab-selftest-$n.log" 2>&1
    echo "$n self-test: exit $?, $(grep -E '^RESULT' "$OUT/pab-selftest-$n.log")"
    timeout 150 "/tmp/pab/$n/prefill_bench" --self-test --quick --zeros > "$OUT/pab-selftest-zeros-$n.log" 2>&1
    echo "$n self-test with zero points: exit $?, $(grep -E '^RESULT' "$OUT/pab-selftest-zeros-$n.log")"
    if [ "${PAB_SANITIZE:-0}" = 1 ]; then
      for c in 4096x4096:64:64x128:4 8192x10240:512:128x256:1:sk; do
        IFS=: read -r shape m tile splits sk <<< "$c"
        a=(--no-self-test --shapes "$shape" --m "$m" --dtype fp16 --group 128 --tile "$tile" --splits "$splits" --trials 1)
        [ -n "$sk" ] && a+=(--stream-k)
        timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 "/tmp/pab/$n/prefill_bench" "${a[@]}" \
          >> "$OUT/pab-memcheck-$n.log" 2>&1
        echo "$n memcheck $c: exit $? $(grep -E 'ERROR SUMMARY' "$OUT/pab-memcheck-$n.log" | tail -1)"
      done
    fi
    [ "${PAB_M:-}" = none ] ||
      timeout ${PAB_TIMEOUT:-200} "/tmp/pab/$n/prefill_bench" --no-self-test --sweep --m "${PAB_M:-64,128}" \
        --dtype fp16 --group 128 ${PAB_SWEEP_ARGS:-} > "$OUT/pab-sweep-$n.log" 2>&1
  done
  if [ "${PAB_M:-}" != none ]; then
    # "  sweep fp16  128   8192x8192   m 64 best 64x256/4      28.73 us (chosen ...)"
    for n in $pnames; do grep ' best ' "$OUT/pab-sweep-$n.log" | awk -v n=$n '{print $4, "m", $6, n, $8, $9}' > "/tmp/pab/$n.best"; done
    echo "best configuration and us per layer and m (fp16 g128), in the order: $pnames"
    paste -d'|' $(for n in $pnames; do echo "/tmp/pab/$n.best"; done)
  fi
fi

if has pprobe; then
  # Where a prefill launch's time goes, by leaving parts out (experiments/prefill-probe.diff):
  # the kernel, then launch and setup only, the copies only (no dequantization or wgmma),
  # the arithmetic only (no copies), no split reduction, the wgmmas only and the
  # dequantization only (both without copies); fp16 g128, PPROBE_CASES "KxN:m" (the
  # launcher's configuration) or "KxN:m:tile:splits" (forced). After build.
  step "pprobe: a prefill launch with parts left out, fp16 g128"
  pprobe_build || exit 1
  [ -x /tmp/prefill_bench ] || { echo "pprobe needs the build stage's /tmp/prefill_bench"; exit 1; }
  # A probe whose main loop ptxas serialized (C7515) would time a slower loop than the tree's.
  for k in 1 2 3 4 5 6; do
    [ "$(grep -c C7515 "$OUT/pprobe-build-$k.log")" = 0 ] || echo "warning: probe $k has serialized wgmmas (C7515)"
  done
  # (x marks the probes' failed checks: they compute wrong results by design.)
  echo "case | configuration and us: kernel | launch only | copies only | arithmetic only | no split reduction | wgmma only | dequantization only"
  for c in ${PPROBE_CASES:-8192x8192:64:64x256:1 8192x8192:64:64x256:2 8192x8192:64:64x256:4 4096x4096:64 4096x6144:64 14336x4096:64}; do
    row="$c"
    for b in /tmp/prefill_bench /tmp/pprobe/{1,2,3,4,5,6}/prefill_bench; do
      us=$(prefill_case_us "$b" "$c" "$OUT/pprobe.log")
      row="$row | ${us:-failed}"
    done
    echo "$row"
  done | tee "$OUT/pprobe.txt"
fi

if has zp; then
  step "zero points and act-order: the launcher against symmetric weights (fp16 g128)"
  $BIN --reps 100 $COST_CASES > "$OUT/time-sym.log" 2>&1
  $BIN --reps 100 --zeros $COST_CASES > "$OUT/time-zp.log" 2>&1
  $BIN --reps 100 --act-order $COST_CASES > "$OUT/time-ao.log" 2>&1
  $BIN --reps 100 --zeros --act-order $COST_CASES > "$OUT/time-zp-ao.log" 2>&1
  echo "    m      k      n  symmetric_us  zero_points_us  act_order_us  both_us"
  paste <(grep -E "^ +[0-9]" "$OUT/time-sym.log" | awk '{print $1, $2, $3, $5}') \
        <(grep -E "^ +[0-9]" "$OUT/time-zp.log" | awk '{print $5}') \
        <(grep -E "^ +[0-9]" "$OUT/time-ao.log" | awk '{print $5}') \
        <(grep -E "^ +[0-9]" "$OUT/time-zp-ao.log" | awk '{print $5}') |
    awk '{printf "%5s %6s %6s %9s %9s %+6.1f%% %9s %+6.1f%% %9s %+6.1f%%\n", $1, $2, $3, $4, $5, 100 * ($5 / $4 - 1), $6, 100 * ($6 / $4 - 1), $7, 100 * ($7 / $4 - 1)}' | tee "$OUT/zp.txt"
  # The decode row that costs most with zero points (4096 x 28672 at m = 16: +17-18% on the H200
  # and the H100) and one beside it: does another configuration than the table's (chosen for
  # symmetric weights) win with zero points?
  step "zero points: every decode configuration of 4096 x 28672 and 4096 x 6144 at m = 16, symmetric and with zero points"
  $BIN --sweep --reps 100 16:4096:28672 16:4096:6144 > "$OUT/zp-sweep-sym.log" 2>&1
  $BIN --sweep --reps 100 --zeros 16:4096:28672 16:4096:6144 > "$OUT/zp-sweep-zp.log" 2>&1
  grep -E "^ +[0-9]|sweep" "$OUT/zp-sweep-sym.log" | sed 's/^/symmetric: /'
  grep -E "^ +[0-9]|sweep" "$OUT/zp-sweep-zp.log" | sed 's/^/zero points: /'
fi

if has full; then
  # The sweep the targets are stated for (bench_matmul.py --impls full: fp16 and
  # bf16, g128 and g-1, each dtype's XLA dot, XLA int4; m up to 4096; the
  # products summed inside each call, as temporaries: --outputs sum), a slice
  # of layers per call: FULL_LAYERS (default every layer), FULL_MS (default the
  # script's). FULL_RESUME: an earlier slice's JSON (carried in the tree) that
  # this one appends to. The JSON is rewritten after every m, so the time limit
  # (FULL_TIMEOUT seconds, default 420: with `build` before it, a call stays
  # under the GPU machine's 600) loses at most the m it stops in.
  step "full: the targets' sweep (${FULL_LAYERS:-every layer})"
  [ -n "${FULL_RESUME:-}" ] && cp "$FULL_RESUME" "$OUT/full.json"
  scored_matmul full "${FULL_TIMEOUT:-420}" --impls full ${FULL_LAYERS:+--layers $FULL_LAYERS} \
    ${FULL_MS:+--ms $FULL_MS} --append
fi

if has jzp; then
  # The imported layouts' cost through JAX, as the targets state it: zero
  # points, act-order and both against symmetric fp16 g128 weights at m = 1,
  # 16, 64, 256 (bench_matmul.py --impls zp, products summed inside the call),
  # JZP_LAYERS (default every layer), within JZP_TIMEOUT seconds (default 420);
  # the JSON is rewritten after every m.
  step "jzp: zero points and act-order through jm.matmul (${JZP_LAYERS:-every layer})"
  scored_matmul zp "${JZP_TIMEOUT:-420}" --impls zp --ms 1 16 64 256 \
    ${JZP_LAYERS:+--layers $JZP_LAYERS}
fi

if has lab; then
  # Launcher variants (after build): LVARIANTS="x.diff ..." patches of
  # ffi/marlin_kernel.cu, each linked into its own decode_bench beside the
  # tree's; every variant timed with act-order (decode_bench --reps 100 and
  # --chain, fp16 g128) at COST_CASES, the tree with symmetric
  # weights first.
  step "lab: launcher variants (${LVARIANTS:-none}) against the tree's, act-order"
  mkdir -p /tmp/lab
  lnames="tree"
  others=$(ls /tmp/db/*.o | grep -v /launcher.o)
  cp $BIN /tmp/lab/decode_bench_tree
  for v in ${LVARIANTS:-}; do
    n=$(basename "${v%.*}") && lnames="$lnames $n"
    rm -rf "/tmp/lab/$n" && mkdir -p "/tmp/lab/$n" && cp -r ffi "/tmp/lab/$n/"
    patch -s -d "/tmp/lab/$n" -p1 < "$v" || { echo "$v does not apply"; exit 1; }
    nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 -I"/tmp/lab/$n/ffi" \
      -c "/tmp/lab/$n/ffi/marlin_kernel.cu" -o "/tmp/lab/$n/launcher.o" &&
      nvcc -arch=sm_90 $others "/tmp/lab/$n/launcher.o" -o "/tmp/lab/decode_bench_$n" || exit 1
  done
  /tmp/lab/decode_bench_tree --reps 100 $COST_CASES > "$OUT/lab-sym.txt" 2>&1
  decode_columns "$OUT/lab-sym.txt" /tmp/lab/sym
  for n in $lnames; do
    "/tmp/lab/decode_bench_$n" --reps 100 --act-order --chain $COST_CASES > "$OUT/lab-ao-$n.txt" 2>&1
    decode_columns "$OUT/lab-ao-$n.txt" "/tmp/lab/ao-$n"
  done
  echo "us per call: symmetric (tree), then act-order per variant ($lnames); independent calls"
  side_by_side /tmp/lab/sym.us $(for n in $lnames; do echo "/tmp/lab/ao-$n.us"; done)
  echo "us per call in a CUDA graph of dependent calls, act-order, per variant: $lnames"
  side_by_side $(for n in $lnames; do echo "/tmp/lab/ao-$n.graph"; done)
fi

if has gsweep; then
  # The table was filled from independent calls; a decode step runs each layer after the one
  # before. Every configuration of the 8B layers timed in a CUDA graph of dependent calls.
  step "gsweep: every decode configuration of the 8B layers in a CUDA graph of dependent calls, fp16 g128"
  $BIN --sweep --graph $(for l in 4096:6144 4096:4096 4096:28672 14336:4096; do echo -n "1:$l 4:$l 8:$l 16:$l "; done) \
    > "$OUT/gsweep.log" 2>&1
  grep -E "^ +[0-9]|sweep" "$OUT/gsweep.log"
fi

if has ab; then
  step "ab: decode-kernel variants (${VARIANTS:-none}) against the tree's"
  ab_build || exit 1
  cache_summary
  for n in $names; do
    { timeout 60 "/tmp/ab/decode_bench_$n" --check --sweep --group 128 1:4096:4096 16:4096:6144 5:14336:4096
      timeout 40 "/tmp/ab/decode_bench_$n" --check --sweep --group -1 --bf16 3:4096:4096 9:1024:1024; } > "$OUT/ab-check-$n.log" 2>&1
    echo "$n checks: $(grep -c '  check' "$OUT/ab-check-$n.log") run, $(grep -c FAILED "$OUT/ab-check-$n.log") failed"
    grep -q '  check' "$OUT/ab-check-$n.log" || tail -3 "$OUT/ab-check-$n.log"
  done
  for n in $names; do "/tmp/ab/block_bench_$n" --layers ${AB_MS:-1 8 16} > "$OUT/ab-block-$n.txt" 2>&1; done
  for n in $names; do
    "/tmp/ab/decode_bench_$n" --chain $(for m in 1 16; do for l in 4096:6144 4096:4096 4096:28672 14336:4096; do echo -n "$m:$l "; done; done) > "$OUT/ab-chain-$n.txt" 2>&1
  done
  echo "us per block (block_bench: fused calls, then plain projections back to back), per variant: $names"
  for n in $names; do grep -E "^ +[0-9]" "$OUT/ab-block-$n.txt" | awk -v n=$n '{print n, "m=" $1, "kernel", $7, "bound", $6}'; done
  echo "us per call (block_bench --layers), per variant: $names"
  for n in $names; do
    grep '^# layer' "$OUT/ab-block-$n.txt" | sed -E 's/^# layer +//; s/ +us per call//' | awk '{v=$(NF-1); NF-=2; print $0 "\t" v}' > "/tmp/ab/layers-$n.txt"
  done
  paste /tmp/ab/layers-tree.txt $(for n in $names; do [ "$n" != tree ] && echo "/tmp/ab/layers-$n.txt"; done) |
    awk -F'\t' '{printf "%-28s", $1; for (i = 2; i <= NF; i += 2) printf " %8s", $i; print ""}'
  echo "us per call in a CUDA graph of dependent calls (decode_bench --chain), per variant: $names"
  for n in $names; do decode_columns "$OUT/ab-chain-$n.txt" "/tmp/ab/chain-$n"; done
  side_by_side $(for n in $names; do echo "/tmp/ab/chain-$n.graph"; done)
  # AB_ZEROS=1, AB_ACT_ORDER=1: the decode rows (decode_bench --reps 100 --chain, fp16 g128),
  # the tree with symmetric weights first, then every variant with zero points, with
  # act-order; as independent calls, and in a CUDA graph of dependent calls.
  kinds="${AB_ZEROS:+zeros} ${AB_ACT_ORDER:+act-order}"
  if [ -n "${kinds// /}" ]; then
    zc=$(for m in 1 4 16; do for l in $LAYERS; do echo -n "$m:$l "; done; done)
    /tmp/ab/decode_bench_tree --reps 100 --chain $zc > "$OUT/ab-sym-tree.txt" 2>&1
    decode_columns "$OUT/ab-sym-tree.txt" /tmp/ab/sym-tree
    for kind in $kinds; do
      for n in $names; do
        "/tmp/ab/decode_bench_$n" --reps 100 --chain --$kind $zc > "$OUT/ab-$kind-$n.txt" 2>&1
        decode_columns "$OUT/ab-$kind-$n.txt" "/tmp/ab/$kind-$n"
      done
      for col in us graph; do
        echo "us per call ($col), symmetric (tree) and with $kind, per variant: $names"
        side_by_side /tmp/ab/sym-tree.$col $(for n in $names; do echo "/tmp/ab/$kind-$n.$col"; done)
      done
    done
  fi
fi

if has abstep; then
  # The package built once per variant (into /tmp/ab/py-<name>, one build at
  # a time: each takes all cores) and the JAX decode step timed with each, in
  # two alternating rounds, so that a drift of the machine shows.
  step "abstep: the JAX decode step per decode-kernel variant (${VARIANTS:-none} and the tree's)"
  ab_sources
  for n in $names; do
    rm -rf "/tmp/ab/src-$n" "/tmp/ab/py-$n" && mkdir -p "/tmp/ab/src-$n"
    cp -r CMakeLists.txt pyproject.toml README.md LICENSE NOTICE ffi jax_marlin "/tmp/ab/src-$n/"
    cp "/tmp/ab/$n.cu" "/tmp/ab/src-$n/ffi/decode_kernel.cu"
    (cd "/tmp/ab/src-$n" && JAX_MARLIN_CUDA=${AB_CUDA:-ON} SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90" \
      python3 -m pip install --no-build-isolation --no-deps -q --target "/tmp/ab/py-$n" . > "$OUT/abstep-build-$n.log" 2>&1) ||
      { echo "$n: build failed"; tail -5 "$OUT/abstep-build-$n.log"; }
  done
  # AB_SETTINGS: settings to time each variant under, space-separated, each
  # "default" (the environment as it is) or one VAR=value, e.g.
  # "default JAX_MARLIN_COMMAND_BUFFER=0". AB_XLA_FLAGS: values of XLA_FLAGS
  # to add to them ("default" as above), e.g.
  # "default --xla_gpu_enable_command_buffer=-CUSTOM_CALL".
  settings="${AB_SETTINGS:-}"
  for flags in ${AB_XLA_FLAGS:-}; do
    [ "$flags" = default ] && settings="$settings default" || settings="$settings XLA_FLAGS=$flags"
  done
  for round in 1 2; do
    for setting in ${settings:-default}; do
      for n in $names; do
        tag="$n" suffix=""
        [ "$setting" = default ] || tag="$n [$setting]" suffix="-$(printf %s "$setting" | tr -c 'A-Za-z0-9_' _)"
        log="$OUT/abstep-$n-$round$suffix.txt"
        (cd /tmp && if [ "$setting" != default ]; then export "$setting"; fi
         PYTHONPATH="/tmp/ab/py-$n" python3 "$OLDPWD/benchmarks/bench_decode_step.py" ${AB_STEP_ARGS:---ms 1 8}) > "$log" 2>&1
        grep -E "^ +[0-9]" "$log" | sed "s/^/$tag, round $round: /"
      done
    done
  done
fi

if has sanitize; then
  step "compute-sanitizer on the decode kernel"
  timeout 45 compute-sanitizer --tool memcheck --error-exitcode 9 $BIN --check --reps 2 --group 128 \
    1:1024:1024 16:640:192 9:2048:512 > "$OUT/sanitize-memcheck.log" 2>&1
  echo "memcheck exit $? $(grep -E 'ERROR SUMMARY' "$OUT/sanitize-memcheck.log" | head -1)"
  # racecheck is slower: two cases, clusters of 4 and 8 blocks (the push reduction), m_halves 1 and 2.
  timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 $BIN --check --reps 1 --group 128 \
    1:1024:1024 9:2048:512 > "$OUT/sanitize-racecheck.log" 2>&1
  echo "racecheck exit $? $(grep -E 'RACECHECK SUMMARY' "$OUT/sanitize-racecheck.log" | head -1)"
fi
