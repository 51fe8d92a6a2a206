#!/usr/bin/env bash
# Multi-process sharded saves over c10d on loopback.
set -uo pipefail
: "${OPTSTATE:?}" "${DIST_CHECK:?}" "${LAUNCH:?}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL [$1]: $2" >&2; exit 1; }

case "$1" in
  save-world-sizes)
    for mode in dense 8bit; do
      bash "$LAUNCH" 1 "$DIST_CHECK" $mode "$work/$mode-1" >/dev/null || fail "$1" "world 1 $mode"
      want=$("$OPTSTATE" hash "$work/$mode-1")
      for n in 2 3 4; do
        bash "$LAUNCH" $n "$DIST_CHECK" $mode "$work/$mode-$n" >/dev/null || fail "$1" "world $n $mode"
        [ "$(ls "$work/$mode-$n/data" | wc -l)" -eq $n ] || fail "$1" "world $n: expected $n rank files"
        "$OPTSTATE" validate "$work/$mode-$n" >/dev/null || fail "$1" "world $n $mode does not validate"
        [ "$("$OPTSTATE" hash "$work/$mode-$n")" = "$want" ] || fail "$1" "hash differs at world $n ($mode)"
        for m in 1 2 3 4; do  # every N -> M layout
          "$OPTSTATE" reshard "$work/$mode-$n" "$work/$mode-$n-$m" --world-size $m >/dev/null || fail "$1" "$n->$m"
          [ "$("$OPTSTATE" hash "$work/$mode-$n-$m")" = "$want" ] || fail "$1" "hash differs $n->$m ($mode)"
        done
      done
      echo "ok: $mode: 1-4 processes save the same checkpoint; every N->M keeps the hash"
    done
    ;;
  crash-safety)
    trials=${OPTSTATE_CRASH_TRIALS:-20}
    bash "$LAUNCH" 3 "$DIST_CHECK" dense "$work/ckpt" >/dev/null || fail "$1" "first save"
    good=$("$OPTSTATE" hash "$work/ckpt")
    committed=0
    for ((t = 0; t < trials; t++)); do
      victim=$((t % 3))
      OPTSTATE_SAVE_ID=$t OPTSTATE_TIMEOUT_MS=1000 OPTSTATE_KILL_RANK=$victim OPTSTATE_KILL_MAX_US=20000 \
        bash "$LAUNCH" 3 "$DIST_CHECK" 8bit "$work/ckpt" >/dev/null 2>&1
      # Whatever happened, the checkpoint at the path is complete and valid: the previous one, or
      # (when the victim died after rank 0 committed) the new one.
      "$OPTSTATE" validate "$work/ckpt" >/dev/null || fail "$1" "trial $t: checkpoint does not validate"
      h=$("$OPTSTATE" hash "$work/ckpt")
      if [ "$h" != "$good" ]; then committed=$((committed + 1)); good=$h; fi
      ls -a "$work" | grep -q partial && [ $victim -eq 0 ] && rm -rf "$work"/.ckpt.partial-*  # rank 0 died: its staging dir is inert
      [ -z "$(ls -A "$work" | grep -v -e '^ckpt$' -e partial)" ] || fail "$1" "trial $t left stray files"
    done
    echo "ok: $trials trials with a writer SIGKILLed at a random moment: the checkpoint always validated ($committed new commits)"
    ;;
  *) fail "$1" "unknown case" ;;
esac
