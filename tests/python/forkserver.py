"""Python processes for the interop tests, forked from one interpreter that has imported torch already.

About 300 of the suite's processes are Python scripts that import torch with torch.distributed, FSDP
and DCP: ~4.5 s of CPU each on the 2-core CI machine before the script's first line, close to half
of the suite's time. Each pytest worker starts one server (this file, `--serve`) that imports those
modules once; a script run through `popen` or `run` is then a fork of it that sets up what a fresh
`python script.py args` has (argv, sys.path with the script's folder and PYTHONPATH, environment,
working directory, stdin/stdout/stderr, a new `__main__`), runs the script, and ends as an
interpreter does (non-daemon threads joined, atexit handlers, buffers flushed). What a script tests
is the same torch; only the import is shared.

A command runs in a fresh interpreter (subprocess.Popen) instead where a fork could behave otherwise:
- it is not `<this python> script|-c code|-m module [args]` (other interpreters, any options);
- its environment differs from the server's in a variable outside RUNTIME_ENV: one that something
  already imported may have read (TORCH_*, LD_PRELOAD, OMP_* but OMP_NUM_THREADS, which is applied
  with torch.set_num_threads as libgomp would have at start, ...);
- OPTSTATE_TEST_FORKSERVER=0 is set: every process fresh, to settle a doubt.
Preimported are only modules whose import reads no per-run setting; torchao, deepspeed and optstate
are not among them (a test checks that a process never imported torchao; optstate reads
OPTSTATE_OPS_LIBRARY as it loads). Unlike a fresh interpreter, forked ones share the server's
PYTHONHASHSEED, stdin defaults to /dev/null, and the objects the imports made are frozen out of the
garbage collector (gc.freeze: a child's collections, and its exit, skip them; the exit of a child
that has torch takes 0.3 s instead of 1.2 s).

Protocol (one Unix-socket connection per process): the client sends an 8-byte length with the
child's stdin, stdout and stderr descriptors (SCM_RIGHTS), then that many bytes of JSON {argv, cwd,
env}; the server forks, answers "<pid>\\n", and once it has reaped the child "exit <code>\\n" (a
negative code for a signal, as subprocess gives)."""
import atexit
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

PREIMPORTED = ["numpy", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
               "torch.distributed.tensor"]

# Variables a request may set differently from the server: read at run time (rendezvous, our own
# OPTSTATE_* switches, pytest's bookkeeping), by modules the server has not imported (DS_*), or
# applied in the child (OMP_NUM_THREADS, PYTHONPATH).
RUNTIME_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH",
               "OMP_NUM_THREADS", "PYTEST_CURRENT_TEST"}
RUNTIME_ENV_PREFIXES = ("OPTSTATE_", "DS_")


def _runtime_only(name):
    return name in RUNTIME_ENV or name.startswith(RUNTIME_ENV_PREFIXES)


# ---------------------------------------------------------------------------------------------- server

def _recv_exact(conn, n):
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise EOFError("client closed the connection mid-request")
        data += part
    return data


def _serve(path):
    """The server loop. Returns only in a forked child, with that child's request and descriptors."""
    for name in PREIMPORTED:
        __import__(name)
    import gc
    gc.freeze()  # see the docstring: children do not walk the imported modules' objects again
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # the client reads one line; later output of ours must not block on that pipe
    os.close(devnull)
    children = {}  # pid -> connection to its client
    while True:
        readable, _, _ = select.select([listener, 0], [], [], 0.05)
        if 0 in readable and not os.read(0, 1):
            break  # the client (a pytest worker) has gone
        if listener in readable:
            conn, _ = listener.accept()
            fds = []
            try:
                header, fds, _, _ = socket.recv_fds(conn, 8, 3)
                if len(fds) != 3:
                    raise ValueError(f"{len(fds)} descriptors, not stdin, stdout and stderr")
                request = json.loads(_recv_exact(conn, struct.unpack("<Q", header)[0]))
            except (OSError, EOFError, ValueError, struct.error) as e:
                print(f"forkserver: bad request: {e}", file=sys.stderr, flush=True)
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for c in [conn, *children.values()]:
                    c.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the client stopped listening
                conn.close()
    listener.close()
    os.unlink(path)
    sys.exit(0)


def _become(request, fds, server_env, server_path):
    """In the forked child: the state a fresh `python argv...` would start with."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS") != server_env.get("OMP_NUM_THREADS"):
        import torch
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # as libgomp reads it when it loads
    child_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in server_path]
    argv = request["argv"][1:]
    if argv[0] == "-c":
        first = ""
    elif argv[0] == "-m":
        first = os.getcwd()
    else:
        first = os.path.dirname(os.path.realpath(argv[0]))
    sys.path[:] = [first, *child_path, *base]
    return argv


def _run_main(argv):
    """Runs argv as CPython's main does (module __main__, sys.argv); exceptions and SystemExit
    propagate to the interpreter, which prints and exits as it would."""
    import runpy
    import types
    if argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]
        runpy._run_module_as_main(argv[1], alter_argv=True)  # what `python -m` itself calls
        return
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        code = compile(argv[1], "<string>", "exec")
    else:
        sys.argv = list(argv)
        main.__file__ = argv[0]
        main.__cached__ = None
        try:
            with open(argv[0], "rb") as f:
                source = f.read()
        except OSError as e:  # as CPython says it, with its exit code
            print(f"{sys.executable}: can't open file {os.path.abspath(argv[0])!r}: [Errno {e.errno}] {e.strerror}",
                  file=sys.stderr)
            sys.exit(2)
        code = compile(source, argv[0], "exec")
    exec(code, main.__dict__)


# ---------------------------------------------------------------------------------------------- client

def enabled(env=None):
    """False where OPTSTATE_TEST_FORKSERVER=0 is set here or in the command's environment."""
    return all(e.get("OPTSTATE_TEST_FORKSERVER", "1") != "0" for e in (os.environ, env or {}))


def _forkable(cmd, env):
    if len(cmd) < 2 or str(cmd[0]) != sys.executable:
        return False
    first = str(cmd[1])
    if first in ("-c", "-m"):
        if len(cmd) < 3:
            return False
    elif first.startswith("-"):
        return False
    server_env = _Server.env()
    omp, server_omp = env.get("OMP_NUM_THREADS"), server_env.get("OMP_NUM_THREADS")
    if omp != server_omp and not ((omp or "").isdigit() and int(omp) > 0):
        return False  # removed (the server's libgomp has read it) or not a count torch.set_num_threads takes
    changed = {k for k in env.keys() | server_env.keys() if env.get(k) != server_env.get(k)}
    return all(_runtime_only(k) for k in changed)


class _Server:
    lock = threading.Lock()
    proc = None
    path = None
    started_env = None

    @classmethod
    def env(cls):
        return cls.started_env if cls.started_env is not None else dict(os.environ)

    @classmethod
    def get(cls):
        with cls.lock:
            if cls.proc is not None and cls.proc.poll() is None:
                return cls.path
            folder = tempfile.mkdtemp(prefix="forkserver-")
            atexit.register(cls.stop, folder)
            cls.path = os.path.join(folder, "socket")
            cls.started_env = dict(os.environ)
            log = open(os.path.join(folder, "server.err"), "w+")
            cls.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", cls.path],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                        env=cls.started_env)
            ready, _, _ = select.select([cls.proc.stdout], [], [], 300)
            line = cls.proc.stdout.readline() if ready else b""
            if line != b"ready\n":
                cls.proc.kill()
                log.seek(0)
                raise RuntimeError(f"the test fork server did not start: {line!r}\n{log.read()[-3000:]}")
            return cls.path

    @classmethod
    def stop(cls, folder):
        """At the worker's exit: the server sees its stdin close and ends; then its folder goes."""
        if cls.proc is not None and cls.proc.poll() is None:
            cls.proc.stdin.close()
            try:
                cls.proc.wait(10)
            except subprocess.TimeoutExpired:
                cls.proc.kill()
        shutil.rmtree(folder, ignore_errors=True)


def _fileno(f, mode):
    if f is None:
        return os.dup({"r": 0, "w": 1, "e": 2}[mode]), True
    if f == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDONLY if mode == "r" else os.O_WRONLY), True
    return (f if isinstance(f, int) else f.fileno()), False


class ForkedProcess:
    """What subprocess.Popen gives for the parts the tests use: pid, returncode, poll, wait, kill."""

    def __init__(self, args, conn):
        self.args = args
        self._conn = conn
        self._buffer = b""
        self.returncode = None
        while b"\n" not in self._buffer:
            self._receive(None)
        line, self._buffer = self._buffer.split(b"\n", 1)
        self.pid = int(line)

    def _receive(self, timeout):
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return False
        data = self._conn.recv(4096)
        if not data:
            raise RuntimeError(f"the test fork server went away while running {self.args}")
        self._buffer += data
        return True

    def _status(self):
        if self.returncode is None and b"\n" in self._buffer:
            line = self._buffer.split(b"\n", 1)[0].decode()
            self.returncode = int(line.split()[1])
            self._conn.close()
        return self.returncode

    def poll(self):
        while self._status() is None and self._receive(0):
            pass
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._status() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._receive(left)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)


def popen(cmd, *, cwd=None, env=None, stdin=None, stdout=None, stderr=None):
    """subprocess.Popen(cmd, ...) for a Python command: forked from the server where that is the same
    (see the module's docstring), else a fresh process."""
    cmd = [str(c) for c in cmd]
    env = dict(os.environ if env is None else env)
    if not (enabled(env) and _forkable(cmd, env)):
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr)
    path = _Server.get()
    fds = [_fileno(stdin if stdin is not None else subprocess.DEVNULL, "r"), _fileno(stdout, "w"),
           _fileno(stderr, "e")]
    request = json.dumps({"argv": cmd, "cwd": os.path.abspath(cwd or os.getcwd()), "env": env}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        socket.send_fds(conn, [struct.pack("<Q", len(request))], [fd for fd, _ in fds])
        conn.sendall(request)
        return ForkedProcess(cmd, conn)
    except BaseException:
        conn.close()
        raise
    finally:
        for fd, owned in fds:
            if owned:
                os.close(fd)


def run(cmd, *, timeout=None, cwd=None, env=None):
    """subprocess.run(cmd, capture_output=True, text=True, timeout=..., ...) through `popen`."""
    cmd = [str(c) for c in cmd]
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = popen(cmd, cwd=cwd, env=env, stdout=out_w, stderr=err_w)
    except BaseException:
        for fd in (out_r, err_r):
            os.close(fd)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    chunks = {out_r: [], err_r: []}
    deadline = None if timeout is None else time.monotonic() + timeout
    open_fds, timed_out = [out_r, err_r], False
    while open_fds:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select(open_fds, [], [], left)
        if not ready:
            timed_out = True
            break
        for fd in ready:
            data = os.read(fd, 65536)
            if data:
                chunks[fd].append(data)
            else:
                open_fds.remove(fd)
    for fd in (out_r, err_r):
        os.close(fd)
    out, err = (b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r))
    if timed_out:
        proc.kill()
        proc.wait()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
    proc.wait(None if deadline is None else max(1.0, deadline - time.monotonic()))
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--serve":
    server_env = dict(os.environ)
    server_path = [p for p in server_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[0] = ""  # this file's folder is no part of a child's path; each child puts its own first
    request, fds = _serve(sys.argv[2])
    _run_main(_become(request, fds, server_env, server_path))
