"""Local multi-rank runs for the interop tests: N processes of one command over torch.distributed on
loopback, given the environment `torchrun --standalone --nproc-per-node=N` gives its workers
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_ADDR/MASTER_PORT for
init_process_group's env:// rendezvous, OMP_NUM_THREADS=1 where N > 1), but without torchrun's own
process: that one imports torch and runs an elastic agent, 3-4 s a run on a 2-core machine, and the
suites here start about a hundred runs. What the runs test (gloo, FSDP, DeepSpeed) is the same.
A Python command's ranks are forked from the worker's pre-imported interpreter where that is the
same as a fresh one (forkserver.py)."""
import os
import socket
import subprocess
import tempfile
import time

import forkserver


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(base, rank, world, port):
    env = dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
               ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world), ROLE_NAME="default")
    if world > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks on one machine
    return env


def run_ranks(cmd, world, *, cwd=None, env=None, timeout=300, grace=5.0):
    """Runs `world` copies of `cmd` as ranks 0..world-1 and waits for all. Returns a
    CompletedProcess: the ranks' stdout and stderr each joined in rank order, the return code that
    of the first rank that failed by itself (0 if none failed). Once a rank has failed, the others
    get `grace` seconds (they may be waiting on it in a collective) and are then killed; past
    `timeout`, all are killed and subprocess.TimeoutExpired is raised, as subprocess.run does."""
    base = dict(os.environ if env is None else env)
    port, timed_out = free_port(), False
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        procs, files = [], []
        try:
            for rank in range(world):
                out = open(os.path.join(logs, f"{rank}.out"), "w+")
                err = open(os.path.join(logs, f"{rank}.err"), "w+")
                files += [out, err]
                procs.append(forkserver.popen(cmd, cwd=cwd, env=rank_env(base, rank, world, port),
                                              stdout=out, stderr=err, stdin=subprocess.DEVNULL))
            deadline, failed_at = time.monotonic() + timeout, None
            while [p.poll() for p in procs].count(None):  # every rank polled (not any()'s first)
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline:
                    timed_out = failed_at is None
                    break
                if failed_at is not None and now > failed_at + grace:
                    break
                time.sleep(0.02)
        finally:
            killed = [p.poll() is None for p in procs]
            for p, kill in zip(procs, killed):
                if kill:
                    p.kill()
                    p.wait()
        texts = []
        for f in files:
            f.seek(0)
            texts.append(f.read())
            f.close()
    stdout, stderr = "".join(texts[0::2]), "".join(texts[1::2])
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    # not timed out: any rank killed here was stopped after another rank failed by itself
    code = next((p.returncode for p, kill in zip(procs, killed) if p.returncode != 0 and not kill), 0)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def gloo_teardown_abort(proc):
    """torch 2.13 + gloo aborts now and then as a process exits or tears its group down
    ("terminate called without an active exception", SIGABRT): torch's own threads (a script with no
    optstate in it does it too; optstate starts no threads). Such a run is tried once more."""
    return proc.returncode != 0 and "terminate called without an active exception" in proc.stderr


def run_ranks_past_gloo_aborts(cmd, world, **kwargs):
    """run_ranks, up to twice more where the run ended in gloo's teardown abort or failed to meet at
    its rendezvous (every script here can run again, on a new port): on a loaded 2-core machine two
    in a row have been seen."""
    for _ in range(3):
        proc = run_ranks(cmd, world, **kwargs)
        if not (gloo_teardown_abort(proc) or rendezvous_failure(proc)):
            break
    return proc


def rendezvous_failure(proc):
    """A rank that could not reach the run's TCPStore (c10d's DistNetworkError, "Connection reset by
    peer"): free_port's port can be taken by another test's run between its probe and rank 0's bind
    when the suite runs on several workers. Nothing of the script ran; it is tried again."""
    return proc.returncode != 0 and "DistNetworkError" in proc.stderr and "TCPStore" in proc.stderr
