#!/usr/bin/env bash
# A/B timing of kernel builds with benchmarks/kernel_bench.cu (no JAX, no pip):
# each variant is a source tree holding ffi/ plus extra nvcc flags; all build in
# parallel, then run in turns (ROUNDS times, every variant once per round, so
# that drift of the GPU shows up as spread rather than as a difference).
#
#   CASES="64:8192:10240 1:8192:10240" benchmarks/kernel_ab.sh \
#       seed=.seed-src:-DSEED_API now=. noprefetch=.:-DJAX_MARLIN_L2_PREFETCH=0
#
# G128_ONLY=1 builds the fp16 group-size-128 kernels alone (the rest are
# kernel_bench_stubs.cu): one instance file a variant instead of eight. Extra
# kernel_bench arguments (--check, --trace) go in BENCH_ARGS.
# The first variant is the baseline of the ratios. A tree whose ffi/ has no
# marlin_instance.cu is the seed (one translation unit; build it with -DSEED_API).
# Logs and the table go to $OUT (or ./kernel-ab).
set -uo pipefail
OUT=${OUT:-$PWD/kernel-ab}
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
arch=${ARCH:-sm_90}
cases=${CASES:-1:8192:10240 64:8192:10240 128:8192:10240}
rounds=${ROUNDS:-2}
g128_only=${G128_ONLY:-0}
bench_args=${BENCH_ARGS:-}
build=/tmp/kernel-ab
mkdir -p $build
jobs=${JOBS:-$(nproc)}

nvcc_() { nvcc -O3 -std=c++17 -arch=$arch -Xptxas=-warn-spills "$@"; }

names=()
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; src=${rest%%:*}; flags=""
  [[ $rest == *:* ]] && flags=${rest#*:}
  names+=("$name")
  d=$build/$name; mkdir -p $d
  (
    objs=()
    if [ -f "$src/ffi/marlin_instance.cu" ] && [ "$g128_only" = 1 ]; then
      objs+=($d/inst_half_8.o $d/stubs.o)
      nvcc_ $flags -DMARLIN_SCALAR=half -DMARLIN_GROUP_BLOCKS=8 -c "$src/ffi/marlin_instance.cu" -o $d/inst_half_8.o &
      nvcc_ $flags -I"$src/ffi" -c "$here/kernel_bench_stubs.cu" -o $d/stubs.o &
    elif [ -f "$src/ffi/marlin_instance.cu" ]; then
      for scalar in half nv_bfloat16; do
        for g in -1 2 4 8; do
          o=$d/inst_${scalar}_${g}.o; objs+=($o)
          nvcc_ $flags -DMARLIN_SCALAR=$scalar -DMARLIN_GROUP_BLOCKS=$g -c "$src/ffi/marlin_instance.cu" -o $o &
          while [ "$(jobs -r | wc -l)" -ge "$jobs" ]; do sleep 0.2; done
        done
      done
    fi
    nvcc_ $flags -I"$src/ffi" -c "$src/ffi/marlin_kernel.cu" -o $d/launcher.o &
    nvcc_ $flags -I"$src/ffi" -c "$here/kernel_bench.cu" -o $d/bench.o &
    wait
    nvcc -arch=$arch $d/bench.o $d/launcher.o "${objs[@]}" -o $d/kernel_bench
  ) > "$OUT/build-$name.log" 2>&1 &
done
wait
for name in "${names[@]}"; do
  [ -x $build/$name/kernel_bench ] || { echo "build $name failed:"; tail -20 "$OUT/build-$name.log"; exit 1; }
  grep -h "spill" "$OUT/build-$name.log" | grep -v " 0 bytes spill" | sort -u | sed "s/^/$name: /" | head -5
done

for r in $(seq $rounds); do
  for name in "${names[@]}"; do
    $build/$name/kernel_bench $bench_args $cases | sed "s/^/$name $r /" >> "$OUT/kernel-ab.txt" || exit 1
  done
done

# Per variant and case: the median over rounds of the per-round medians, and
# the ratio to the first variant.
python3 - "$OUT/kernel-ab.txt" "${names[@]}" <<'EOF' | tee "$OUT/kernel-ab.md"
import collections, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) == 8 and f[2].isdigit():
        rows[(f[0], f"{f[2]}x{f[3]}x{f[4]}")].append(float(f[5]))
names = sys.argv[2:]
cases = list(dict.fromkeys(c for _, c in rows))
print("| m x k x n | " + " | ".join(names) + " |")
print("|---" * (len(names) + 1) + "|")
logs = collections.defaultdict(list)
for c in cases:
    base = statistics.median(rows[(names[0], c)])
    cells = []
    for n in names:
        v = rows[(n, c)]
        t = statistics.median(v)
        logs[n].append(t / base)
        cells.append(f"{t:.2f} ({t / base:.3f}, spread {max(v) - min(v):.2f})")
    print(f"| {c} | " + " | ".join(cells) + " |")
print("| geomean ratio | " + " | ".join(
    f"{statistics.geometric_mean(logs[n]):.3f}" for n in names) + " |")
EOF
