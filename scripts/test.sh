#!/usr/bin/env bash
# Sets up (if needed), builds, and runs every test: doctest units and CLI cases under CTest, then the
# pytest interop suite against real PyTorch.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
echo "== ctest (doctest units, CLI cases)"
# CTest prints no output of a passing test; its JUnit record keeps it (up to the size given), so the
# doctest binaries' case and assertion counts are read from there rather than by running them again.
junit=$root/build/ctest-junit.xml
ctest --test-dir build --output-on-failure -j"$(nproc)" --output-junit "$junit" --test-output-size-passed 1048576
echo "== doctest detail"
.venv/bin/python - "$junit" <<'EOF'
import re, sys, xml.etree.ElementTree as ET
counts = [(case.get("name"), line)
          for case in ET.parse(sys.argv[1]).getroot().iter("testcase")
          for line in re.findall(r"\[doctest\] (?:test cases|assertions|Status):.*", case.findtext("system-out") or "")]
for name, line in counts:
    print(f"{name}: {line}")
if not counts:
    sys.exit(f"no doctest counts in {sys.argv[1]}: did the doctest binaries run under CTest?")
EOF
echo "== pytest (interop with PyTorch)"
# One pytest worker per core (pytest-xdist; worksteal: the multi-rank DeepSpeed/FSDP cases are long):
# the suite is ~300 short Python processes with torch (forked from a server per worker that imported
# it once: tests/python/forkserver.py; OPTSTATE_TEST_FORKSERVER=0 runs them fresh), and one worker
# leaves a core idle.
.venv/bin/python -m pytest tests/python -q -p no:cacheprovider -n "${OPTSTATE_TEST_JOBS:-$(nproc)}" --dist worksteal \
  --durations=15
