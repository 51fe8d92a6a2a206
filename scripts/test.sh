#!/usr/bin/env bash
# Sets up (if needed), builds, and runs every test: doctest units and CLI cases under CTest, then the
# pytest interop suite against real PyTorch.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
echo "== ctest (doctest units, CLI cases)"
ctest --test-dir build --output-on-failure -j"$(nproc)"
echo "== doctest detail"
./build/tests/optstate_unit_tests --no-intro 2>&1 | tail -3
if [ -x build/tests/optstate_optim_tests ]; then ./build/tests/optstate_optim_tests --no-intro 2>&1 | tail -3; fi
echo "== pytest (interop with PyTorch)"
# One pytest worker per core (pytest-xdist; worksteal: the multi-rank DeepSpeed/FSDP cases are long):
# the suite is ~400 short Python processes, each importing torch, and one worker leaves a core idle.
.venv/bin/python -m pytest tests/python -q -p no:cacheprovider -n "${OPTSTATE_TEST_JOBS:-$(nproc)}" --dist worksteal \
  --durations=15
