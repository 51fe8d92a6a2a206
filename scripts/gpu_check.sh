#!/usr/bin/env bash
# The GPU check for a lent H200 (torch 2.11+cu130 and CUDA 13 there; no network, no HDF5, fmt,
# xxHash or nlohmann-json): unpacks the Debian packages fetched beforehand by
# scripts/fetch_gpu_deps.sh, builds the optimizers and the torch ops library with their CUDA
# kernels against that machine's LibTorch (ptxas register/spill report), then runs
#   tests/gpu/check_cxx_cuda.cpp  the LibTorch optimizers: CUDA params vs CPU params, bitwise;
#   tests/gpu/check_cuda.py       the torch ops: CUDA vs the CPU path on fresh random inputs (max
#                                 difference; goal: bitwise; the default kernels and those behind
#                                 each tuning knob), CUDA-graph capture, and the timing table (ours
#                                 with a sweep of work-item size, register budget and loads in
#                                 flight; torch fused/foreach, torchao if importable, copy bandwidth);
#   compute-sanitizer memcheck + racecheck over the C++ check, where the toolkit has it.
# Everything lands in $OUT/gpu_check.txt. Budget: well inside 8 minutes including the build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
sysroot=$root/third_party/sysroot
rm -rf "$sysroot" && mkdir -p "$sysroot"
for d in third_party/debs/*.deb; do dpkg -x "$d" "$sysroot"; done
export PKG_CONFIG_SYSROOT_DIR=$sysroot
export PKG_CONFIG_PATH=$sysroot/usr/lib/x86_64-linux-gnu/pkgconfig:$sysroot/usr/share/pkgconfig
export LD_LIBRARY_PATH=$sysroot/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
torch_prefix=$($py -c 'import torch; print(torch.utils.cmake_prefix_path)')
start=$(date +%s)
# LibTorch's CMake finds CUDA through the legacy FindCUDA: point it at nvcc's toolkit; build for
# the H200 only (sm_90), for torch's own flags too.
cuda_root=""
for c in "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")" ${CUDA_HOME:-} /usr/local/cuda /usr/local/cuda-13.0; do
  if [ -f "$c/include/cuda_runtime.h" ] && [ -x "$c/bin/nvcc" ]; then cuda_root=$c; break; fi
done
echo "CUDA toolkit: ${cuda_root:-not found (FindCUDA on its own)}"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DOPTSTATE_WITH_HDF5=OFF -DOPTSTATE_BUILD_TESTS=OFF \
  ${cuda_root:+-DCUDA_TOOLKIT_ROOT_DIR="$cuda_root"} \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_FLAGS=-Xptxas=-v -DCMAKE_PREFIX_PATH="$torch_prefix;$sysroot/usr" \
  -DPython3_EXECUTABLE="$(command -v "$py")" > build-gpu.log 2>&1 || { tail -40 build-gpu.log; exit 1; }
grep -E "optstate:" build-gpu.log || true
ninja -C build-gpu optstate_ops optstate_gpu_cxx_check >> build-gpu.log 2>&1 || { tail -60 build-gpu.log; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
# Each kernel's registers, stack (spills) and shared memory, by kernel name: `adamw8bit_kernel_4<1>`.
awk '/Compiling entry function/ { n = $0; sub(/.*optim_cuda_cu_[0-9a-f]+[0-9][0-9]/, "", n);
       sub(/ILb0EEEv/, "<0>", n); sub(/ILb1EEEv/, "<1>", n); sub(/EP.*/, "", n); sub(/PK.*/, "", n);
       sub(/ENS.*/, "", n) }
     /Used [0-9]+ registers/ { sub(/.*: /, ""); printf "  %-24s %s\n", n, $0 }' build-gpu.log | sort -u || true
out=${OUT:-.}/gpu_check.txt
# Line-buffered output and a time limit on each check: a check that hangs is cut off with what it
# printed so far kept in $out, and the rest of the script still runs.
export PYTHONUNBUFFERED=1
cxx_rc=0
timeout 150 stdbuf -oL -eL ./build-gpu/tests/optstate_gpu_cxx_check 2>&1 | tee "$out" || cxx_rc=$?
py_rc=0
OPTSTATE_OPS_LIBRARY=$root/build-gpu/liboptstate_ops.so PYTHONPATH=$root/python timeout 300 "$py" \
  tests/gpu/check_cuda.py "$@" 2>&1 | tee -a "$out" || py_rc=$?
echo "C++ check exit $cxx_rc, Python check exit $py_rc (124: cut off by its time limit)" | tee -a "$out"
# Device-only faults the host emulation cannot see (out-of-bounds or misaligned accesses, shared-memory
# races): the C++ check's small cases under compute-sanitizer, if the toolkit has it.
san_rc=0
sanitizer=$(command -v compute-sanitizer || ls "$(dirname "$(command -v nvcc)")/compute-sanitizer" 2>/dev/null || true)
if [ -n "$sanitizer" ] && [ -z "${OPTSTATE_GPU_CHECK_NO_SANITIZER:-}" ]; then
  for tool in memcheck racecheck; do
    if [ "$SECONDS" -gt 380 ]; then  # keep the whole script inside 8 minutes
      echo "== compute-sanitizer --tool $tool skipped: ${SECONDS}s elapsed" | tee -a "$out"
      continue
    fi
    echo "== compute-sanitizer --tool $tool (C++ check)" | tee -a "$out"
    rc=0
    timeout 90 "$sanitizer" --tool $tool --error-exitcode 9 ./build-gpu/tests/optstate_gpu_cxx_check \
      > build-gpu/sanitizer.log 2>&1 || rc=$?
    tail -5 build-gpu/sanitizer.log | tee -a "$out"
    # Not findings: a runtime where the sanitizer cannot attach to the GPU (gVisor answers "Device
    # not supported"), and a run cut off by the timeout. Only its error exit (9) or a failed check is.
    if grep -q "Device not supported" build-gpu/sanitizer.log; then
      echo "compute-sanitizer cannot use the GPU on this machine's runtime: $tool not run" | tee -a "$out"
    elif [ "$rc" = 124 ]; then
      echo "compute-sanitizer --tool $tool: cut off after 90 s, no verdict" | tee -a "$out"
    elif [ "$rc" != 0 ]; then
      san_rc=$rc
    fi
  done
else
  echo "compute-sanitizer not run" | tee -a "$out"
fi
echo "sanitizer exit $san_rc; ${SECONDS}s in all" | tee -a "$out"
[ "$cxx_rc" = 0 ] && [ "$py_rc" = 0 ] && [ "$san_rc" = 0 ]
