#!/usr/bin/env bash
# The Python suite under another torch release than the one the set-up pins (scripts/requirements.txt):
# a venv with that torch and the suite's other packages, the ops library built against that
# torch's LibTorch (a CUDA build from PyPI: through scripts/check_cuda_build.sh, which also checks its
# CUDA kernels register), then tests/python with that torch in every process the tests start. The
# CLI the tests run is the main build's (build/optstate, scripts/setup.sh): it links no Python.
#
#   TORCH_SPEC=torch==2.15.0 bash scripts/check_torch_release.sh        # 5.5 GB venv, ~20 min on 2 cores
#   TORCH_SPEC=torch==2.15.0 bash scripts/check_torch_release.sh -k torch_versions   # pytest arguments
#
# Where pip is capped at an older torch by a constraint file (this machine's /etc/xdg/pip), run it
# with PIP_CONFIG_FILE=/dev/null. To add that release's checkpoints to the cross-version corpus, run
# tests/data/torch_versions/make.py with the venv's python (its docstring says how).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
spec=${TORCH_SPEC:?"set TORCH_SPEC, e.g. TORCH_SPEC=torch==2.15.0"}
venv=${RELEASE_VENV:-$root/.venv-release}
build=${RELEASE_BUILD_DIR:-$root/build-release}
[ -x build/optstate ] || { echo "check_torch_release: build/optstate is missing; run scripts/setup.sh" >&2; exit 2; }
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# The suite's packages without the pinned torch; DeepSpeed (an sdist) built against this torch.
"$venv/bin/python" -m pip install -q "$spec" -r <(grep -v '^torch==' scripts/requirements.txt) 2>&1 \
  | grep -v "is ignored: it is neither" || true
DS_BUILD_OPS=0 "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps -r scripts/requirements-sdist.txt 2>&1 \
  | grep -v "is ignored: it is neither" || true
got=$("$venv/bin/python" -W ignore -c 'import torch; print(torch.__version__)' 2>/dev/null)
want=${spec#torch==}
[ "$spec" = "$want" ] || [ "${got%%+*}" = "$want" ] || { echo "check_torch_release: the venv has torch $got, not $want" >&2; exit 2; }
cuda=$("$venv/bin/python" -W ignore -c 'import torch; print(torch.version.cuda)' 2>/dev/null)
if [ "$cuda" != None ]; then
  CUDA_VENV=$venv CUDA_BUILD_DIR=$build TORCH_SPEC=$spec bash scripts/check_cuda_build.sh
else  # a CPU build of torch: the ops library alone, as scripts/setup.sh configures it
  prefix=$("$venv/bin/python" -W ignore -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DOPTSTATE_BUILD_TESTS=OFF \
    -DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$venv/bin/python" > "$build.log" 2>&1 \
    || { tail -40 "$build.log"; exit 1; }
  ninja -C "$build" optstate_ops >> "$build.log" 2>&1 || { grep -B5 -A20 "FAILED" "$build.log" | head -80; exit 1; }
fi
echo "== pytest under torch $got"
# PYTHONPATH and the ops library reach every script the tests start (they inherit the environment).
OPTSTATE_OPS_LIBRARY=$build/liboptstate_ops.so PYTHONPATH=$root/python CUDA_VISIBLE_DEVICES= \
  "$venv/bin/python" -m pytest tests/python -q -p no:cacheprovider -n "${OPTSTATE_TEST_JOBS:-$(nproc)}" \
  --dist worksteal "$@"
