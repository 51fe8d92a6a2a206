"""The local multi-rank launcher the interop tests start their torch.distributed runs with
(launch.py): the environment each rank gets, output in rank order, a failed rank's code and the
others stopped, a hung run stopped at its timeout. Plain Python ranks: no torch, a second or so."""
import subprocess
import sys
import time

import pytest

from launch import run_ranks

SHOW_ENV = """
import os
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS"]
print(" ".join(f"{k}={os.environ.get(k, '-')}" for k in keys), os.environ["MASTER_PORT"].isdigit())
"""


def test_each_rank_gets_torchruns_environment_and_output_comes_in_rank_order():
    proc = run_ranks([sys.executable, "-c", SHOW_ENV], 3, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"RANK={r} LOCAL_RANK={r} WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 OMP_NUM_THREADS=1 True"
        for r in range(3)]
    # one rank: torchrun leaves OMP_NUM_THREADS alone there (all cores), and so does run_ranks
    one = run_ranks([sys.executable, "-c", SHOW_ENV], 1, env={"PATH": "/usr/bin:/bin"})
    assert one.stdout.strip() == "RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 " \
                                 "OMP_NUM_THREADS=- True"


def test_a_failed_rank_gives_its_code_and_output_and_the_waiting_ranks_are_stopped():
    # rank 1 fails at once; rank 0 would wait (as on a collective) for a minute
    script = ("import os, sys, time\n"
              "if os.environ['RANK'] == '1': sys.exit('rank 1: bad input')\n"
              "time.sleep(60)\n")
    start = time.monotonic()
    proc = run_ranks([sys.executable, "-c", script], 2, grace=0.5)
    assert time.monotonic() - start < 30
    assert proc.returncode == 1 and "rank 1: bad input" in proc.stderr


def test_a_hung_run_is_stopped_at_its_timeout():
    with pytest.raises(subprocess.TimeoutExpired):
        run_ranks([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], 2,
                  timeout=1.5)
