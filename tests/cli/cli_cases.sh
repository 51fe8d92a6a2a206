#!/usr/bin/env bash
# CLI cases run by CTest: `cli_cases.sh CASE` with OPTSTATE and OPTSTATE_DEMO set to the built binaries.
# Each case checks the exit status and that the message names the offending file.
set -uo pipefail
case_name=$1
: "${OPTSTATE:?}" "${OPTSTATE_DEMO:?}"
PY=${OPTSTATE_PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fail() { echo "FAIL [$case_name]: $*" >&2; exit 1; }

# grep that reads all of its input: `grep -q` stops at the first match, so under pipefail the
# writer's SIGPIPE could fail a case that matched (a load-dependent race).
matches() { grep "$@" >/dev/null; }

# expect_error WANT_RC PATTERN -- cmd...: runs cmd, checks rc and that stderr matches PATTERN in one line.
expect_error() {
  local want=$1 pattern=$2; shift 3
  local out rc
  out=$("$@" 2>&1 >/dev/null); rc=$?
  [ "$rc" -eq "$want" ] || fail "exit $rc (want $want) from: $* -- $out"
  [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ] || fail "error is not one line: $out"
  printf '%s\n' "$out" | matches -E -- "$pattern" || fail "error '$out' does not match '$pattern'"
  echo "ok: $* -> $rc: $out"
}

make_ckpt() { "$OPTSTATE_DEMO" --steps 3 --save "$1" >/dev/null || fail "demo could not write $1"; }

# Re-signs manifest.json after an edit made by a python expression on `j` (keeps the test honest:
# the check behind the manifest checksum is the one exercised).
resign() {
  "$PY" - "$1" "$2" <<'PY'
import json, subprocess, sys
path, expr = sys.argv[1], sys.argv[2]
j = json.load(open(path))
exec(expr)
j.pop("manifest_xxh3", None)
body = json.dumps(j, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
import xxhash
j["manifest_xxh3"] = xxhash.xxh3_64_hexdigest(body.encode())
json.dump(j, open(path, "w"), indent=1)
PY
}

# Flips the first byte of the first chunk of one entry's values in the native checkpoint $1 (the
# manifest, and so its checksum, unchanged: the chunk's own checksum is what catches it).
damage_first_chunk() {
  "$PY" - "$1" "$2" "$3" <<'PY' || fail "could not damage a chunk of $2.$3"
import json, pathlib, sys
root, param, entry = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
j = json.load(open(root / "manifest.json"))
chunk = j["params"][param]["entries"][entry]["components"]["values"][0]
data = root / j["files"][chunk["file"]]["path"]
b = bytearray(data.read_bytes())
b[chunk["offset"]] ^= 0xFF
data.write_bytes(bytes(b))
PY
}

case "$case_name" in
  help)
    "$OPTSTATE" --help | matches "inspect" || fail "no command list"
    for c in inspect hash convert validate diff reshard; do "$OPTSTATE" "$c" --help | matches "usage: optstate $c" || fail "$c --help"; done
    expect_error 2 "unknown command" -- "$OPTSTATE" frobnicate
    expect_error 2 "unknown option '--bogus'" -- "$OPTSTATE" hash --bogus x
    expect_error 2 "usage: optstate hash" -- "$OPTSTATE" hash
    "$OPTSTATE" --version | matches -E "^optstate [0-9]+\.[0-9]+\.[0-9]+$" || fail "--version"
    "$OPTSTATE" >/dev/null 2>"$work/err" && fail "no command exited 0"
    matches "inspect" "$work/err" || fail "no command list on stderr without a command"
    # --name=value is --name value; a flag given a value, or an option none, is a usage error.
    make_ckpt "$work/c"
    inline=$("$OPTSTATE" inspect --params='layers.0.*' "$work/c") || fail "--params=X failed"
    printf '%s\n' "$inline" | matches "^layers.0.weight " || fail "--params=X: $inline"
    [ "$inline" = "$("$OPTSTATE" inspect --params 'layers.0.*' "$work/c")" ] || fail "--params=X differs from --params X"
    "$OPTSTATE" reshard "$work/c" "$work/r" --world-size=3 >/dev/null || fail "--world-size=3"
    [ "$(ls "$work/r/data")" = "$(printf 'rank-%05d.bin\n' 0 1 2)" ] || fail "--world-size=3 did not give 3 ranks"
    "$OPTSTATE" inspect --no-stats "$work/r" | matches "^checkpoint  .* (native, files of 3 ranks)$" || fail "inspect: ranks"
    expect_error 2 "option '--json' takes no value" -- "$OPTSTATE" hash --json=1 "$work/c"
    expect_error 2 "option '--params' needs a value" -- "$OPTSTATE" inspect "$work/c" --params
    expect_error 2 "--rtol needs a non-negative number, got ''" -- "$OPTSTATE" diff "$work/c" "$work/r" --rtol=
    ;;
  hash-output)
    make_ckpt "$work/c"
    out=$("$OPTSTATE" hash "$work/c") || fail "hash failed"
    last=$(printf '%s\n' "$out" | tail -1)
    [[ "$last" =~ ^[0-9a-f]{32}\ \ \(root\)$ ]] || fail "bad root line '$last'"
    names=$(printf '%s\n' "$out" | head -n -1 | awk '{print $2}')
    [ "$names" = "$(printf '%s\n' "$names" | LC_ALL=C sort)" ] || fail "entries not sorted"
    printf '%s\n' "$names" | matches -x "layers.0.weight.exp_avg_sq" || fail "missing entry"
    json=$("$OPTSTATE" hash --json "$work/c") || fail "hash --json failed"
    root=$(printf '%s' "$json" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["root"])')
    [ "$root $last" = "$root ${root}  (root)" ] || fail "json root $root differs from '$last'"
    # Deterministic across runs and equal with --values for fp32 dense state.
    [ "$("$OPTSTATE" hash "$work/c")" = "$out" ] || fail "hash not deterministic"
    "$OPTSTATE" hash --values "$work/c" >/dev/null || fail "--values failed"
    # --params: the matching params' entries, hashed as in the whole, and a root of their own; the
    # other params are not read (a damaged chunk of one fails the whole hash, not this one).
    sel=$("$OPTSTATE" hash "$work/c" --params 'layers.0.*') || fail "hash --params failed"
    [ "$(printf '%s\n' "$sel" | head -n -1)" = "$(printf '%s\n' "$out" | grep ' layers\.0\.')" ] \
      || fail "hash --params entries: $sel"
    [ "$(printf '%s\n' "$sel" | tail -1)" != "$last" ] || fail "hash --params root is the whole checkpoint's"
    damage_first_chunk "$work/c" layers.1.weight exp_avg
    expect_error 2 "checksum mismatch .* 'layers.1.weight.exp_avg'" -- "$OPTSTATE" hash "$work/c"
    [ "$("$OPTSTATE" hash "$work/c" --params 'layers.0.*')" = "$sel" ] || fail "hash --params read another param"
    "$OPTSTATE" hash --json "$work/c" --params '*.bias' | "$PY" -c '
import json, sys
j = json.load(sys.stdin)
assert sorted(j["entries"]) == sorted(f"{p}.bias.{e}" for p in ("head", "layers.0", "layers.1")
                                      for e in ("exp_avg", "exp_avg_sq", "param")), sorted(j["entries"])
assert j["selected"] == {"pattern": "*.bias", "params": 3}, j["selected"]
' || fail "hash --json --params"
    expect_error 2 "no param matches 'layers.9.\*' \(of 6 params\)" -- "$OPTSTATE" hash "$work/c" --params 'layers.9.*'
    expect_error 2 "--params needs a pattern" -- "$OPTSTATE" hash "$work/c" --params=
    ;;
  inspect-output)
    make_ckpt "$work/c"
    out=$("$OPTSTATE" inspect "$work/c") || fail "inspect failed"
    printf '%s\n' "$out" | matches "optimizer   adamw, 2 param group(s), 6 params" || fail "header: $out"
    printf '%s\n' "$out" | matches "8.00 bytes/param" || fail "bytes/param"
    "$OPTSTATE" inspect --json "$work/c" | "$PY" -c '
import json, sys
j = json.load(sys.stdin)
assert j["optimizer"] == "adamw", j
assert j["ranks"] == 1, j["ranks"]
assert j["params"]["layers.0.weight"]["shape"] == [128, 32]
assert j["params"]["layers.0.weight"]["step"] == 3
assert j["params"]["layers.0.weight"]["entries"]["exp_avg_sq"]["stats"]["min"] >= 0
assert j["param_groups"][0]["weight_decay"] == 0.1
' || fail "inspect --json content"
    # --params: only the matching params are shown and read (a damaged chunk of another param goes
    # unread: the whole inspect fails on it, this one does not); the totals stay the checkpoint's
    out=$("$OPTSTATE" inspect "$work/c" --params 'layers.0.*') || fail "inspect --params failed"
    printf '%s\n' "$out" | matches -x "shown       2 of 6 params, those matching 'layers.0.\*'" || fail "shown line: $out"
    printf '%s\n' "$out" | matches "^layers.0.weight " || fail "layers.0.weight not shown: $out"
    printf '%s\n' "$out" | matches "^layers.1" && fail "layers.1 shown: $out"
    damage_first_chunk "$work/c" layers.1.weight exp_avg
    expect_error 2 "checksum mismatch .* 'layers.1.weight.exp_avg'" -- "$OPTSTATE" inspect "$work/c"
    "$OPTSTATE" inspect "$work/c" --params 'layers.0.*' >/dev/null || fail "inspect --params read a param it does not show"
    "$OPTSTATE" inspect --json --no-stats "$work/c" --params '*.bias' | "$PY" -c '
import json, sys
j = json.load(sys.stdin)
assert sorted(j["params"]) == ["head.bias", "layers.0.bias", "layers.1.bias"], sorted(j["params"])
assert j["selected"] == {"pattern": "*.bias", "params": 3}, j["selected"]
assert j["totals"]["params"] == 6, j["totals"]
' || fail "inspect --json --params"
    expect_error 2 "no param matches 'layers.9.\*' \(of 6 params\)" -- "$OPTSTATE" inspect "$work/c" --params 'layers.9.*'
    ;;
  missing-path)
    expect_error 2 "$work/nope: no such file" -- "$OPTSTATE" inspect "$work/nope"
    expect_error 2 "$work/nope: no such file" -- "$OPTSTATE" hash "$work/nope"
    ;;
  not-a-checkpoint)
    mkdir "$work/empty"; echo hi > "$work/file.txt"
    expect_error 2 "$work/empty: not a checkpoint" -- "$OPTSTATE" inspect "$work/empty"
    expect_error 2 "$work/empty: not a checkpoint" -- "$OPTSTATE" hash "$work/empty"
    expect_error 2 "$work/file.txt: not a checkpoint" -- "$OPTSTATE" hash "$work/file.txt"
    ;;
  truncated-data)
    make_ckpt "$work/c"
    f="$work/c/data/rank-00000.bin"
    truncate -s -100 "$f"
    expect_error 2 "$f: file has .* bytes, manifest says" -- "$OPTSTATE" inspect "$work/c"
    expect_error 2 "$f: file has .* bytes, manifest says" -- "$OPTSTATE" hash "$work/c"
    ;;
  newer-manifest)
    make_ckpt "$work/c"
    resign "$work/c/manifest.json" 'j["version"] = 2'
    expect_error 2 "manifest.json: manifest version 2 is newer" -- "$OPTSTATE" inspect "$work/c"
    expect_error 2 "manifest.json: manifest version 2 is newer" -- "$OPTSTATE" hash "$work/c"
    ;;
  wrong-chunk-checksum)
    make_ckpt "$work/c"
    resign "$work/c/manifest.json" \
      'j["params"]["head.bias"]["entries"]["exp_avg"]["components"]["values"][0]["xxh3"] = "00000000deadbeef"'
    expect_error 2 "rank-00000.bin: checksum mismatch .*head.bias.exp_avg" -- "$OPTSTATE" hash "$work/c"
    expect_error 2 "rank-00000.bin: checksum mismatch .*head.bias.exp_avg" -- "$OPTSTATE" inspect "$work/c"
    ;;
  tampered-manifest)
    make_ckpt "$work/c"
    sed -i 's/"step": 3/"step": 4/' "$work/c/manifest.json"
    expect_error 2 "manifest.json: manifest checksum mismatch" -- "$OPTSTATE" hash "$work/c"
    ;;
  flipped-data-bit)
    make_ckpt "$work/c"
    "$PY" - "$work/c/data/rank-00000.bin" <<'PY'
import sys
p = sys.argv[1]; b = bytearray(open(p, "rb").read()); b[len(b) // 2] ^= 0x04; open(p, "wb").write(b)
PY
    expect_error 2 "checksum mismatch" -- "$OPTSTATE" hash "$work/c"
    ;;
  escaping-path)
    make_ckpt "$work/c"
    resign "$work/c/manifest.json" 'j["files"][0]["path"] = "../../../etc/passwd"'
    expect_error 2 "manifest.json: .*leaves the checkpoint directory" -- "$OPTSTATE" hash "$work/c"
    ;;
  garbage-manifest)
    make_ckpt "$work/c"
    head -c 100 /dev/urandom > "$work/c/manifest.json"
    expect_error 2 "manifest.json: not a valid JSON manifest" -- "$OPTSTATE" inspect "$work/c"
    ;;
  resume-bitwise)
    "$OPTSTATE_DEMO" --steps 40 --final "$work/a" >/dev/null || fail "uninterrupted run"
    "$OPTSTATE_DEMO" --steps 20 --save "$work/c20" >/dev/null || fail "first half"
    "$OPTSTATE_DEMO" --steps 40 --resume "$work/c20" --final "$work/b" | matches "every entry.s hash verified" || fail "resume"
    a=$("$OPTSTATE" hash "$work/a") b=$("$OPTSTATE" hash "$work/b")
    [ "$a" = "$b" ] || fail "resumed run differs: $(diff <(echo "$a") <(echo "$b"))"
    cmp -s "$work/a/data/rank-00000.bin" "$work/b/data/rank-00000.bin" || fail "data files differ"
    "$OPTSTATE_DEMO" --optimizer adamw8bit --steps 40 --final "$work/a8" >/dev/null
    "$OPTSTATE_DEMO" --optimizer adamw8bit --steps 20 --save "$work/c8" >/dev/null
    "$OPTSTATE_DEMO" --optimizer adamw8bit --steps 40 --resume "$work/c8" --final "$work/b8" >/dev/null || fail "8-bit resume"
    [ "$("$OPTSTATE" hash "$work/a8")" = "$("$OPTSTATE" hash "$work/b8")" ] || fail "8-bit resumed run differs"
    "$OPTSTATE_DEMO" --bf16 --steps 40 --final "$work/a16" >/dev/null
    "$OPTSTATE_DEMO" --bf16 --steps 20 --save "$work/c16" >/dev/null
    "$OPTSTATE_DEMO" --bf16 --steps 40 --resume "$work/c16" --final "$work/b16" >/dev/null || fail "bf16 resume"
    [ "$("$OPTSTATE" hash "$work/a16")" = "$("$OPTSTATE" hash "$work/b16")" ] || fail "bf16 resumed run differs"
    [ "$a" != "$("$OPTSTATE" hash "$work/a16")" ] || fail "bf16 and fp32 runs hash equal"
    echo "ok: resumed runs are bitwise identical (FusedAdamW fp32 and bf16 params, AdamW8bit)"
    ;;
  convert-roundtrip)
    "$OPTSTATE_DEMO" --optimizer adamw8bit --steps 5 --save "$work/c8" >/dev/null || fail "8-bit demo"
    before=$(cd "$work/c8" && find . -type f -exec sha256sum {} + | sort)
    "$OPTSTATE" convert "$work/c8" "$work/f32" --to fp32 | matches "0 8-bit entries" || fail "to fp32"
    "$OPTSTATE" convert "$work/f32" "$work/back" --to 8bit >/dev/null || fail "to 8bit"
    [ "$(cd "$work/c8" && find . -type f -exec sha256sum {} + | sort)" = "$before" ] || fail "input changed"
    [ "$("$OPTSTATE" hash "$work/c8")" = "$("$OPTSTATE" hash "$work/back")" ] || fail "8bit->fp32->8bit differs"
    [ "$("$OPTSTATE" hash --values "$work/c8")" = "$("$OPTSTATE" hash --values "$work/f32")" ] \
      || fail "--values hash differs between 8-bit and its fp32 conversion"
    [ "$("$OPTSTATE" hash "$work/c8")" != "$("$OPTSTATE" hash "$work/f32")" ] || fail "raw hashes should differ"
    "$OPTSTATE" inspect --json "$work/c8" | "$PY" -c '
import json, sys
j = json.load(sys.stdin)
w = j["params"]["layers.1.weight"]
assert w["entries"]["exp_avg"]["encoding"] == "blockwise8" and w["entries"]["exp_avg"]["block_size"] == 256
assert w["state_bytes_per_param"] <= 2.04, w["state_bytes_per_param"]
assert j["params"]["head.bias"]["entries"]["exp_avg"]["encoding"] == "dense"
' || fail "inspect of 8-bit state"
    # DST's extension picks torch.save (torch.optim.AdamW's state_dict: 8-bit moments dequantized)
    "$OPTSTATE" convert "$work/c8" "$work/optimizer.pt" | matches "(torchsave, 1 rank)" || fail "to .pt"
    [ "$("$OPTSTATE" hash --values "$work/c8")" = "$("$OPTSTATE" hash --values "$work/optimizer.pt")" ] \
      || fail "--values hash differs between 8-bit and its torch.save conversion"
    "$OPTSTATE" convert "$work/optimizer.pt" "$work/back8" --to 8bit >/dev/null || fail ".pt to 8bit"
    [ "$("$OPTSTATE" hash "$work/c8")" = "$("$OPTSTATE" hash "$work/back8")" ] || fail "8bit->.pt->8bit differs"
    expect_error 2 "--to 8bit: torchsave stores moments dense" -- \
      "$OPTSTATE" convert "$work/c8" "$work/o8.pt" --to 8bit
    # a DCP with --to 8bit holds torchao's OptimState8bit items: the same codes and scales (lr now a
    # float32 tensor, as torchao keeps it: equal within 1e-7)
    "$OPTSTATE" convert "$work/c8" "$work/d8" --format dcp --to 8bit --world-size 2 | matches " 4 8-bit entries" \
      || fail "to dcp --to 8bit"
    "$OPTSTATE" diff "$work/c8" "$work/d8" --rtol 1e-7 >/dev/null || fail "8bit -> dcp (torchao's items) differs"
    "$OPTSTATE" convert "$work/d8" "$work/d8back" >/dev/null || fail "dcp (torchao's items) -> native"
    [ "$("$OPTSTATE" hash "$work/d8")" = "$("$OPTSTATE" hash "$work/d8back")" ] || fail "dcp 8-bit -> native differs"
    echo "ok: 8bit -> fp32 -> 8bit, 8bit -> .pt -> 8bit and 8bit -> dcp -> 8bit reproduce the checkpoint; --values hashes agree"
    ;;
  convert-errors)
    make_ckpt "$work/c"
    expect_error 2 "--to must be fp32 or 8bit" -- "$OPTSTATE" convert "$work/c" "$work/x" --to int4
    expect_error 2 "destination is the source" -- "$OPTSTATE" convert "$work/c" "$work/c"
    # an unset variable's "" is no path (it resolved to the working directory, then failed obscurely)
    expect_error 2 "an empty argument where a path goes" -- "$OPTSTATE" convert "$work/c" ""
    expect_error 2 "an empty argument where a path goes" -- "$OPTSTATE" inspect ""
    mkdir "$work/exists"
    expect_error 2 "$work/exists: already exists" -- "$OPTSTATE" convert "$work/c" "$work/exists"
    expect_error 2 "unknown output format 'zip'" -- "$OPTSTATE" convert "$work/c" "$work/y" --format zip
    expect_error 2 "--float-lr writes torch.optim.AdamW's state" -- \
      "$OPTSTATE" convert "$work/c" "$work/y" --format dcp --to 8bit --float-lr
    # --torchao-package names one of torchao's two packages, for the formats that write its classes
    expect_error 2 "--torchao-package is for --format torchao and dcp" -- \
      "$OPTSTATE" convert "$work/c" "$work/y.safetensors" --torchao-package torchao.optim
    expect_error 2 "'torchao.prototype' defines no torchao optimizer state" -- \
      "$OPTSTATE" reshard "$work/c" "$work/y" --world-size 2 --format dcp --torchao-package torchao.prototype
    expect_error 2 "--bitsandbytes-layout is for --format bitsandbytes" -- \
      "$OPTSTATE" convert "$work/c" "$work/y.pt" --bitsandbytes-layout flat
    expect_error 2 "--bitsandbytes-layout must be nested or flat, got 'old'" -- \
      "$OPTSTATE" convert "$work/c" "$work/y.pt" --format bitsandbytes --bitsandbytes-layout old
    # one-file formats take no world size (they would say "2 ranks" and write one file)
    expect_error 2 "--world-size 2: safetensors is one file" -- "$OPTSTATE" convert "$work/c" "$work/y.safetensors" --world-size 2
    expect_error 2 "--world-size 3: a torch.save file is one state" -- "$OPTSTATE" reshard "$work/c" "$work/y.pt" --world-size 3
    expect_error 2 "--block-size is for --to 8bit" -- "$OPTSTATE" convert "$work/c" "$work/y.safetensors" --block-size 64
    expect_error 2 "--compress: safetensors stores tensors uncompressed" -- "$OPTSTATE" convert "$work/c" "$work/y.safetensors" --compress 4
    [ ! -e "$work/y.safetensors" ] && [ ! -e "$work/y.pt" ] || fail "a refused convert wrote something"
    [ ! -e "$work/y" ] || fail "a refused convert wrote output"
    # --overwrite replaces checkpoints (any format) and empty directories, never other files, and
    # never a directory holding the source.
    mkdir -p "$work/home/ckpt" && echo keep > "$work/home/notes.txt" && cp -r "$work/c/." "$work/home/ckpt"
    expect_error 2 "$work/home: destination contains the source" -- \
      "$OPTSTATE" convert "$work/home/ckpt" "$work/home" --overwrite
    rm -r "$work/home/ckpt"
    expect_error 2 "$work/home: exists and is not a checkpoint \(a directory holding other files\)" -- \
      "$OPTSTATE" convert "$work/c" "$work/home" --overwrite
    expect_error 2 "notes.txt: exists and is not a checkpoint \(not in any known format\)" -- \
      "$OPTSTATE" convert "$work/c" "$work/home/notes.txt" --format safetensors --overwrite
    [ "$(cat "$work/home/notes.txt")" = keep ] || fail "--overwrite touched a file that is no checkpoint"
    echo '{"name": "web"}' > "$work/home/manifest.json"  # sniffs as native, is none
    expect_error 2 "$work/home: exists and is not a checkpoint \(looks like native but does not open: .*manifest.json" \
      -- "$OPTSTATE" convert "$work/c" "$work/home" --overwrite
    [ -e "$work/home/notes.txt" ] || fail "--overwrite deleted a directory with a manifest.json"
    "$OPTSTATE" convert "$work/c" "$work/exists" --overwrite >/dev/null || fail "--overwrite of an empty directory"
    "$OPTSTATE" convert "$work/c" "$work/s.safetensors" >/dev/null || fail "convert to safetensors"
    "$OPTSTATE" convert "$work/c" "$work/s.safetensors" --format native --overwrite >/dev/null \
      || fail "--overwrite of a safetensors checkpoint"
    [ "$("$OPTSTATE" hash "$work/s.safetensors")" = "$("$OPTSTATE" hash "$work/c")" ] || fail "replaced checkpoint"
    truncate -s -5 "$work/c/data/rank-00000.bin"
    expect_error 2 "rank-00000.bin" -- "$OPTSTATE" convert "$work/c" "$work/z" --to 8bit
    [ ! -e "$work/z" ] || fail "a failed convert left output"
    [ -z "$(ls -A "$work" | grep partial)" ] || fail "a staging directory was left behind"
    ;;
  validate)
    make_ckpt "$work/good"
    "$OPTSTATE_DEMO" --optimizer adamw8bit --steps 3 --save "$work/good8" >/dev/null
    for c in good good8; do
      out=$("$OPTSTATE" validate "$work/$c") || fail "false alarm on a good checkpoint: $out"
      printf '%s' "$out" | matches "^ok: .*every chunk checksum verified" || fail "no ok line with checksums: $out"
    done
    # DCP: the CRC-32 of every torch.save record (ours are filled in as torch's are)
    "$OPTSTATE" convert "$work/good8" "$work/good.dcp" --format dcp >/dev/null || fail "convert to dcp"
    out=$("$OPTSTATE" validate "$work/good.dcp") || fail "false alarm on dcp: $out"
    printf '%s' "$out" | matches "^ok: .*every chunk checksum verified" || fail "dcp checksums not verified: $out"
    # a format without checksums is not said to have had them verified
    "$OPTSTATE" convert "$work/good" "$work/good.safetensors" >/dev/null || fail "convert to safetensors"
    out=$("$OPTSTATE" validate "$work/good.safetensors") || fail "false alarm on safetensors: $out"
    printf '%s' "$out" | matches "no checksums in this format" || fail "safetensors claimed checksums: $out"
    "$OPTSTATE" validate --json "$work/good.safetensors" | "$PY" -c \
      'import json,sys; j=json.load(sys.stdin); assert j["ok"] and j["checksums_verified"] is False'
    # expect_finding DIR PATTERN: validate exits 1 and one finding matches
    expect_finding() {
      local out rc
      out=$("$OPTSTATE" validate "$1" 2>&1); rc=$?
      [ "$rc" -eq 1 ] || fail "validate $1 exited $rc (want 1): $out"
      printf '%s\n' "$out" | matches -E -- "$2" || fail "no finding matching '$2' in: $out"
      echo "ok: finding: $(printf '%s\n' "$out" | grep -E -- "$2" | head -1)"
    }
    fresh() { rm -rf "$work/c"; cp -r "$work/$1" "$work/c"; }
    fresh good; rm "$work/c/data/rank-00000.bin"
    expect_finding "$work/c" "rank-00000.bin: data file missing"
    # a FIFO where a data file should be: refused, not waited on (opening it would block for a writer)
    fresh good; rm "$work/c/data/rank-00000.bin"; mkfifo "$work/c/data/rank-00000.bin"
    expect_finding "$work/c" "rank-00000.bin: data file is not a regular file"
    rm -rf "$work/c"; cp -r "$work/good.dcp" "$work/c"; rm "$work/c/__0_0.distcp"; mkfifo "$work/c/__0_0.distcp"
    expect_finding "$work/c" "data file .*__0_0.distcp: not a regular file"
    expect_error 2 "__0_0.distcp: not a regular file" -- "$OPTSTATE" hash "$work/c"
    fresh good; truncate -s -64 "$work/c/data/rank-00000.bin"
    expect_finding "$work/c" "rank-00000.bin: file has .* bytes, manifest says"
    fresh good
    "$PY" - "$work/c/data/rank-00000.bin" <<'PY'
import sys
p = sys.argv[1]; b = bytearray(open(p, "rb").read()); b[1000] ^= 0x01; open(p, "wb").write(b)
PY
    expect_finding "$work/c" "checksum mismatch in bytes \[[0-9]+, [0-9]+\) holding entry '.*' values \[0, [0-9]+\)"
    fresh good; sed -i 's/"step": 3/"step": 4/' "$work/c/manifest.json"
    expect_finding "$work/c" "manifest.json: manifest checksum mismatch"
    fresh good
    resign "$work/c/manifest.json" 'j["params"]["head.bias"]["entries"]["exp_avg"]["components"]["values"][0]["end"] = 4'
    expect_finding "$work/c" "head.bias.exp_avg' values: elements \[4, 8\) are not covered"
    fresh good
    resign "$work/c/manifest.json" '
v = j["params"]["head.bias"]["entries"]["exp_avg"]["components"]["values"]
v.append(dict(v[0]))'
    expect_finding "$work/c" "are covered twice"
    # NaN in a state and a negative exp_avg_sq, written where the manifest says they are (re-signed
    # chunk checksums), so only the sanity checks can catch them
    for what in nan negative; do
      fresh good
      "$PY" - "$work/c" "$what" <<'PY'
import json, struct, sys, xxhash
ckpt, what = sys.argv[1], sys.argv[2]
m = json.load(open(f"{ckpt}/manifest.json"))
entry = "exp_avg" if what == "nan" else "exp_avg_sq"
ch = m["params"]["layers.1.weight"]["entries"][entry]["components"]["values"][0]
path = f"{ckpt}/{m['files'][ch['file']]['path']}"
data = bytearray(open(path, "rb").read())
data[ch["offset"] + 40:ch["offset"] + 44] = struct.pack("<f", float("nan") if what == "nan" else -1.0)
open(path, "wb").write(data)
n = (ch["end"] - ch["begin"]) * 4
ch["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(data[ch["offset"]:ch["offset"] + n]))
json.dump(m, open(f"{ckpt}/manifest.json", "w"))
PY
      resign "$work/c/manifest.json" 'pass'
      if [ $what = nan ]; then
        expect_finding "$work/c" "layers.1.weight.exp_avg' has 1 non-finite values \(first at element 10\)"
      else
        expect_finding "$work/c" "rank-00000.bin at byte [0-9]+: entry 'layers.1.weight.exp_avg_sq' has 1 negative values"
      fi
    done
    fresh good8
    "$PY" - "$work/c" <<'PY'
import json, struct, sys, xxhash
ckpt = sys.argv[1]
m = json.load(open(f"{ckpt}/manifest.json"))
ch = m["params"]["layers.1.weight"]["entries"]["exp_avg"]["components"]["absmax"][0]
path = f"{ckpt}/{m['files'][ch['file']]['path']}"
data = bytearray(open(path, "rb").read())
data[ch["offset"]:ch["offset"] + 4] = struct.pack("<f", -0.5)
open(path, "wb").write(data)
ch["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(data[ch["offset"]:ch["offset"] + (ch["end"] - ch["begin"]) * 4]))
json.dump(m, open(f"{ckpt}/manifest.json", "w"))
PY
    resign "$work/c/manifest.json" 'pass'
    expect_finding "$work/c" "rank-00000.bin at byte [0-9]+: entry 'layers.1.weight.exp_avg' has 1 blocks whose absmax is not a finite number >= 0"
    "$OPTSTATE" validate --json "$work/c" | "$PY" -c 'import json,sys; j=json.load(sys.stdin); assert not j["ok"] and j["findings"]'
    expect_error 2 "no such file" -- "$OPTSTATE" validate "$work/none"
    ;;
  diff)
    make_ckpt "$work/a"
    cp -r "$work/a" "$work/b"
    "$OPTSTATE" diff "$work/a" "$work/b" | matches "equal within tolerance" || fail "identical checkpoints differ"
    "$OPTSTATE_DEMO" --steps 4 --save "$work/c" >/dev/null
    out=$("$OPTSTATE" diff "$work/a" "$work/c"); rc=$?
    [ $rc -eq 1 ] || fail "diff of different steps exited $rc"
    printf '%s\n' "$out" | matches "step: 3 vs 4" || fail "step difference not reported: $out"
    # 8-bit vs its fp32 conversion: exactly equal values
    "$OPTSTATE_DEMO" --optimizer adamw8bit --steps 3 --save "$work/q" >/dev/null
    "$OPTSTATE" convert "$work/q" "$work/qf" --to fp32 >/dev/null
    "$OPTSTATE" diff "$work/q" "$work/qf" >/dev/null || fail "8-bit and its fp32 conversion differ"
    # fp32 vs its 8-bit quantization: values within a tolerance, not exactly; the quantized state is
    # AdamW8bit's, and diff says so
    "$OPTSTATE" convert "$work/a" "$work/a8" --to 8bit >/dev/null
    "$OPTSTATE" diff "$work/a" "$work/a8" >/dev/null && fail "quantized state reported exactly equal"
    out=$("$OPTSTATE" diff --json --rtol 0.1 --atol 1e-6 "$work/a8" "$work/a"); rc=$?
    [ $rc -eq 1 ] || fail "diff of a state and its quantization (kinds differ) exited $rc"
    printf '%s\n' "$out" | "$PY" -c '
import json, sys
j = json.load(sys.stdin)
assert all(e["ok"] for e in j["entries"].values()), [k for k, e in j["entries"].items() if not e["ok"]]
assert j["metadata"] == ["optimizer kind: adamw8bit vs adamw"], j["metadata"]
assert j["entries"]["layers.1.weight.exp_avg"]["max_abs"] > 0
'  || fail "quantization error outside 10%"
    expect_error 2 "--rtol needs a non-negative number" -- "$OPTSTATE" diff "$work/a" "$work/b" --rtol x
    # a LibTorch archive of it numbers the params and holds no weights: by name nothing matches;
    # by position, moments only, it equals its source; a step changed in it is found at its param
    "$OPTSTATE" convert "$work/a" "$work/a.pt" --format libtorch 2>/dev/null >/dev/null || fail "convert to libtorch"
    "$OPTSTATE" diff "$work/a" "$work/a.pt" >/dev/null && fail "named and numbered params matched by name"
    "$OPTSTATE" diff "$work/a" "$work/a.pt" --by-position --no-weights | matches "equal within tolerance" \
      || fail "the archive differs from its source by position"
    "$OPTSTATE" convert "$work/c" "$work/c.pt" --format libtorch 2>/dev/null >/dev/null || fail "convert c"
    out=$("$OPTSTATE" diff "$work/a" "$work/c.pt" --by-position --no-weights); rc=$?
    [ $rc -eq 1 ] || fail "by-position diff of different steps exited $rc"
    printf '%s\n' "$out" | matches "param 'layers.0.weight=0' step: 3 vs 4" || fail "step difference by position: $out"
    # --params: only the matching params are compared (on either side)
    out=$("$OPTSTATE" diff "$work/a" "$work/c" --params 'head.*'); rc=$?
    [ $rc -eq 1 ] || fail "diff --params of different steps exited $rc"
    printf '%s\n' "$out" | matches "param 'head.weight' step: 3 vs 4" || fail "head.weight not compared: $out"
    printf '%s\n' "$out" | matches "layers" && fail "diff --params compared layers: $out"
    "$OPTSTATE" diff "$work/q" "$work/qf" --params 'layers.0.*' | matches "equal within tolerance" \
      || fail "layers.0 of an 8-bit state differs from its fp32 conversion"
    expect_error 2 "no param of A .* or B .* matches 'nothing\*'" -- "$OPTSTATE" diff "$work/a" "$work/b" --params 'nothing*'
    ;;
  progress)
    # Progress goes to stderr, only when asked (OPTSTATE_PROGRESS=1) or stderr is a terminal (not here);
    # stdout is the same either way.
    make_ckpt "$work/a"
    for c in hash validate inspect; do
      "$OPTSTATE" "$c" "$work/a" >"$work/quiet.out" 2>"$work/quiet.err" || fail "$c"
      [ ! -s "$work/quiet.err" ] || fail "$c wrote to stderr without a terminal: $(cat "$work/quiet.err")"
      OPTSTATE_PROGRESS=1 "$OPTSTATE" "$c" "$work/a" >"$work/shown.out" 2>"$work/shown.err" || fail "$c with progress"
      cmp -s "$work/quiet.out" "$work/shown.out" || fail "$c: progress changed stdout"
      grep -Eq "^$c: read [0-9.]+ KiB of [0-9.]+ KiB \(100%\)" "$work/shown.err" || fail "$c: no progress: $(cat "$work/shown.err")"
    done
    OPTSTATE_PROGRESS=1 "$OPTSTATE" convert "$work/a" "$work/b" 2>"$work/shown.err" >/dev/null || fail "convert"
    # Writing streams SRC entry by entry: the write phase counts the bytes read.
    grep -Eq "^convert: writing $work/b: read [0-9.]+ KiB of [0-9.]+ KiB \(100%\)" "$work/shown.err" \
      || fail "convert: no write phase: $(cat "$work/shown.err")"
    OPTSTATE_PROGRESS=0 "$OPTSTATE" hash "$work/a" 2>"$work/quiet.err" >/dev/null && [ ! -s "$work/quiet.err" ] \
      || fail "OPTSTATE_PROGRESS=0 still shows progress"
    ;;
  reshard)
    "$OPTSTATE_DEMO" --steps 3 --save "$work/w1" >/dev/null
    "$OPTSTATE_DEMO" --optimizer adamw8bit --steps 3 --save "$work/q1" >/dev/null
    for src in w1 q1; do
      want=$("$OPTSTATE" hash "$work/$src")
      for n in 2 3 4; do
        "$OPTSTATE" reshard "$work/$src" "$work/$src-$n" --world-size $n >/dev/null || fail "reshard $src to $n"
        [ "$(ls "$work/$src-$n/data" | wc -l)" -eq $n ] || fail "$n ranks should give $n data files"
        "$OPTSTATE" validate "$work/$src-$n" >/dev/null || fail "resharded $src-$n does not validate"
        [ "$("$OPTSTATE" hash "$work/$src-$n")" = "$want" ] || fail "hash of $src changed with world size $n"
        for m in 1 3; do  # N -> M
          "$OPTSTATE" reshard "$work/$src-$n" "$work/$src-$n-$m" --world-size $m >/dev/null || fail "reshard $n->$m"
          [ "$("$OPTSTATE" hash "$work/$src-$n-$m")" = "$want" ] || fail "hash changed $n->$m"
        done
      done
    done
    # dense shards are torch.chunk row ranges: layers.0.weight is 128 x 32, 3 ranks -> 43, 43, 42 rows
    "$PY" - "$work/w1-3/manifest.json" <<'PY' || fail "row ranges differ from torch.chunk"
import json, sys, torch
m = json.load(open(sys.argv[1]))
chunks = m["params"]["layers.0.weight"]["entries"]["exp_avg"]["components"]["values"]
rows = [c.size(0) for c in torch.chunk(torch.empty(128, 32), 3, dim=0)]
assert [(c["end"] - c["begin"]) // 32 for c in sorted(chunks, key=lambda c: c["begin"])] == rows, chunks
PY
    expect_error 2 "--world-size is required" -- "$OPTSTATE" reshard "$work/w1" "$work/x"
    expect_error 2 "--world-size must be between 1 and 65536" -- "$OPTSTATE" reshard "$work/w1" "$work/x" --world-size 0
    ;;
  interrupted-write)
    # SIGINT or SIGTERM while convert/reshard writes: the write stops, DST is not written (an existing
    # one is kept as it was), no partial output is left, and the command dies of the signal. The
    # signal is sent while the command is stopped (SIGSTOP), once its staging output exists, so it
    # lands before the publish whatever the machine's speed.
    "$PY" - "$OPTSTATE" "$work" "$(cd "$(dirname "$0")/../.." && pwd)/python" <<'PY' || fail "see above"
import os, signal, subprocess, sys, time
optstate_bin, work, pydir = sys.argv[1:4]
sys.path.insert(0, pydir)
import torch
import optstate
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # ~100 MB of state
opt = optstate.FusedAdamW(model.parameters())
for p in model.parameters():
    p.grad = torch.randn_like(p)
opt.step()
src = os.path.join(work, "src")
optstate.save(src, model, opt)

def listing():
    return sorted(n for n in os.listdir(work) if n != "src")

def interrupted(args, dst, sig):
    before = listing()
    proc = subprocess.Popen([optstate_bin] + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    prefix = "." + os.path.basename(dst) + ".partial-"
    deadline = time.monotonic() + 60
    while not any(n.startswith(prefix) for n in os.listdir(work)):
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"FAIL: {args}: no staging output seen (exit {proc.poll()})")
        time.sleep(0.0005)
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)
    err = proc.communicate(timeout=120)[1].decode()
    name = signal.Signals(sig).name
    if proc.returncode != -sig:
        sys.exit(f"FAIL: {args}: exit {proc.returncode}, want death by {name}: {err}")
    want = f"optstate {args[0]}: interrupted by {name}: {dst} was not written, and its partial output was removed"
    if err.strip() != want:
        sys.exit(f"FAIL: {args}: stderr {err!r}, want {want!r}")
    if listing() != before:
        sys.exit(f"FAIL: {args}: left {sorted(set(listing()) - set(before))}")
    print(f"ok: {' '.join(args)} stopped by {name}, nothing left")

def hash_of(path):
    return subprocess.run([optstate_bin, "hash", path], check=True, capture_output=True).stdout

for fmt, sig in [("native", signal.SIGINT), ("hdf5", signal.SIGTERM), ("safetensors", signal.SIGINT),
                 ("dcp", signal.SIGTERM)]:
    dst = os.path.join(work, "out." + fmt)
    interrupted(["convert", src, dst, "--format", fmt], dst, sig)
    if os.path.exists(dst):
        sys.exit(f"FAIL: {dst} exists")
# --overwrite: the checkpoint already at DST stays, whole
old = os.path.join(work, "old")
subprocess.run([optstate_bin, "convert", src, old, "--to", "8bit"], check=True, stdout=subprocess.DEVNULL)
want = hash_of(old)
interrupted(["convert", src, old, "--overwrite"], old, signal.SIGINT)
if hash_of(old) != want or subprocess.run([optstate_bin, "validate", old], capture_output=True).returncode != 0:
    sys.exit("FAIL: the checkpoint at DST changed")
interrupted(["reshard", src, os.path.join(work, "r3"), "--world-size", "3"], os.path.join(work, "r3"), signal.SIGINT)
PY
    # What a killed write leaves (SIGKILL cannot be caught) is pointed out, never removed.
    make_ckpt "$work/a"
    mkdir "$work/.b.partial-999999999-0badf00d" && head -c 2048 /dev/zero > "$work/.b.partial-999999999-0badf00d/x"
    "$OPTSTATE" convert "$work/a" "$work/b" 2>"$work/err" >/dev/null || fail "convert beside a leftover"
    grep -qx "note: $work/.b.partial-999999999-0badf00d is left from an interrupted write of $work/b (2.0 KiB, its process is gone); remove it unless a writer on another machine still owns it" "$work/err" \
      || fail "no note of the leftover: $(cat "$work/err")"
    [ -d "$work/.b.partial-999999999-0badf00d" ] || fail "the leftover was removed"
    ;;
  convert-memory)
    # convert and reshard stream: SRC is read entry by entry as DST is written, so their peak memory
    # is bounded by the largest entry, not the checkpoint (one larger than RAM converts). Peak RSS of
    # each command (wait4's ru_maxrss, from a parent without torch: a forked child starts with its
    # parent's peak) against a conversion of the tiny demo checkpoint.
    "$PY" - "$work" "$(cd "$(dirname "$0")/../.." && pwd)/python" <<'PY' || fail "could not make the checkpoint"
import sys
work, pydir = sys.argv[1:3]
sys.path.insert(0, pydir)
import torch
import optstate
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)])
opt = optstate.FusedAdamW(model.parameters())
for p in model.parameters():
    p.grad = torch.randn_like(p)
opt.step()
optstate.save(work + "/src", model, opt)  # 16 params x (weights, exp_avg, exp_avg_sq) x 4 MiB: 192 MiB
PY
    make_ckpt "$work/tiny"
    "$PY" - "$OPTSTATE" "$work" <<'PY' || fail "see above"
import os, shutil, subprocess, sys
optstate_bin, work = sys.argv[1:3]
MiB = 1 << 20

def peak(args):
    p = subprocess.Popen([optstate_bin] + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    err = p.stderr.read().decode()
    if status != 0:
        sys.exit(f"FAIL: {args}: exit status {status}: {err}")
    return usage.ru_maxrss * 1024

def clear(*names):
    for n in names:
        path = os.path.join(work, n)
        shutil.rmtree(path) if os.path.isdir(path) else os.path.exists(path) and os.remove(path)

src, size = os.path.join(work, "src"), 0
for root, _, files in os.walk(src):
    size += sum(os.path.getsize(os.path.join(root, f)) for f in files)
assert size > 190 * MiB, size
base = max(peak(["convert", os.path.join(work, "tiny"), os.path.join(work, "tiny." + f), "--format", f])
           for f in ("native", "hdf5"))
clear("tiny.native", "tiny.hdf5")
# Largest entry 4 MiB: a write holds one entry (plus its recoded form and the writer's pieces).
allowed = base + 40 * MiB
runs = [["convert", "src", "out.native"], ["convert", "src", "out.safetensors"], ["convert", "src", "out.h5"],
        ["convert", "src", "out.dcp", "--format", "dcp"], ["convert", "src", "q8", "--to", "8bit"],
        ["convert", "out.safetensors", "from-st"], ["convert", "out.h5", "from-h5"], ["convert", "out.dcp", "from-dcp"],
        ["convert", "q8", "q8-dense.dcp", "--format", "dcp"], ["convert", "q8", "q8-fp32", "--to", "fp32"],
        ["reshard", "src", "r3", "--world-size", "3"]]
for args in runs:
    argv = [args[0]] + [os.path.join(work, a) if i < 2 else a for i, a in enumerate(args[1:])]
    used = peak(argv)
    print(f"{' '.join(args)}: peak RSS {used / MiB:.1f} MiB (tiny checkpoint {base / MiB:.1f} MiB)")
    if used > allowed:
        sys.exit(f"FAIL: {' '.join(args)} peaked at {used / MiB:.1f} MiB; the largest entry is 4 MiB, "
                 f"SRC {size / MiB:.0f} MiB, a tiny conversion {base / MiB:.1f} MiB")
h = lambda p: subprocess.run([optstate_bin, "hash", os.path.join(work, p)], check=True, capture_output=True).stdout
want = h("src")
for p in ("out.native", "out.safetensors", "out.h5", "from-st", "from-h5", "from-dcp", "r3"):
    if h(p) != want:
        sys.exit(f"FAIL: {p} does not hash as src")
PY
    ;;
  many-ranks)
    # Hundreds of ranks' files under a low limit on open files: readers keep at most half the limit
    # open (reopening files as they go), native writes go in passes of ranks, and the CLI takes the
    # hard limit where only the soft one is low (a DCP write keeps every rank's file open).
    "$PY" - "$work" "$(cd "$(dirname "$0")/../.." && pwd)/python" <<'PY' || fail "could not make the checkpoint"
import sys
work, pydir = sys.argv[1:3]
sys.path.insert(0, pydir)
import torch
import optstate
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 1000, bias=False), torch.nn.Linear(1000, 1000, bias=False))
opt = optstate.FusedAdamW(model.parameters())
for p in model.parameters():
    p.grad = torch.randn_like(p)
opt.step()
optstate.save(work + "/src", model, opt)  # 1000 rows: every one of 500 ranks holds two
PY
    want=$("$OPTSTATE" hash "$work/src") || fail "hash src"
    (
      ulimit -Sn 64  # the soft limit only: the CLI raises it to the hard one
      "$OPTSTATE" reshard "$work/src" "$work/n500" --world-size 500 >/dev/null || fail "reshard to 500 ranks"
      "$OPTSTATE" convert "$work/n500" "$work/d500" --format dcp --world-size 500 >/dev/null || fail "dcp of 500 ranks"
    ) || exit 1
    [ "$(ls "$work/n500/data" | wc -l)" = 500 ] && [ "$(ls "$work/d500" | grep -c distcp)" = 500 ] \
      || fail "not 500 ranks' files"
    (
      ulimit -n 64  # soft and hard: 500 files cannot be open at once
      [ "$("$OPTSTATE" hash "$work/n500")" = "$want" ] || fail "native of 500 ranks hashes differently"
      "$OPTSTATE" validate "$work/n500" >/dev/null || fail "validate native of 500 ranks"
      "$OPTSTATE" validate "$work/d500" >/dev/null || fail "validate dcp of 500 ranks"
      "$OPTSTATE" convert "$work/d500" "$work/back" >/dev/null || fail "convert dcp of 500 ranks"
      [ "$("$OPTSTATE" hash "$work/back")" = "$want" ] || fail "dcp of 500 ranks converts to other values"
      "$OPTSTATE" reshard "$work/n500" "$work/n300" --world-size 300 >/dev/null || fail "reshard in passes"
      [ "$("$OPTSTATE" hash "$work/n300")" = "$want" ] || fail "300 ranks written in passes hash differently"
      expect_error 2 "^optstate convert: error: writing $work/d300: a DCP write keeps its 300 ranks' files open at once: .*Too many open files$" -- \
        "$OPTSTATE" convert "$work/n500" "$work/d300" --format dcp --world-size 300
      [ -z "$(ls -a "$work" | grep d300)" ] || fail "a refused DCP write left $(ls -a "$work" | grep d300)"
    ) || exit 1
    ;;
  fsdp-rank-files)
    # FSDP2's per-rank torch.save files (verl's layout, real files of a 2-rank run): the folder is
    # one state; one rank's file, a missing rank and an --overwrite of the folder are refused.
    set_dir="$(cd "$(dirname "$0")/../.." && pwd)/formats/torchsave/testdata/fsdp2_world2"
    cp -r "$set_dir" "$work/actor"
    "$OPTSTATE" validate "$work/actor" | matches "every chunk checksum verified" || fail "validate the folder"
    "$OPTSTATE" inspect "$work/actor" | matches "extra_state_world_size_2_rank_\*.pt (2 files)" \
      || fail "inspect does not name the extra_state files"
    "$OPTSTATE" convert "$work/actor" "$work/plain.pt" >/dev/null || fail "convert to one file"
    [ "$("$OPTSTATE" hash "$work/actor" | tail -1)" = "$("$OPTSTATE" hash "$work/plain.pt" | tail -1)" ] \
      || fail "the folder and its one-file conversion hash differently"
    expect_error 2 "optim_world_size_2_rank_1.pt.*pass the directory that holds every rank's file" -- \
      "$OPTSTATE" inspect "$work/actor/optim_world_size_2_rank_1.pt"
    expect_error 2 "actor: a torchsave checkpoint that a write never replaces" -- \
      "$OPTSTATE" convert "$work/plain.pt" "$work/actor" --overwrite
    [ -f "$work/actor/extra_state_world_size_2_rank_0.pt" ] || fail "the folder was touched"
    rm "$work/actor/optim_world_size_2_rank_1.pt"
    expect_error 2 "rank 1's file optim_world_size_2_rank_1.pt is missing" -- "$OPTSTATE" hash "$work/actor"
    ;;
  fsdp1-rank-files)
    # FSDP1's per-rank files (verl's FSDP strategy, real files of a 2-rank run with and without
    # use_orig_params): each folder is the state FSDP's own metadata places; a model file missing
    # is named.
    data="$(cd "$(dirname "$0")/../.." && pwd)/formats/torchsave/testdata"
    for set in fsdp1_world2 fsdp1_world2_orig; do
      cp -r "$data/$set" "$work/$set"
      "$OPTSTATE" validate "$work/$set" >/dev/null || fail "validate $set"
      "$OPTSTATE" convert "$work/$set" "$work/$set.safetensors" >/dev/null || fail "convert $set"
      [ "$("$OPTSTATE" hash "$work/$set.safetensors" | tail -1)" = "$("$OPTSTATE" hash "$data/${set}_full.pt" | tail -1)" ] \
        || fail "$set converts to another state than FSDP places"
    done
    "$OPTSTATE" inspect "$work/fsdp1_world2" | matches "13 params" || fail "inspect names the 13 params"
    rm "$work/fsdp1_world2/model_world_size_2_rank_0.pt"
    expect_error 2 "rank 0's model file model_world_size_2_rank_0.pt is missing" -- "$OPTSTATE" inspect "$work/fsdp1_world2"
    ;;
  deepspeed-zero)
    # DeepSpeed ZeRO checkpoints (real 2-rank runs): the folder with `latest` and its tag folder
    # read alike; ZeRO-2 and ZeRO-3 of one run give one state in every format; a missing rank's file
    # is named; the format is written from a DeepSpeed checkpoint only (a universal checkpoint of a
    # ZeRO-1/2 one; a ZeRO-3 one for another world size), and a refused convert to it leaves nothing.
    data="$(cd "$(dirname "$0")/../.." && pwd)/formats/deepspeed/testdata"
    cp -r "$data/zero2_world2" "$work/z2"
    "$OPTSTATE" inspect "$work/z2" | matches "(deepspeed, files of 2 ranks)" || fail "inspect says deepspeed, 2 ranks"
    "$OPTSTATE" validate "$work/z2" >/dev/null || fail "validate"
    [ "$("$OPTSTATE" hash "$work/z2")" = "$("$OPTSTATE" hash "$work/z2/global_step3")" ] || fail "latest and tag differ"
    "$OPTSTATE" convert "$work/z2" "$work/z2.safetensors" >/dev/null || fail "convert to safetensors"
    "$OPTSTATE" convert "$data/zero3_world2" "$work/z3.pt" 2>/dev/null >/dev/null || fail "convert to torch.save"
    [ "$("$OPTSTATE" hash "$work/z2.safetensors" | tail -1)" = "$("$OPTSTATE" hash "$work/z3.pt" | tail -1)" ] \
      || fail "ZeRO-2 and ZeRO-3 of one run convert to other states"
    expect_error 2 "written from a DeepSpeed ZeRO checkpoint" -- "$OPTSTATE" convert "$work/z3.pt" "$work/back" --format deepspeed
    [ ! -e "$work/back" ] || fail "a refused convert left $work/back"
    # a ZeRO-3 checkpoint is written again for another world size: every rank's two files
    "$OPTSTATE" convert "$data/zero3_world2" "$work/z3x3" --format deepspeed --world-size 3 2>/dev/null | matches "(deepspeed, 3 ranks)" \
      || fail "reshard ZeRO-3 to 3 ranks"
    [ "$(ls "$work/z3x3" | grep -c '^zero_pp_rank_[0-2]_mp_rank_00_\(optim\|model\)_states.pt$')" = 6 ] \
      || fail "ZeRO-3 on 3 ranks: not 6 rank files"
    [ "$("$OPTSTATE" hash "$work/z3x3" | tail -1)" = "$("$OPTSTATE" hash "$data/zero3_world2" | tail -1)" ] \
      || fail "ZeRO-3 resharded to 3 ranks holds another state"
    "$OPTSTATE" convert "$work/z2" "$work/universal" --format deepspeed 2>/dev/null | matches "(deepspeed, 1 rank)" \
      || fail "universal checkpoint"
    cmp -s "$work/z2/global_step3/mp_rank_00_model_states.pt" "$work/universal/mp_rank_00_model_states.pt" \
      || fail "model states not carried"
    for f in fp32 exp_avg exp_avg_sq step; do
      [ -f "$work/universal/zero/0.weight/$f.pt" ] || fail "universal: no zero/0.weight/$f.pt"
    done
    [ -f "$work/universal/zero/optimizer_state.pt" ] || fail "universal: no zero/optimizer_state.pt"
    expect_error 2 "already a universal checkpoint" -- "$OPTSTATE" convert "$work/universal" "$work/again" --format deepspeed
    expect_error 2 "loads on any world size" -- "$OPTSTATE" convert "$work/z2" "$work/again" --format deepspeed --world-size 2
    [ ! -e "$work/again" ] || fail "a refused convert left $work/again"
    rm "$work/z2/global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    expect_error 2 "partition_count 2, but" -- "$OPTSTATE" inspect "$work/z2"
    ;;
  libtorch-archive)
    # A C++ loop's torch::save(optimizer) (LibTorch's archive) of torch::optim::AdamW and of
    # optstate's AdamW8bit: validated, converted to torch's state_dict and to safetensors with the
    # state the live optimizer had; a truncated one is named; one written by convert is read back.
    data="$(cd "$(dirname "$0")/../.." && pwd)/formats/libtorch/testdata"
    for name in libtorch_adamw libtorch_adamw8bit; do
      "$OPTSTATE" validate "$data/$name.pt" >/dev/null || fail "validate $name"
      "$OPTSTATE" convert "$data/$name.pt" "$work/$name.safetensors" >/dev/null || fail "convert $name"
      "$OPTSTATE" diff "$work/$name.safetensors" "$data/$name.expected.safetensors" --rtol 0 --atol 0 >/dev/null \
        || fail "$name converts to another state than the optimizer had"
      "$OPTSTATE" convert "$data/$name.pt" "$work/$name.torch.pt" >/dev/null || fail "convert $name to .pt"
    done
    "$OPTSTATE" inspect "$data/libtorch_adamw8bit.pt" | matches "8bit/256 dynamic-signed" || fail "inspect shows the 8-bit moments"
    # and written: a demo checkpoint (named params with weights) as an archive for torch::load
    make_ckpt "$work/ck"
    "$OPTSTATE" convert "$work/ck" "$work/opt.pt" --format libtorch 2>"$work/notes" >/dev/null || fail "convert to libtorch"
    matches "holds no weights" "$work/notes" || fail "convert says the archive holds no weights"
    matches "numbers the params 0..5" "$work/notes" || fail "convert says the params are numbered"
    "$OPTSTATE" inspect "$work/opt.pt" | matches "(libtorch)" || fail "the archive is sniffed as libtorch"
    "$OPTSTATE" validate "$work/opt.pt" >/dev/null || fail "validate the written archive"
    head -c 40000 "$data/libtorch_adamw.pt" > "$work/cut.pt"
    expect_error 2 "cut.pt" -- "$OPTSTATE" inspect "$work/cut.pt"
    ;;
  *) fail "unknown case" ;;
esac
exit 0
