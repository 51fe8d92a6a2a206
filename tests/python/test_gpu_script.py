"""The GPU check script (tests/gpu/check_cuda.py, run by scripts/gpu_check.sh on a lent GPU) kept
working where no GPU is: its correctness part runs CPU against CPU over every case it would run on a
GPU (vector, scalar and two-pass paths, misaligned storage, dtypes), and must pass, as must FusedAdamW
against torch.optim.AdamW on the same device (docs/numerics.md's tolerance); its timing table
runs on small CPU tensors, every row (the sweeps too) measured."""
import os
import sys
from pathlib import Path

import forkserver

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_script_dry_run_on_cpu():
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = forkserver.run([sys.executable, str(REPO / "tests/gpu/check_cuda.py"), "--dry-run-cpu", "--steps", "1",
                           "--iters", "2", "--skip-torchao"], env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if "max |cpu - cpu|" in ln]
    # 9 cases x 2 dtypes, then 4 cases x 3 tuning knobs, then the channels_last / transposed params
    assert len(lines) == 18 + 12 + 2, proc.stdout
    assert all("bitwise equal" in ln for ln in lines)
    against = [ln for ln in proc.stdout.splitlines() if "ours vs torch fused" in ln]
    assert len(against) == 2 and all("(within 1e-6)" in ln for ln in against), proc.stdout
    resumed = [ln for ln in proc.stdout.splitlines() if "resumed equal" in ln]
    assert len(resumed) == 2 and all(ln.count("True") == 3 for ln in resumed), proc.stdout
    table = proc.stdout[proc.stdout.index("== timing on cpu"):]
    assert "failed" not in table, table
    for name in ("optstate FusedAdamW", "chunk 16k", "chunk 256k", "5 blocks/SM", "torch AdamW fused",
                 "torch AdamW foreach", "optstate AdamW8bit", "4 blocks/SM"):
        assert name in table, table
    assert table.count("2 groups in flight") == 2, table


def test_gpu_check_against_torchao_runs_on_cpu(capsys):
    """The GPU check's comparison with torchao's compiled AdamW8bit (skipped by the dry run above to
    save its compile), run here on the CPU with small shapes: it must run through and hold."""
    sys.path.insert(0, str(REPO / "tests/gpu"))
    try:
        import check_cuda
    finally:
        sys.path.pop(0)
    assert check_cuda.against_torchao(3, "cpu", shapes=((64, 256), (300,))) is True
    out = capsys.readouterr().out
    assert "exp_avg codes" in out and "dense state" in out and "within the CPU bounds" in out, out
