#!/usr/bin/env bash
# CTest install.consumer: installs this build into a temporary prefix, builds a downstream project
# against it with find_package(optstate), and checks that its hash of a demo checkpoint equals the
# optstate CLI's. Env: BUILD_DIR, SOURCE_DIR, OPTSTATE (cli), OPTSTATE_DEMO, CMAKE_PREFIX_EXTRA;
# CUDA_TOOLKIT_ROOT_DIR where the build had one (a CUDA LibTorch's config wants it downstream too).
set -euo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$BUILD_DIR" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/cmake/optstate/optstateConfig.cmake"
cmake -S "$SOURCE_DIR/tests/install/consumer" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix;$CMAKE_PREFIX_EXTRA" ${CUDA_TOOLKIT_ROOT_DIR:+-DCUDA_TOOLKIT_ROOT_DIR="$CUDA_TOOLKIT_ROOT_DIR"} \
  > "$work/configure.log" 2>&1 \
  || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$OPTSTATE_DEMO" --steps 2 --save "$work/ckpt" > /dev/null
want=$("$OPTSTATE" hash "$work/ckpt" | tail -1)
got=$("$work/build/consumer" "$work/ckpt")
echo "cli:      $want"
echo "consumer: $got"
[ "$want" = "$got" ]
