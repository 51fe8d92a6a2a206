#!/usr/bin/env bash
# AddressSanitizer + UBSan over the tests CI runs, the LibTorch parts included: the optimizers and
# their CPU kernels (optstate_optim_tests, the demo), the torch ops library loaded into Python (the
# pytest suite), the CLI, the doctest units and the multi-process c10d checks. Not the bounded fuzz
# runs: their sanitizer build is docs/fuzzing.md's (clang, libFuzzer); this one is gcc, CI's compiler.
#
#   bash scripts/sanitize.sh               # build under build-asan/, then CTest and pytest
#   bash scripts/sanitize.sh --no-pytest   # CTest only
#   bash scripts/sanitize.sh -k adamw8bit  # other arguments go to pytest
#
# 40-50 minutes of building on 2 cores from a cold cache (the sanitized objects share nothing with build/), then
# ~4 min of CTest and ~22 min of pytest. Any sanitizer report fails the run: the process reporting it
# exits non-zero (its test fails, UBSan's report in the test's output) and ASan's reports are also
# kept under build-asan/sanitizer-logs/ (a subprocess's report would otherwise be lost in its output).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
run_pytest=1
if [ "${1:-}" = --no-pytest ]; then run_pytest=0; shift; fi
[ -x .venv/bin/python ] || bash scripts/setup.sh
build=$root/build-asan
torch_prefix=$(.venv/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)')
export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DOPTSTATE_SANITIZE=address,undefined \
    -DOPTSTATE_WITH_CUDA=OFF -DCMAKE_PREFIX_PATH="$torch_prefix" -DPython3_EXECUTABLE="$root/.venv/bin/python"
fi
# What the tests below run; the fuzz targets are left to docs/fuzzing.md's build.
ninja -C "$build" optstate liboptstate_ops.so optstate-demo optstate_unit_tests optstate_optim_tests \
  optstate_dist_check optstate_write_libtorch_archives

logs=$build/sanitizer-logs
rm -rf "$logs" && mkdir -p "$logs"
# UBSan stops at its first report (by default it prints and goes on, and the test passes).
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export ASAN_OPTIONS=detect_leaks=1:log_path=$logs/asan
status=0
echo "== ctest under ASan + UBSan (units, CLI cases, optimizers, c10d ranks)"
# cli.convert-memory measures peak RSS, which ASan's quarantine of freed blocks (256 MB) inflates;
# it runs apart, with no quarantine.
ctest --test-dir "$build" --output-on-failure -j"$(nproc)" -R '^(unit|cli|optim|dist)' \
  -E '^cli\.convert-memory$' || status=1
ASAN_OPTIONS=detect_leaks=1:quarantine_size_mb=0:log_path=$logs/asan \
  ctest --test-dir "$build" --output-on-failure -R '^cli\.convert-memory$' || status=1

if [ "$run_pytest" = 1 ]; then
  echo "== pytest under ASan + UBSan (the ops library and the CLI of build-asan)"
  # Python is not instrumented: the ASan runtime must come first (LD_PRELOAD), with libstdc++ beside
  # it so its __cxa_throw interceptor finds the real one (else the first C++ exception aborts).
  # No leak check: CPython and torch keep what they allocate until exit. Every subprocess inherits it.
  LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \
  ASAN_OPTIONS=detect_leaks=0:log_path=$logs/asan \
  OPTSTATE_BUILD_DIR=$build OPTSTATE_OPS_LIBRARY=$build/liboptstate_ops.so \
    .venv/bin/python -m pytest tests/python -q -p no:cacheprovider -n "${OPTSTATE_TEST_JOBS:-$(nproc)}" \
      --dist worksteal "$@" || status=1
fi

# A report is an error, a UBSan runtime error or a runtime CHECK; a log holding only the statistics of
# libhdf5's leak suppressions (unit.refused-writes: formats/hdf5/lsan.supp) is none.
reports=$(grep -l -E 'ERROR: [A-Za-z]+Sanitizer|runtime error:|CHECK failed' "$logs"/* 2> /dev/null || true)
if [ -n "$reports" ]; then
  echo "sanitizer reports:"
  for r in $reports; do echo "== $r"; head -60 "$r"; done
  status=1
fi
[ "$status" = 0 ] && echo "sanitize: no findings" || echo "sanitize: FAILED"
exit "$status"
