"""The fork server the interop tests run their Python scripts through (forkserver.py): a forked
child starts as a fresh `python script|-c|-m` would (argv, sys.path, environment, cwd, __main__,
thread count, exit codes, output, shutdown), and a command a fork could run differently gets a
fresh interpreter."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import forkserver

# Prints what a script sees at its start; "torch" already in sys.modules tells a forked child from a
# fresh interpreter.
SHOW = textwrap.dedent("""
    import os, sys
    forked = "torch" in sys.modules
    import torch
    print(forked, "torchao" in sys.modules, __name__, sys.argv, sys.path[:2], os.getcwd(),
          os.environ.get("RANK"), os.environ.get("PYTHONPATH"), torch.get_num_threads(), sep="|")
""")


def show(cmd, **kwargs):
    proc = forkserver.run(cmd, timeout=120, **kwargs)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split("|")


def test_a_forked_script_starts_as_a_fresh_interpreter_would(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    (tmp_path / "extra").mkdir()
    env = dict(os.environ, RANK="3", PYTHONPATH=str(tmp_path / "extra"), OMP_NUM_THREADS="1")
    forked = show([sys.executable, script, "a", "b c"], env=env, cwd=tmp_path / "extra")
    fresh = show([sys.executable, script, "a", "b c"], env=dict(env, OPTSTATE_TEST_FORKSERVER="0"),
                 cwd=tmp_path / "extra")
    assert forked[0] == "True" and fresh[0] == "False"
    assert forked[1:] == fresh[1:] == [
        "False", "__main__", str([str(script), "a", "b c"]), str([str(tmp_path), str(tmp_path / "extra")]),
        str(tmp_path / "extra"), "3", str(tmp_path / "extra"), "1"]
    # -c: sys.path[0] is "" (the working directory); no OMP_NUM_THREADS: all cores, as fresh
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    forked = show([sys.executable, "-c", SHOW, "x"], env=env)
    fresh = show([sys.executable, "-c", SHOW, "x"], env=dict(env, OPTSTATE_TEST_FORKSERVER="0"))
    assert forked[0] == "True" and fresh[0] == "False" and forked[1:] == fresh[1:]
    assert forked[3] == str(["-c", "x"]) and forked[4].startswith("[''")


def test_a_module_runs_as_python_dash_m(tmp_path):
    (tmp_path / "in.json").write_text('{"b": 1, "a": [2]}')
    proc = forkserver.run([sys.executable, "-m", "json.tool", "--sort-keys", tmp_path / "in.json"])
    assert proc.returncode == 0 and proc.stdout == '{\n    "a": [\n        2\n    ],\n    "b": 1\n}\n'


@pytest.mark.parametrize("body,code,err", [
    ("sys.exit(3)", 3, ""),
    ("sys.exit('bad input')", 1, "bad input\n"),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
    ("os.kill(os.getpid(), signal.SIGKILL)", -9, ""),
    ("print('unflushed', end=''); import atexit; atexit.register(lambda: print(' at exit'))", 0, ""),
    ("import threading, time; threading.Thread(target=lambda: (time.sleep(0.5), print('joined'))).start()", 0, ""),
])
def test_exit_codes_output_and_shutdown_are_a_fresh_interpreters(body, code, err):
    cmd = [sys.executable, "-c", "import os, signal, sys\n" + body]
    forked = forkserver.run(cmd, timeout=60)
    fresh = forkserver.run(cmd, timeout=60, env=dict(os.environ, OPTSTATE_TEST_FORKSERVER="0"))
    assert forked.returncode == fresh.returncode == code
    assert forked.stdout == fresh.stdout
    assert err in forked.stderr and err in fresh.stderr
    if "unflushed" in body:
        assert forked.stdout == "unflushed at exit\n"
    if "joined" in body:
        assert forked.stdout == "joined\n"


def test_a_missing_script_fails_as_python_says_it(tmp_path):
    cmd = [sys.executable, tmp_path / "absent.py"]
    forked = forkserver.run(cmd, timeout=60)
    fresh = forkserver.run(cmd, timeout=60, env=dict(os.environ, OPTSTATE_TEST_FORKSERVER="0"))
    assert forked.returncode == fresh.returncode == 2
    assert forked.stderr == fresh.stderr and "can't open file" in forked.stderr


def test_a_class_defined_in_the_script_pickles_by_its_main_module(tmp_path):
    script = tmp_path / "pick.py"
    script.write_text(textwrap.dedent("""
        import pickle, sys
        class Point:
            def __init__(self, x): self.x = x
        p = pickle.loads(pickle.dumps(Point(4)))
        print(type(p).__module__, p.x, sys.modules["__main__"].__file__ == __file__)
    """))
    proc = forkserver.run([sys.executable, script], timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "__main__ 4 True\n"), proc.stderr


@pytest.mark.parametrize("cmd,env", [
    (["-c", SHOW], {"TORCH_SHOW_CPP_STACKTRACES": "1"}),  # read by something already imported
    (["-c", SHOW], {"OPTSTATE_TEST_FORKSERVER": "0"}),
    (["-u", "-c", SHOW], {}),  # interpreter options
])
def test_a_command_a_fork_could_run_differently_gets_a_fresh_interpreter(cmd, env):
    assert show([sys.executable, *cmd], env=dict(os.environ, **env))[0] == "False"


def test_a_run_past_its_timeout_is_killed_and_raises():
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        forkserver.run([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                       timeout=1.5)
    assert time.monotonic() - start < 30 and e.value.output == "started\n"


def test_popen_polls_waits_and_kills(tmp_path):
    out = open(tmp_path / "out", "w")
    proc = forkserver.popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                            stdout=out, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    assert isinstance(proc, forkserver.ForkedProcess)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM and proc.poll() == -signal.SIGTERM
    out.close()
    assert (tmp_path / "out").read_text() == "up\n"
