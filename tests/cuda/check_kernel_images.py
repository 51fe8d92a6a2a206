#!/usr/bin/env python3
"""What the compiled CUDA kernels are, checked without a GPU (CTest `cuda.kernel_images`).

Reads the kernels' static library with cuobjdump (the CUDA toolkit's, or the nvidia-cuda-cuobjdump
and nvidia-cuda-nvdisasm wheels that scripts/requirements.txt installs) and checks:

1. the fatbin holds machine code for every real architecture in CMAKE_CUDA_ARCHITECTURES and PTX
   for every virtual one (a GPU outside the list fails at its first launch: "no kernel image");
2. in the machine code of every architecture, the shapes the design rests on (docs/cuda.md):
   FusedAdamW's vector path moves fp32 params and moments in 16-byte loads and stores; the 8-bit
   kernels load and store fp32 params (and load grads) 16 bytes at a time, reduce
   each block's two (three with amsgrad) absmax with 5-step butterfly shuffles, hold 27,648 bytes
   of tables in shared memory and synchronize the CUDA block once (after copying them);
3. on sm_90 (the H200 the issue's goals are measured on), the register budgets that give the
   residency docs/cuda.md counts on, with no stack: FusedAdamW <= 64 registers (4 blocks of 256
   per SM), the 8-bit kernel <= 80 (3 blocks); the MIN_BLOCKS variants <= 48 and <= 64.

Exit 0 when all hold, 1 with each failure named (kernel, architecture, what was found).
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import sysconfig

TABLES8_BYTES = 27648  # sizeof(Tables8): two 256-entry float maps + the two quantizers' bucket entries


def find_cuobjdump(toolkit_bin):
    candidates = [shutil.which("cuobjdump")]
    if toolkit_bin:
        candidates.append(os.path.join(toolkit_bin, "cuobjdump"))
    nvidia = os.path.join(sysconfig.get_paths()["purelib"], "nvidia")
    if os.path.isdir(nvidia):
        for sub in sorted(os.listdir(nvidia), reverse=True):  # cu13 before cu12
            candidates.append(os.path.join(nvidia, sub, "bin", "cuobjdump"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def run(tool, *args):
    env = dict(os.environ)
    # cuobjdump -sass runs nvdisasm: the wheels put both in one folder
    env["PATH"] = os.path.dirname(tool) + os.pathsep + env.get("PATH", "")
    r = subprocess.run([tool, *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"check_kernel_images: {' '.join([tool, *args])} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def kernel_name(mangled):
    """The kernel's own name and template flag from its mangled name: 'adamw8bit_kernel_4<1>'."""
    m = re.search(r"optim_cuda_cu_[0-9a-f]{8}", mangled)
    rest = mangled[m.end():] if m else mangled
    # <length><identifier>: the length's digits run into the hash's, so try each split
    for k in range(1, 4):
        if len(rest) < k or not rest[:k].isdigit():
            continue
        n = int(rest[:k])
        ident = rest[k:k + n]
        if len(ident) == n and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", ident) and ident.endswith(
                ("kernel", "kernel_4", "kernel_5", "kernel_g2", "kernel_p", "adamw", "adamw8bit")):
            flag = re.match(r"ILb([01])E", rest[k + n:])
            return ident + (f"<{flag.group(1)}>" if flag else "")
    return mangled


def wanted_images(archs):
    real, virtual = set(), set()
    for a in archs.replace(";", " ").split():
        num, _, kind = a.partition("-")
        if not num.isdigit() or kind not in ("", "real", "virtual"):
            sys.exit(f"check_kernel_images: --archs {archs!r}: {a!r} is not an architecture (as 90, 90-real, 90-virtual)")
        if kind in ("", "real"):
            real.add(int(num))
        if kind in ("", "virtual"):
            virtual.add(int(num))
    return real, virtual


def parse_resources(text):
    """{(sm, kernel): {'REG': n, 'STACK': n, 'SHARED': n, 'LOCAL': n}}"""
    out, arch, func = {}, None, None
    for line in text.splitlines():
        m = re.match(r"\s*arch = sm_(\d+)", line)
        if m:
            arch = int(m.group(1))
            continue
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            func = kernel_name(m.group(1))
            continue
        m = re.match(r"\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and func:
            out[(arch, func)] = dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, m.groups())))
    return out


def parse_sass(text):
    """{kernel: Counter of memory/shuffle/barrier instructions by kind}: 'LDG.128', 'STG.64', 'SHFL', ..."""
    out, func = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            func = kernel_name(m.group(1))
            out[func] = collections.Counter()
            continue
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if not m or func is None:
            continue
        parts = m.group(1).split(".")
        op = parts[0]
        if op in ("LDG", "STG", "LDL", "STL", "LDS", "STS"):
            width = next((p for p in parts[1:] if p in ("128", "64", "U8", "S8", "U16", "S16")), "32")
            out[func][f"{op}.{width}"] += 1
            out[func][op] += 1
        elif op == "SHFL" and "BFLY" in parts:
            out[func]["SHFL.BFLY"] += 1
        elif op == "BAR" and "SYNC" in parts:
            out[func]["BAR.SYNC"] += 1
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("library", help="liboptstate_cuda_kernels.a")
    ap.add_argument("--archs", required=True, help="CMAKE_CUDA_ARCHITECTURES of the build")
    ap.add_argument("--toolkit-bin", default="", help="the CUDA toolkit's bin folder (cuobjdump, if it has one)")
    ap.add_argument("--cuobjdump", default="", help="cuobjdump to use")
    args = ap.parse_args()

    tool = args.cuobjdump or find_cuobjdump(args.toolkit_bin)
    if not tool:
        sys.exit("check_kernel_images: no cuobjdump (not on PATH, not in the CUDA toolkit, no nvidia-cuda-cuobjdump "
                 "wheel in this Python); `pip install -r scripts/requirements.txt` installs one")
    failures = []

    def need(ok, what):
        if not ok:
            failures.append(what)

    # 1. which images the fatbin holds
    listing = run(tool, "--list-elf", "--list-ptx", args.library)
    have_real = {int(a) for a in re.findall(r"ELF file\s+\d+: \S+\.sm_(\d+)\.cubin", listing)}
    have_ptx = {int(a) for a in re.findall(r"PTX file\s+\d+: \S+\.sm_(\d+)\.ptx", listing)}
    want_real, want_ptx = wanted_images(args.archs)
    for a in sorted(want_real - have_real):
        failures.append(f"no sm_{a} machine code in {args.library} (CMAKE_CUDA_ARCHITECTURES={args.archs})")
    for a in sorted(want_ptx - have_ptx):
        failures.append(f"no compute_{a} PTX in {args.library} (CMAKE_CUDA_ARCHITECTURES={args.archs})")
    print(f"images: machine code for {', '.join(f'sm_{a}' for a in sorted(have_real)) or 'none'}; "
          f"PTX for {', '.join(f'compute_{a}' for a in sorted(have_ptx)) or 'none'}")

    # 2. shapes, per architecture
    res = parse_resources(run(tool, "-res-usage", args.library))
    adamw = ("adamw_kernel", "adamw_kernel_5", "adamw_kernel_g2")
    eight = tuple(f"adamw8bit_kernel{v}<{a}>" for v in ("", "_4", "_p") for a in (0, 1))
    for sm in sorted(have_real):
        sass = parse_sass(run(tool, "-sass", "-arch", f"sm_{sm}", args.library))
        for k in adamw + eight:
            need(k in sass, f"sm_{sm}: kernel {k} missing")
        print(f"sm_{sm}: {'kernel':<22} {'regs':>4} {'stack':>5} {'shared':>6} {'ld128':>5} {'st128':>5} "
              f"{'ld64':>4} {'spill':>5} {'shfl':>4} {'bar':>3}")
        for k in adamw + eight:
            c, r = sass.get(k, collections.Counter()), res.get((sm, k), {})
            # 16-byte loads of tensors: the table copy's loads (8-bit kernels) each feed one
            # 16-byte shared store, so they are the loads beyond those stores
            vec_loads = c["LDG.128"] - c["STS.128"]
            print(f"sm_{sm}: {k:<22} {r.get('REG', '?'):>4} {r.get('STACK', '?'):>5} {r.get('SHARED', '?'):>6} "
                  f"{vec_loads:>5} {c['STG.128']:>5} {c['LDG.64']:>4} {c['LDL'] + c['STL']:>5} "
                  f"{c['SHFL.BFLY']:>4} {c['BAR.SYNC']:>3}")
            where = f"sm_{sm} {k}"
            if k in adamw:
                # fp32 path: param, grad, exp_avg, exp_avg_sq in (+ max_exp_avg_sq); param and moments out
                need(vec_loads >= 4, f"{where}: {vec_loads} 16-byte loads, want >= 4 (the fp32 vector path)")
                need(c["STG.128"] >= 3, f"{where}: {c['STG.128']} 16-byte stores, want >= 3 (the fp32 vector path)")
                need(c["BAR.SYNC"] == 0, f"{where}: {c['BAR.SYNC']} block barriers, want none")
            else:
                need(vec_loads >= 2, f"{where}: {vec_loads} 16-byte loads, want >= 2 (fp32 params and grads)")
                need(c["STG.128"] >= 1, f"{where}: {c['STG.128']} 16-byte stores, want >= 1 (fp32 params)")
                moments = 3 if k.endswith("<1>") else 2
                need(c["SHFL.BFLY"] >= 5 * moments,
                     f"{where}: {c['SHFL.BFLY']} butterfly shuffles, want >= {5 * moments} (absmax of {moments} moments)")
                need(c["BAR.SYNC"] == 1, f"{where}: {c['BAR.SYNC']} block barriers, want 1 (after the table copy)")
                shared = r.get("SHARED", -1)
                # sm_90 and later report 1 KB more: the block's system-reserved shared memory
                need(shared in (TABLES8_BYTES, TABLES8_BYTES + 1024),
                     f"{where}: {shared} bytes of shared memory, want {TABLES8_BYTES} (the 8-bit tables)")

    # 3. sm_90's register budgets
    if 90 in have_real:
        budgets = {"adamw_kernel": 64, "adamw_kernel_g2": 64, "adamw8bit_kernel<0>": 80, "adamw8bit_kernel<1>": 80,
                   "adamw_kernel_5": 48, "adamw8bit_kernel_4<0>": 64, "adamw8bit_kernel_4<1>": 64}
        no_stack = ("adamw_kernel", "adamw_kernel_g2", "adamw8bit_kernel<0>", "adamw8bit_kernel<1>")
        for k, cap in budgets.items():
            r = res.get((90, k))
            if r is None:
                failures.append(f"sm_90 {k}: no resource usage reported")
                continue
            need(r["REG"] <= cap, f"sm_90 {k}: {r['REG']} registers, want <= {cap} (docs/cuda.md's residency)")
            if k in no_stack:
                need(r["STACK"] == 0, f"sm_90 {k}: {r['STACK']} bytes of stack (spills), want 0")

    for f in failures:
        print(f"FAIL: {f}")
    print(f"check_kernel_images: {len(failures)} failure(s)" if failures else "check_kernel_images: all hold")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
