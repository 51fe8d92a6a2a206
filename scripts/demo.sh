#!/usr/bin/env bash
# The optstate demo: train a small LibTorch MLP with FusedAdamW, checkpoint it, inspect and hash the
# checkpoint, resume in a new process, and show the resumed run ends bit-identical to an
# uninterrupted one.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh >/dev/null
out=${1:-demo-out}
rm -rf "$out" && mkdir -p "$out"
bin=build

echo "== 1. uninterrupted run: 60 steps"
$bin/optstate-demo --steps 60 --final "$out/uninterrupted"
echo
echo "== 2. first 30 steps, then a checkpoint"
$bin/optstate-demo --steps 30 --save "$out/ckpt-step30"
echo
echo "== 3. the checkpoint"
$bin/optstate inspect "$out/ckpt-step30"
echo
$bin/optstate hash "$out/ckpt-step30"
echo
echo "== 4. resume from it in a new process, 30 more steps"
$bin/optstate-demo --steps 60 --resume "$out/ckpt-step30" --final "$out/resumed"
echo
a=$($bin/optstate hash "$out/uninterrupted" | tail -1)
b=$($bin/optstate hash "$out/resumed" | tail -1)
echo "uninterrupted: $a"
echo "resumed:       $b"
if [ "$a" = "$b" ]; then
  echo "the resumed run is bitwise identical to the uninterrupted one"
else
  echo "MISMATCH: the resumed run differs" >&2
  exit 1
fi
