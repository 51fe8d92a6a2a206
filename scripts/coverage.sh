#!/usr/bin/env bash
# Line coverage of libckpt/, formats/ and cli/ by the tests that run them: the doctest units and
# fuzz-corpus runs under CTest, the CLI cases (tests/cli/cli_cases.sh) and the pytest interop suite,
# each through a `--coverage` build of the CLI. Not in CI: ~20 minutes on 2 cores (a 2-minute
# build, ~4 of CTest, ~1 of CLI cases, ~13 of pytest).
#
#   bash scripts/coverage.sh              # build-cov/coverage.txt (per file) and coverage.json
#   bash scripts/coverage.sh --no-pytest  # CTest and the CLI cases only
#
# The coverage build leaves LibTorch out (a build of the optimizers with coverage would take most of
# an hour): the CLI cases make their checkpoints with build/optstate-demo and pytest loads
# build/liboptstate_ops.so, so the code those reach inside the ops library (optstate.save/load)
# counts as not run. A process that dies of a signal (the interrupted-write cases) writes no counts.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
run_pytest=1
if [ "${1:-}" = --no-pytest ]; then run_pytest=0; shift; fi
[ -x build/optstate-demo ] && [ -f build/liboptstate_ops.so ] || bash scripts/setup.sh
cov=$root/build-cov
export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1
jobs=$(nproc)
if [ ! -f "$cov/build.ninja" ]; then
  mkdir -p "$cov"
  flags="--coverage -fprofile-update=atomic -O1"
  cmake -S . -B "$cov" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DOPTSTATE_WITH_TORCH=OFF -DOPTSTATE_WITH_CUDA=OFF \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS=--coverage \
    -DCMAKE_SHARED_LINKER_FLAGS=--coverage -DPython3_EXECUTABLE="$root/.venv/bin/python" > "$cov/configure.log" 2>&1 ||
    { tail -30 "$cov/configure.log"; exit 1; }
fi
ninja -C "$cov"
find "$cov" -name '*.gcda' -delete  # counts of this run only
if [ ! -x "$cov/gcovr-venv/bin/gcovr" ]; then
  python3 -m venv "$cov/gcovr-venv" && "$cov/gcovr-venv/bin/pip" install -q gcovr
fi

echo "== ctest (coverage build: units, fuzz corpora)"
ctest --test-dir "$cov" -j"$jobs" --output-on-failure
echo "== CLI cases"
cases=$(ctest --test-dir build -N -R '^cli\.' | sed -n 's/.*Test *#[0-9]*: cli\.//p')
failed=0
for c in $cases; do
  OPTSTATE=$cov/optstate OPTSTATE_DEMO=$root/build/optstate-demo OPTSTATE_PYTHON=$root/.venv/bin/python \
    bash tests/cli/cli_cases.sh "$c" > "$cov/cli-$c.log" 2>&1 || { echo "FAIL cli.$c (see $cov/cli-$c.log)"; failed=1; }
done
if [ "$run_pytest" = 1 ]; then
  echo "== pytest (the coverage build's CLI)"
  OPTSTATE_BUILD_DIR=$cov .venv/bin/python -m pytest tests/python -q -p no:cacheprovider -n "$jobs" --dist worksteal \
    "$@" || failed=1
fi
echo "== coverage"
# Counters gcov reports as "suspicious" (a line run 2^32 times and more) or negative (gcc bug 68080;
# -fprofile-update=atomic keeps threads from losing updates): kept, warned once a file, not shown.
"$cov/gcovr-venv/bin/gcovr" -r "$root" "$cov" --filter 'libckpt/' --filter 'formats/' --filter 'cli/' \
  --exclude '.*fuzz.*' \
  --gcov-ignore-parse-errors=suspicious_hits.warn_once_per_file \
  --gcov-ignore-parse-errors=negative_hits.warn_once_per_file \
  --gcov-ignore-errors=no_working_dir_found -j"$jobs" --txt "$cov/coverage.txt" --json "$cov/coverage.json" \
  2> "$cov/gcovr.log" || { grep -v WARNING "$cov/gcovr.log" | tail -20; exit 1; }
tail -2 "$cov/coverage.txt" | head -1
echo "per file: $cov/coverage.txt (lines not run listed)"
exit "$failed"
