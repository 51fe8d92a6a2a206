#!/usr/bin/env bash
# The long crash-safety campaign: N (default 200) sharded 3-rank saves over c10d, each with one
# writer SIGKILLed at a random moment; the checkpoint must validate after every trial.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh >/dev/null
OPTSTATE_CRASH_TRIALS=${1:-200} OPTSTATE=build/optstate DIST_CHECK=build/tests/optstate_dist_check \
  LAUNCH=tests/dist/launch.sh bash tests/dist/dist_cases.sh crash-safety
