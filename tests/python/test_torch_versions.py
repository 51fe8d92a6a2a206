"""Checkpoints that other torch and torchao releases wrote (tests/data/torch_versions/<release>/,
made by its make.py in a venv of each release: torch 2.4 with torchao 0.5, 2.6 with 0.9, 2.8 with
0.13, 2.10 alone, 2.11 with 0.16, 2.14 and 2.15 with 0.18) read as each release held the state: torch.save'd
optimizers, DCP, verl's per-rank FSDP1 and FSDP2 files, torchao AdamW8bit's state_dict and DCP;
verl's files reshard in the source release's DeviceMesh form. The rest of the suite writes with the
one torch in .venv; these pickles (DCP's Metadata and storage records, DTensor and DeviceMesh,
torchao's OptimState8bit, defined in torchao.prototype.low_bit_optim before torchao 0.11) are what
differ between releases.
"""
import json
import textwrap
from pathlib import Path

import pytest
import torch

from test_formats import hashes, run_script, st_load

CORPUS = Path(__file__).resolve().parents[1] / "data" / "torch_versions"
CASES = sorted((d.name, ref.name[:-len(".ref.safetensors")])
               for d in CORPUS.iterdir() if d.is_dir() for ref in d.glob("*.ref.safetensors"))


def torch_version(release):
    """(2, 14) of "torch-2.14.1_torchao-0.18.0"."""
    return tuple(int(x) for x in release.split("_")[0][len("torch-"):].split(".")[:2])


def ref_of(release, name):
    from safetensors import safe_open
    path = CORPUS / release / (name + ".ref.safetensors")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return st_load(path), json.loads(meta["ref"]), meta


def test_the_corpus_holds_every_kind_of_checkpoint_for_each_release():
    releases = {r for r, _ in CASES}
    assert len(releases) >= 6, releases
    for r in releases:
        names = {n for rr, n in CASES if rr == r}
        assert {"optimizer.pt", "dcp", "fsdp1_world2"} <= names, (r, names)
        # FSDP2 runs on the CPU from torch 2.7: its per-rank files from the later releases
        assert ("fsdp2_world2" in names) == (torch_version(r) >= (2, 7)), (r, names)
        # a release made without torchao ("torchao-none") has no torchao sets; torchao 0.5 cannot
        # dcp.save its own state (make.py)
        assert ("torchao_optimizer.pt" in names) == (not r.endswith("torchao-none")), (r, names)
        assert ("torchao_dcp" in names) == (not r.endswith(("torchao-none", "torchao-0.5.0"))), (r, names)
    torchao = {ref_of(r, "torchao_optimizer.pt")[2]["torchao"] for r, n in CASES if n == "torchao_optimizer.pt"}
    assert any(v.startswith("0.9.") for v in torchao), torchao  # torchao.prototype.low_bit_optim's


@pytest.mark.parametrize("release,name", CASES)
def test_a_checkpoint_of_another_release_reads_as_that_release_held_it(tmp_path, optstate_cli, release, name):
    """validate passes with every checksum checked; the fp32 conversion holds, bit for bit, what the
    writing release held (torchao's moments as its own dequantize() gives them); steps and group
    hyperparameters are the release's; --values hashes the checkpoint as its fp32 conversion."""
    ck = CORPUS / release / name
    ref, meta, _ = ref_of(release, name)
    info = reads_as_held(tmp_path, optstate_cli, ck, ref, meta)
    packages = torchao_packages(ck)  # the torchao package its pickles name, if any: inspect says it
    assert info.get("torchao_package") == (min(packages) if packages else None), packages


def reads_as_held(tmp_path, optstate_cli, ck, ref, meta, checksums=True):
    """Checks checkpoint `ck` against what its writer held (`ref`, `meta`: a `.ref.safetensors` of
    make.py's write_ref); returns inspect's JSON. `checksums`: the format stores them (all checked),
    or not, or (a text) what validate says of the part that has none."""
    validated = optstate_cli("validate", ck).stdout
    said = {True: "every chunk checksum verified", False: "no checksums in this format"}.get(checksums, checksums)
    assert said in validated, validated
    out = tmp_path / "fp32.safetensors"
    optstate_cli("convert", ck, out, "--to", "fp32")
    got = st_load(out)
    moments = {k for k in got if k.endswith((".exp_avg", ".exp_avg_sq", ".max_exp_avg_sq"))}
    assert moments == {k for k in ref if not k.endswith(".param")}
    for k, v in ref.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k
    info = json.loads(optstate_cli("inspect", ck, "--json", "--no-stats").stdout)
    assert set(info["params"]) == set(meta)
    for fqn, want in meta.items():
        p = info["params"][fqn]
        group = info["param_groups"][p["group"]]
        assert p["step"] == want["step"], fqn
        for field in ("lr", "betas", "eps", "weight_decay"):
            assert group[field] == pytest.approx(want[field], rel=1e-7), (fqn, field)
    assert hashes(optstate_cli, ck, values=True)["root"] == hashes(optstate_cli, out, values=True)["root"]
    return info


RESUME_TORCHAO = textwrap.dedent("""
    # Today's torchao resumes from optstate's conversion of another release's torchao checkpoint:
    # torch.load + load_state_dict (a torch.save'd state_dict, params numbered) or dcp.load +
    # set_optimizer_state_dict (a DCP), into AdamW8bit over make.py's wide model. Prints, as JSON,
    # whether each moment is then an 8-bit OptimState8bit whose dequantize() is the writing
    # release's bit for bit, and whether a step then runs.
    import json, sys, torch
    from safetensors.torch import load_file
    from torchao.optim import AdamW8bit
    kind, path, ref_path = sys.argv[1:4]
    ref = load_file(ref_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256, bias=False), torch.nn.Linear(256, 4))
    opt = AdamW8bit(model.parameters(), lr=1e-3)
    if kind == "pt":
        opt.load_state_dict(torch.load(path, weights_only=False))
        names = {p: str(i) for i, p in enumerate(model.parameters())}
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        msd, osd = get_state_dict(model, opt)
        states = {"model": msd, "optim": osd}
        dcp.load(states, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=states["model"], optim_state_dict=states["optim"])
        names = {p: n for n, p in model.named_parameters()}
    report = {"eight_bit": [], "equal": True}
    for p, name in names.items():
        for k in ("exp_avg", "exp_avg_sq"):
            v = opt.state[p][k]
            if hasattr(v, "codes"):
                report["eight_bit"].append(f"{name}.{k}")
                v = v.dequantize()
            report["equal"] &= bool(torch.equal(v.float(), ref[f"{name}.{k}"]))
    for g in opt.param_groups:  # torchao's step takes a tensor lr
        g["lr"] = torch.as_tensor(g["lr"], dtype=torch.float32)
    model(torch.randn(4, 32)).square().sum().backward()
    opt.step()
    report["stepped"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(json.dumps(report))
""")


@pytest.mark.parametrize("release", sorted({r for r, n in CASES if n == "torchao_optimizer.pt"}))
def test_todays_torchao_resumes_from_the_conversion_of_another_releases_torchao_state(
        tmp_path, optstate_cli, release):
    """torchao before 0.11 pickled its OptimState8bit from torchao.prototype.low_bit_optim, a
    module today's torchao no longer has, so its own torch.load of such a Trainer optimizer.pt
    fails. `convert --format torchao` (and `--format dcp` for a DCP) writes the same codes and scales
    as today's torchao.optim classes (--torchao-package torchao.optim; by default a conversion keeps
    the source's package: the next test): today's AdamW8bit loads them as 8-bit state, its moments
    are the old release's bit for bit, and it steps on."""
    pytest.importorskip("torchao")
    src = CORPUS / release
    pt, dcp_out = tmp_path / "optimizer.pt", tmp_path / "dcp"
    today = ("--torchao-package", "torchao.optim")
    optstate_cli("convert", src / "torchao_optimizer.pt", pt, "--format", "torchao", *today)
    runs = [("pt", pt, "torchao_optimizer.pt")]
    if (src / "torchao_dcp").exists():
        optstate_cli("convert", src / "torchao_dcp", dcp_out, "--format", "dcp", *today)
        runs.append(("dcp", dcp_out, "torchao_dcp"))
    for kind, path, ref in runs:
        out = run_script(tmp_path, RESUME_TORCHAO, "resume.py", kind, path, src / (ref + ".ref.safetensors"))
        report = json.loads(out.stdout.strip().splitlines()[-1])
        weight = "0" if kind == "pt" else "0.weight"
        assert report == {"eight_bit": [f"{weight}.exp_avg", f"{weight}.exp_avg_sq"], "equal": True,
                          "stepped": True}, (kind, report)


def torchao_packages(path):
    """The packages whose torchao subclasses the pickles under `path` name (a torch.save file, or
    a DCP whose items are torch.save archives inside its .distcp files)."""
    import re
    files = [path] if path.is_file() else sorted(path.glob("*.distcp"))
    found = set()
    for f in files:
        found |= {m.decode() for m in re.findall(rb"(torchao\.optim|torchao\.prototype\.low_bit_optim)\.subclass_8bit",
                                                  f.read_bytes())}
    return found


@pytest.mark.parametrize("release", sorted({r for r, n in CASES if n == "torchao_optimizer.pt"}))
def test_a_reshard_or_conversion_of_another_releases_torchao_state_keeps_its_package(tmp_path, optstate_cli, release):
    """A pickle names the module that defined its class, so torchao before 0.11 loads only
    torchao.prototype.low_bit_optim's OptimState8bit and later releases only torchao.optim's. A
    conversion to torchao's file or a DCP reshard of a release's torchao state writes its 8-bit
    moments as that release's classes, the state unchanged, and says which releases load them;
    --torchao-package chooses the other."""
    src = CORPUS / release
    ao_version = tuple(int(x) for x in release.split("torchao-")[1].split(".")[:2])
    package = "torchao.optim" if ao_version >= (0, 11) else "torchao.prototype.low_bit_optim"
    other = "torchao.prototype.low_bit_optim" if package == "torchao.optim" else "torchao.optim"
    runs = [("convert", src / "torchao_optimizer.pt", tmp_path / "optimizer.pt", ("--format", "torchao"))]
    if (src / "torchao_dcp").exists():
        # 8192-element moments in blocks of 256: 4 ranks' rows are whole blocks, kept 8-bit.
        runs.append(("reshard", src / "torchao_dcp", tmp_path / "dcp4", ("--format", "dcp", "--world-size", "4")))
    for command, source, out, args in runs:
        assert torchao_packages(source) == {package}, source
        proc = optstate_cli(command, source, out, *args)
        assert torchao_packages(out) == {package}, (out, proc.stderr)
        if package == "torchao.optim":
            assert "OptimState8bit" not in proc.stderr, proc.stderr  # today's: nothing to say
        else:
            assert f"8-bit moments are {package}'s OptimState8bit (as the source's), which torchao before 0.11 " \
                   "loads; for torchao 0.11 and later: --torchao-package torchao.optim" in proc.stderr, proc.stderr
        assert hashes(optstate_cli, out) == hashes(optstate_cli, source), out  # codes, scales, steps: the same
        chosen = out.with_name(out.name + "-other")
        proc = optstate_cli(command, source, chosen, *args, "--torchao-package", other)
        assert torchao_packages(chosen) == {other}, (chosen, proc.stderr)
        assert hashes(optstate_cli, chosen) == hashes(optstate_cli, source), chosen


def mesh_layouts(folder):
    """The DeviceMesh of each file of a per-rank set, as pickletools shows its opcodes: ("axes",
    shape, stride) for torch 2.13's `_layout`, ("flat", shape, stride) for 2.10-2.12's, ("mesh",
    ranks of `_flatten_mesh_list`, ranks of `_dim_group_infos` or None) before 2.10."""
    import io
    import pickletools
    import re
    import zipfile
    out = set()
    for f in sorted(folder.glob("*_world_size_*_rank_*.pt")):
        with zipfile.ZipFile(f) as z:
            pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        text = io.StringIO()
        pickletools.dis(pkl, out=text)
        dis = text.getvalue()
        ints = lambda block: tuple(int(x) for x in re.findall(r"BININT1\s+(\d+)", block))  # noqa: E731
        if (at := dis.find("'_layout'")) >= 0:
            block = dis[at:dis.find("'_rank_map'", at)]
            both = ints(block)
            n = len(both) // 2  # shape then stride, each a tuple of n ints (none for a dropped size-1 mode)
            out.add(("axes" if "'axes'" in block else "flat", both[:n], both[n:]))
        elif (at := dis.find("'_flatten_mesh_list'")) >= 0:
            flat = ints(dis[at:dis.find("BINUNICODE", at + 30)])
            g = dis.find("'_dim_group_infos'", at)
            groups = ints(dis[g:dis.find("'_coordinate_on_dim'", g)]) if g >= 0 else None
            out.add(("mesh", flat, groups))
    return out


@pytest.mark.parametrize("release,name", [c for c in CASES if c[1] in ("fsdp1_world2", "fsdp2_world2")])
def test_verls_files_of_another_release_reshard_in_that_releases_mesh_form(tmp_path, optstate_cli, release, name):
    """`reshard --format torchsave` rewrites each DTensor's DeviceMesh for the new world size in the
    form the source's torch pickles: 2.13 and later `_MeshLayout{axes: (_FlatLayout{shape, stride},)}`
    (one rank: an empty shape), 2.10-2.12 `_MeshLayout{shape, stride}` (one rank: (1,)), before 2.10
    the ranks as the tensor `mesh` and the tuple `_flatten_mesh_list` (and `_dim_group_infos`' ranks,
    before 2.8). FSDP1's files for one rank hold plain tensors. The files read back as the same
    state. (That torch 2.6 (FSDP1), 2.8, 2.9, 2.10, 2.11, 2.14 and 2.15 (FSDP1 and FSDP2) themselves load
    such files on 1 and 3 ranks and step on with the same state was checked with those releases when
    this was written.)"""
    src = CORPUS / release / name
    ref, _, _ = ref_of(release, name)
    (source,) = mesh_layouts(src)
    version = torch_version(release)
    form = "axes" if version >= (2, 13) else "flat" if version >= (2, 10) else "mesh"
    assert source[0] == form
    assert (source[2] is not None) == (version < (2, 8)) if form == "mesh" else True
    for world in (1, 3):
        out = tmp_path / f"w{world}"
        optstate_cli("reshard", src, out, "--world-size", str(world), "--format", "torchsave")
        ranks = tuple(range(world))
        if form == "mesh":
            want = {("mesh", ranks, ranks if source[2] is not None else None)}
        elif world > 1:
            want = {(form, (world,), (1,))}
        else:
            want = {(form, (), ()) if form == "axes" else (form, (1,), (1,))}
        if world == 1 and name == "fsdp1_world2":
            want = set()  # FSDP1 on one rank shards nothing: plain tensors, no mesh
        assert mesh_layouts(out) == want, (world, mesh_layouts(out))
        optstate_cli("convert", out, tmp_path / f"w{world}.safetensors")
        got = st_load(tmp_path / f"w{world}.safetensors")
        for k, v in ref.items():
            assert torch.equal(got[k], v), (world, k)
