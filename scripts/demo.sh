#!/usr/bin/env bash
# The optstate demo: train a small LibTorch MLP with FusedAdamW and with AdamW8bit, checkpoint,
# inspect and hash the checkpoints, resume in a new process and show the resumed runs end
# bit-identical to uninterrupted ones, then convert the 8-bit checkpoint to fp32 and back, and resume
# through LibTorch's own torch::save / torch::load of the optimizer; then
# ZeRO-1 training on 2 ranks resumed on 3 (bitwise equal to 1 rank), and the state through
# safetensors, HDF5, PyTorch DCP and a torch.save'd optimizer state_dict (optimizer.pt).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh >/dev/null
out=${1:-demo-out}
rm -rf "$out" && mkdir -p "$out"
bin=build

for opt in adamw adamw8bit; do
  echo "==== $opt"
  echo "== uninterrupted run: 60 steps"
  $bin/optstate-demo --optimizer $opt --steps 60 --final "$out/$opt-uninterrupted" | tail -2
  echo "== first 30 steps, then a checkpoint"
  $bin/optstate-demo --optimizer $opt --steps 30 --save "$out/$opt-step30" | tail -1
  $bin/optstate inspect "$out/$opt-step30"
  echo
  $bin/optstate hash "$out/$opt-step30"
  echo "== resume from it in a new process, 30 more steps"
  $bin/optstate-demo --optimizer $opt --steps 60 --resume "$out/$opt-step30" --final "$out/$opt-resumed" | tail -3
  a=$($bin/optstate hash "$out/$opt-uninterrupted" | tail -1)
  b=$($bin/optstate hash "$out/$opt-resumed" | tail -1)
  echo "uninterrupted: $a"
  echo "resumed:       $b"
  if [ "$a" != "$b" ]; then
    echo "MISMATCH: the resumed $opt run differs" >&2
    exit 1
  fi
  echo "the resumed $opt run is bitwise identical to the uninterrupted one"
  echo
done

echo "==== convert the 8-bit checkpoint to fp32 and back"
$bin/optstate convert "$out/adamw8bit-step30" "$out/adamw8bit-step30-fp32" --to fp32
$bin/optstate convert "$out/adamw8bit-step30-fp32" "$out/adamw8bit-step30-back" --to 8bit
echo "8-bit   --values: $($bin/optstate hash --values "$out/adamw8bit-step30" | tail -1)"
echo "fp32    --values: $($bin/optstate hash --values "$out/adamw8bit-step30-fp32" | tail -1)"
echo "8-bit   raw:      $($bin/optstate hash "$out/adamw8bit-step30" | tail -1)"
echo "round trip raw:   $($bin/optstate hash "$out/adamw8bit-step30-back" | tail -1)"
[ "$($bin/optstate hash "$out/adamw8bit-step30")" = "$($bin/optstate hash "$out/adamw8bit-step30-back")" ]
echo "8-bit -> fp32 -> 8-bit reproduces the checkpoint exactly"

echo
echo "==== a C++ loop's own checkpoint: torch::save(optimizer) / torch::load(optimizer), 8-bit state"
$bin/optstate-demo --optimizer adamw8bit --steps 30 --torch-save "$out/libtorch-step30" | tail -1
$bin/optstate inspect "$out/libtorch-step30.optimizer.pt" | sed -n 1,5p
$bin/optstate convert "$out/libtorch-step30.optimizer.pt" "$out/libtorch-step30.torch.pt"   # for Python's torch.load
$bin/optstate-demo --optimizer adamw8bit --steps 60 --torch-resume "$out/libtorch-step30" --final "$out/libtorch-resumed" | tail -3
[ "$($bin/optstate hash "$out/libtorch-resumed" | tail -1)" = "$($bin/optstate hash "$out/adamw8bit-uninterrupted" | tail -1)" ]
echo "the run resumed through torch::load is bitwise identical to the uninterrupted one"
# and the other way: any checkpoint as the archive a C++ loop's torch::load takes (numbered params, no weights)
$bin/optstate convert "$out/adamw8bit-step30" "$out/adamw8bit-step30.libtorch.pt" --format libtorch
$bin/optstate diff "$out/adamw8bit-step30" "$out/adamw8bit-step30.libtorch.pt" --by-position --no-weights | tail -1

echo
echo "==== ZeRO-1 sharded training over torch.distributed (gloo, loopback): 2 ranks -> save -> 3 ranks"
py=.venv/bin/python
run() { n=$1; shift; $py -m torch.distributed.run --standalone --nproc-per-node "$n" samples/train_sharded.py "$@" 2>&1 \
          | grep -v -e '^\*' -e 'OMP_NUM_THREADS' -e '^W[0-9]' ; }
for opt in adamw adamw8bit; do
  echo "== $opt: uninterrupted, 1 rank, 40 steps"
  run 1 --optimizer $opt --steps 40 --save "$out/zero-$opt-uninterrupted"
  echo "== $opt: 2 ranks, 20 steps, sharded save"
  run 2 --optimizer $opt --steps 20 --save "$out/zero-$opt-2ranks"
  $bin/optstate validate "$out/zero-$opt-2ranks"
  echo "== $opt: resume on 3 ranks, 20 more steps"
  run 3 --optimizer $opt --steps 20 --resume "$out/zero-$opt-2ranks" --save "$out/zero-$opt-3ranks"
  a=$($bin/optstate hash "$out/zero-$opt-uninterrupted" | tail -1)
  b=$($bin/optstate hash "$out/zero-$opt-3ranks" | tail -1)
  echo "uninterrupted (1 rank):  $a"
  echo "2 ranks -> 3 ranks:      $b"
  if [ "$a" != "$b" ]; then
    echo "MISMATCH: the resharded $opt run differs" >&2
    exit 1
  fi
  echo "the 2 -> 3 rank run is bitwise identical to the uninterrupted one"
done

echo
echo "==== formats: the 3-rank 8-bit checkpoint as safetensors, HDF5, PyTorch DCP, optimizer.pt, bitsandbytes' and torchao's state_dicts, and back"
src="$out/zero-adamw8bit-3ranks"
$bin/optstate convert "$src" "$out/state.safetensors"
$bin/optstate convert "$src" "$out/state.h5" --compress 4
$bin/optstate convert "$src" "$out/state-dcp" --format dcp --world-size 2   # dense fp32 for torch.optim.AdamW
$bin/optstate convert "$out/state-dcp" "$out/state-back" --to 8bit
$bin/optstate convert "$src" "$out/optimizer.pt"   # torch.optim.AdamW's state_dict, for torch.load
$bin/optstate convert "$out/optimizer.pt" "$out/state-back-pt" --to 8bit
$bin/optstate convert "$src" "$out/bnb-optimizer.pt" --format bitsandbytes   # bitsandbytes' AdamW8bit loads it
# torchao's AdamW8bit loads it; torchao quantizes whole blocks only, so these 97x48 and 67x97
# weights' 8-bit moments go as fp32 values (a note says so), as torchao keeps such params.
$bin/optstate convert "$src" "$out/ao-optimizer.pt" --format torchao
want=$($bin/optstate hash "$src" | tail -1)
for f in state.safetensors state.h5 bnb-optimizer.pt; do
  got=$($bin/optstate hash "$out/$f" | tail -1)
  echo "$f: $got"
  [ "$got" = "$want" ] || { echo "MISMATCH: $f" >&2; exit 1; }
done
# DCP and optimizer.pt hold torch.optim.AdamW's dense state; back in 8-bit, the original codes.
for f in state-back state-back-pt; do
  got=$($bin/optstate hash "$out/$f" | tail -1)
  echo "$f: $got"
  [ "$got" = "$want" ] || { echo "MISMATCH: $f" >&2; exit 1; }
done
# So it holds what the DCP holds, with lr as torchao keeps it (a float32 tensor): diff within 1e-7.
$bin/optstate diff "$out/state-dcp" "$out/ao-optimizer.pt" --rtol 1e-7 > /dev/null || { echo "MISMATCH: ao-optimizer.pt" >&2; exit 1; }
echo "ao-optimizer.pt: the values state-dcp holds (diff --rtol 1e-7: lr as torchao's float32)"
echo "state-dcp    --values: $($bin/optstate hash --values "$out/state-dcp" | tail -1)"
echo "optimizer.pt --values: $($bin/optstate hash --values "$out/optimizer.pt" | tail -1)"
echo "source       --values: $($bin/optstate hash --values "$src" | tail -1)"
echo "every format holds the same state; DCP and optimizer.pt -> 8-bit give back the original codes"
