#!/usr/bin/env bash
# The full CUDA build on a machine without a GPU: what scripts/gpu_check.sh builds on a lent GPU
# (the kernels, cuda_step.cpp, the torch ops library with its CUDA implementations, the C++ GPU
# check), compiled and linked against a CUDA build of LibTorch, so that a change to the
# CUDA-dispatch code, which CI's CPU LibTorch never compiles, is caught before GPU time is spent.
# Then: the ops library loads into that torch with CPU and CUDA kernels registered for all four
# optimizer ops, the CPU path steps, and the C++ check says it found no device.
#
#   bash scripts/check_cuda_build.sh            # venv .venv-cuda with torch==2.14.1 (a CUDA 13.0
#                                               # build; pip takes it from this machine's disk)
#   TORCH_SPEC=torch==2.11.0 bash scripts/check_cuda_build.sh   # the GPU machine's release
#
# About 5.5 GB for the venv (kept for the next run) and 2-8 minutes of building on 2 cores.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${CUDA_VENV:-$root/.venv-cuda}
build=${CUDA_BUILD_DIR:-$root/build-cuda}
spec=${TORCH_SPEC:-torch==2.14.1}
command -v nvcc > /dev/null || { echo "check_cuda_build: nvcc not found" >&2; exit 2; }
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q "$spec" 2>&1 | grep -v "is ignored: it is neither" || true
py=$venv/bin/python
read -r version cuda prefix < <("$py" -W ignore -c \
  'import torch; print(torch.__version__, torch.version.cuda, torch.utils.cmake_prefix_path)' 2>/dev/null)
[ "$cuda" != None ] || { echo "check_cuda_build: $spec in $venv is a CPU build" >&2; exit 2; }
echo "LibTorch $version (CUDA $cuda)"
cuda_root=""  # LibTorch's FindCUDA wants the toolkit's root (as in gpu_check.sh)
for c in "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")" ${CUDA_HOME:-} /usr/local/cuda; do
  if [ -f "$c/include/cuda_runtime.h" ] && [ -x "$c/bin/nvcc" ]; then cuda_root=$c; break; fi
done
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
start=$(date +%s)
# The same configuration as gpu_check.sh: sm_90 only, no HDF5, no tests but the GPU check.
TORCH_CUDA_ARCH_LIST=9.0 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DOPTSTATE_WITH_HDF5=OFF \
  -DOPTSTATE_BUILD_TESTS=OFF ${cuda_root:+-DCUDA_TOOLKIT_ROOT_DIR="$cuda_root"} -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$py" "${launcher[@]}" > "$build.log" 2>&1 \
  || { tail -40 "$build.log"; exit 1; }
grep -q "LibTorch has CUDA" "$build.log" || { grep "optstate:" "$build.log"; echo "no CUDA dispatch configured" >&2; exit 1; }
ninja -C "$build" optstate_ops optstate_gpu_cxx_check >> "$build.log" 2>&1 || { grep -B5 -A20 "FAILED" "$build.log" | head -80; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
OPTSTATE_OPS_LIBRARY=$build/liboptstate_ops.so PYTHONPATH=$root/python "$py" -W ignore - <<'EOF'
import torch
import optstate
has = torch._C._dispatch_has_kernel_for_dispatch_key
ops = ["optstate::fused_adamw_", "optstate::adamw8bit_"]
missing = [f"{op} {key}" for op in ops for key in ("CPU", "CUDA") if not has(op, key)]
assert not missing, f"no kernel registered: {missing}"
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
for make in (optstate.FusedAdamW, optstate.AdamW8bit):
    opt = make(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).square().sum().backward()
    opt.step()
print("ops library: CPU and CUDA kernels registered; CPU steps ran")
EOF
out=$("$build/tests/optstate_gpu_cxx_check" 2>&1) && rc=0 || rc=$?
[ "$out" = "no CUDA device" ] && [ "$rc" != 0 ] || { echo "C++ check: unexpected exit $rc: $out" >&2; exit 1; }
echo "C++ GPU check: built, and finds no device here (as expected)"
