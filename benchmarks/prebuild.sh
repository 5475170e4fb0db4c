#!/usr/bin/env bash
# Compile, on a machine with nvcc 13.0 and no GPU, what a GPU run of
# decode_run.sh would compile, so that the run spends its device time running:
#
#   benchmarks/prebuild.sh [stage ...]     (default: build probe ab; VARIANTS,
#                                           PVARIANTS, BUILD_PACKAGE as for the run)
#
# Writes prebuilt/ (ignored by git): prebuilt/nvcc/, benchmarks/nvcc_cache's
# entries (the objects of the named stages, keyed by command, compiler and
# sources), and prebuilt/wheel/, the package built with CUDA (sm_90) against
# jax $JAX_VERSION (default 0.11.2, the GPU machine's), with its sources' stamp.
# The run then takes them where everything matches and compiles the rest:
#
#   NVCC_CACHE=prebuilt/nvcc benchmarks/decode_run.sh build probe ab   (carry prebuilt/)
#
# Entries this prebuild did not use are removed at the end, so prebuilt/ holds
# only this tree's objects for these stages: name in one prebuild every stage
# the coming GPU calls will run (build probe ab dsrc pprobe with three variants:
# 40 objects, 12 MB xz-compressed, beside the 13.5 MB wheel; 859 s from nothing
# on 2 cores). A wheel whose stamp matches the sources is kept; with
# BUILD_PACKAGE=0 the wheel is left as it is in any case.
# The package's build goes through the real nvcc, the benchmarks' through the
# cache, NVCC_CACHE_JOBS (default: the cores) compiles at a time.
set -uo pipefail
cd "$(dirname "$0")/.."
command -v nvcc > /dev/null || { echo "no nvcc on PATH (e.g. PATH=/usr/local/cuda-13.0/bin:\$PATH)"; exit 1; }
nvcc --version | grep -q "release 13.0" ||
  echo "warning: nvcc is not 13.0; the GPU machine's is, and its run will miss this cache"

JAX_VERSION=${JAX_VERSION:-0.11.2}
venv=${PREBUILD_VENV:-/tmp/jax_marlin-prebuild-jax$JAX_VERSION}
if [ "${BUILD_PACKAGE:-1}" != 0 ] && ! "$venv/bin/python" -c "import jax, nanobind, scikit_build_core" 2> /dev/null; then
  echo "creating $venv (jax $JAX_VERSION, for the package's FFI headers)"
  # PREBUILD_PYTHON, or the first Python >= 3.12 that runs (a pyenv shim may not).
  py=${PREBUILD_PYTHON:-}
  for c in python3.12 python3 "$(pyenv root 2> /dev/null)"/versions/3.1[2-9]*/bin/python3; do
    [ -z "$py" ] && "$c" -c 'import sys; assert sys.version_info >= (3, 12)' 2> /dev/null && py=$c
  done
  [ -n "$py" ] || { echo "no Python >= 3.12 found: set PREBUILD_PYTHON"; exit 1; }
  "$py" -m venv "$venv" && "$venv/bin/pip" install -q "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" \
    nanobind scikit-build-core || exit 1
fi
[ -x "$venv/bin/python" ] && PATH=$venv/bin:$PATH

# prefill_bench includes cuBLAS's header, which a toolkit without cuBLAS lacks:
# CUBLAS_INCLUDE names a folder holding it; by default the headers of the
# nvidia-cublas wheel of nvcc's release (13.0), fetched once (a 420 MB
# download). Without them, prefill_bench is left for the GPU machine to compile
# (it links there with the machine's cuBLAS in any case).
toolkit=$(dirname "$(dirname "$(command -v nvcc)")")
if [ -z "${CUBLAS_INCLUDE:-}" ] && ! ls "$toolkit"/include/cublas_v2.h "$toolkit"/targets/*/include/cublas_v2.h > /dev/null 2>&1; then
  CUBLAS_INCLUDE=/tmp/jax_marlin-prebuild-cublas-include
  if [ ! -f "$CUBLAS_INCLUDE/cublas_v2.h" ]; then
    echo "fetching cuBLAS's headers (nvidia-cublas 13.0) into $CUBLAS_INCLUDE"
    tmp=$(mktemp -d)
    python3 -m pip download --no-deps -q -d "$tmp" "nvidia-cublas==13.0.*" > /dev/null 2>&1 &&
      mkdir -p "$CUBLAS_INCLUDE" && unzip -q -o -j "$tmp"/nvidia_cublas-*.whl 'nvidia/cu13/include/*' -d "$CUBLAS_INCLUDE" ||
      echo "warning: no cuBLAS headers; prefill_bench will compile on the GPU machine"
    rm -rf "$tmp"
  fi
fi
[ -n "${CUBLAS_INCLUDE:-}" ] && export CPATH=$CUBLAS_INCLUDE${CPATH:+:$CPATH}

mkdir -p prebuilt/nvcc
logs=$(mktemp -d /tmp/prebuild-logs.XXXXXX)
used=$logs/nvcc-cache.log
: > "$used"
stages=${*:-build probe ab}
echo "compiling for: $stages (logs in $logs)"
start=$(date +%s)
OUT=$logs NVCC_CACHE=prebuilt/nvcc NVCC_CACHE_WRITE=1 NVCC_CACHE_LOG=$used \
  NVCC_CACHE_JOBS=${NVCC_CACHE_JOBS:-$(nproc)} COMPILE_ONLY=1 benchmarks/decode_run.sh $stages
status=$?

# Keep the entries this tree uses (hit or stored now); drop the rest.
kept=0 dropped=0
for entry in prebuilt/nvcc/*/; do
  key=$(basename "$entry")
  if grep -q -E "^(hit |miss) $key " "$used"; then kept=$((kept + 1)); else rm -rf "$entry"; dropped=$((dropped + 1)); fi
done
rm -f prebuilt/nvcc/.slot*
echo "prebuilt/: $kept objects kept, $dropped dropped; $(du -sh prebuilt | cut -f1) in $(( $(date +%s) - start )) s"
[ -f prebuilt/wheel/STAMP ] && echo "wheel: $(ls prebuilt/wheel/*.whl) (stamp $(cat prebuilt/wheel/STAMP))"
exit $status
