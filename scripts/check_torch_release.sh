#!/usr/bin/env bash
# The whole build and every test under another torch release than the one the set-up pins
# (scripts/requirements.txt): a venv with that torch and the suite's other packages, the project
# built against that torch's LibTorch (CPU kernels; CUDA builds are scripts/check_cuda_build.sh's),
# CTest, then tests/python with that torch in every process the tests start and that build's CLI
# and ops library.
#
#   TORCH_SPEC=torch==2.15.0 bash scripts/check_torch_release.sh        # 5.5 GB venv, ~30 min on 2 cores
#   TORCH_SPEC=torch==2.15.0 bash scripts/check_torch_release.sh -k torch_versions   # pytest arguments
#
# PyPI's torch for Linux x86_64 is a CUDA build, whose CMake config looks for the CUDA toolkit in
# every project that uses it: nvcc must be on the machine (nothing CUDA is built). Where pip is
# capped at an older torch by a constraint file (this machine's /etc/xdg/pip), run it with
# PIP_CONFIG_FILE=/dev/null. To add that release's checkpoints to the cross-version corpus, run
# tests/data/torch_versions/make.py with the venv's python (its docstring says how).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
spec=${TORCH_SPEC:?"set TORCH_SPEC, e.g. TORCH_SPEC=torch==2.15.0"}
venv=${RELEASE_VENV:-$root/.venv-release}
build=${RELEASE_BUILD_DIR:-$root/build-release}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py=$venv/bin/python
# The suite's packages without the pinned torch; DeepSpeed (an sdist) built against this torch.
"$py" -m pip install -q "$spec" -r <(grep -v '^torch==' scripts/requirements.txt) 2>&1 \
  | grep -v "is ignored: it is neither" || true
DS_BUILD_OPS=0 "$py" -m pip install -q --no-build-isolation --no-deps -r scripts/requirements-sdist.txt 2>&1 \
  | grep -v "is ignored: it is neither" || true
read -r version cuda prefix < <("$py" -W ignore -c \
  'import torch; print(torch.__version__, torch.version.cuda, torch.utils.cmake_prefix_path)' 2>/dev/null)
want=${spec#torch==}
[ "$spec" = "$want" ] || [ "${version%%+*}" = "$want" ] || { echo "check_torch_release: the venv has torch $version, not $want" >&2; exit 2; }
echo "LibTorch $version (CUDA $cuda)"
cuda_args=()
if [ "$cuda" != None ]; then
  cuda_root=""  # as scripts/check_cuda_build.sh finds it
  for c in "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent/bin/nvcc)")")")" ${CUDA_HOME:-} /usr/local/cuda; do
    if [ -f "$c/include/cuda_runtime.h" ] && [ -x "$c/bin/nvcc" ]; then cuda_root=$c; break; fi
  done
  [ -n "$cuda_root" ] || { echo "check_torch_release: torch $version is a CUDA build; its CMake config needs the CUDA toolkit (nvcc)" >&2; exit 2; }
  # an arch list spares LibTorch's config its probe for a GPU (a CUDA20 try_run that fails here)
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  cuda_args=(-DCUDA_TOOLKIT_ROOT_DIR="$cuda_root")
fi
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
start=$(date +%s)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DOPTSTATE_WITH_CUDA=OFF -DCMAKE_PREFIX_PATH="$prefix" \
  -DPython3_EXECUTABLE="$py" "${cuda_args[@]}" "${launcher[@]}" > "$build.log" 2>&1 || { tail -40 "$build.log"; exit 1; }
ninja -C "$build" >> "$build.log" 2>&1 || { grep -B5 -A20 "FAILED" "$build.log" | head -80; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
echo "== ctest against LibTorch $version"
ctest --test-dir "$build" --output-on-failure -j"$(nproc)"
echo "== pytest under torch $version"
# The build's CLI and ops library; PYTHONPATH reaches every script the tests start (they inherit it).
OPTSTATE_BUILD_DIR=$build OPTSTATE_OPS_LIBRARY=$build/liboptstate_ops.so PYTHONPATH=$root/python CUDA_VISIBLE_DEVICES= \
  "$py" -m pytest tests/python -q -p no:cacheprovider -n "${OPTSTATE_TEST_JOBS:-$(nproc)}" --dist worksteal "$@"
