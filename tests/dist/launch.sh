#!/usr/bin/env bash
# A torchrun-style launcher for local runs: launch.sh N CMD... runs N copies of CMD with RANK,
# WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT; exits non-zero if any rank did.
set -u
n=$1; shift
port=${MASTER_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
pids=()
for ((r = 0; r < n; r++)); do
  RANK=$r WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
