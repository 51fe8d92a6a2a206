#!/usr/bin/env bash
# Installs everything a fresh Debian 12 machine lacks, then configures and builds optstate.
# Fast when already done: apt and pip are skipped when their stamp matches, the build is incremental.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

apt_pkgs=(build-essential cmake ninja-build ccache pkg-config python3-venv python3-dev libhdf5-dev libxxhash-dev libzstd-dev libfmt-dev
          doctest-dev nlohmann-json3-dev)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: apt-get install ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

py_reqs="$root/scripts/requirements.txt"
sdist_reqs="$root/scripts/requirements-sdist.txt"
stamp="$root/.venv/.optstate-reqs"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if [ ! -f "$stamp" ] || ! cmp -s <(cat "$py_reqs" "$sdist_reqs") "$stamp"; then
  echo "setup: pip install -r scripts/requirements.txt -r scripts/requirements-sdist.txt" >&2
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -r "$py_reqs"
  # DeepSpeed (for the interop tests): no compiled ops, built against this torch.
  DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --no-build-isolation --no-deps -r "$sdist_reqs"
  cat "$py_reqs" "$sdist_reqs" > "$stamp"
fi

# The Python package lives in python/; a .pth file makes `import optstate` work in the venv.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$root/python" > "$site/optstate.pth"

torch_prefix=$(.venv/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)')
# ccache hits across clones (CI builds a fresh clone each time): rewrite paths relative to the root.
export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1
build_type=${OPTSTATE_BUILD_TYPE:-Release}
if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="$build_type" \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DPython3_EXECUTABLE="$root/.venv/bin/python" \
    ${OPTSTATE_CMAKE_ARGS:-}
fi
cmake --build build -j"${OPTSTATE_JOBS:-$(nproc)}"
