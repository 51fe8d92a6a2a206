#!/usr/bin/env bash
# Run here (with network) before a GPU check: downloads the Debian packages the lent GPU machine
# lacks (fmt, xxHash, nlohmann-json) into third_party/debs/, which the device run carries along
# (ignored by git; scripts/gpu_check.sh unpacks them there with dpkg -x).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$root/third_party/debs"
cd "$root/third_party/debs"
apt-get download libfmt-dev libfmt9 libxxhash-dev libxxhash0 nlohmann-json3-dev
ls -la
