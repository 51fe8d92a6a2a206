#!/usr/bin/env bash
# The ISA-specific kernel objects (compiled with -mavx2 / -mavx512*) may define weak symbols: inline
# functions and template instances that other objects define too, of which the linker keeps one.
# If that one holds AVX2 or AVX-512 instructions, CPUs without them run it anyway (an illegal
# instruction far from the kernel). So every weak symbol these objects define must be free of
# VEX/EVEX-encoded instructions (v-prefixed mnemonics, ymm/zmm or mask registers).
#   check_isa_objects.sh OBJECT...   (the library's objects; those named *_avx*.o are checked)
set -euo pipefail
status=0 checked=0
for obj in "$@"; do
  case "$(basename "$obj")" in *_avx*.o) ;; *) continue ;; esac
  checked=$((checked + 1))
  while read -r sym; do
    [ -n "$sym" ] || continue
    body=$(objdump -d --no-show-raw-insn "--disassemble=$sym" "$obj" | awk '/>:$/ {on=1; next} on && NF' )
    if grep -Eq '^\s*[0-9a-f]+:\s+v[a-z]|%[yz]mm|%k[0-7]' <<<"$body"; then
      echo "FAIL: $obj: weak symbol $(c++filt "$sym") holds vector-ISA instructions:" >&2
      grep -E '^\s*[0-9a-f]+:\s+v[a-z]|%[yz]mm|%k[0-7]' <<<"$body" | head -5 >&2
      status=1
    else
      echo "ok: $(basename "$obj"): weak $(c++filt "$sym") (no VEX/EVEX instructions)"
    fi
  done < <(nm --defined-only "$obj" | awk '$2 ~ /^[WVu]$/ {print $3}' | sort -u)
done
if [ "$checked" -eq 0 ]; then echo "FAIL: no *_avx*.o among the objects given" >&2; exit 1; fi
echo "$checked ISA objects checked"
exit $status
