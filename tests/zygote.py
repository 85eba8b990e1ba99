"""Commands the tests run (`holotrain ...`, torchrun), each forked from one process that has imported them already.

A fresh `python -m holotrain.cli` spends seconds importing torch and holotrain before it reads its first option, and
the suite starts hundreds of them. The server below imports them once; each command is a child forked from it: a
process of its own (its own pid, environment, working directory, stdin/stdout/stderr, signals, threads and exit
status) that runs the module as `python -m` does, from `if __name__ == "__main__"` on, and exits through the
interpreter's ordinary shutdown (atexit, joining threads, flushing output). What it skips is Python's start-up and
the imports; tests of those (the README's commands, a Ctrl-C during start-up) launch real processes.

    python -m tests.zygote serve SOCKET    the server (conftest starts one per test process)
    python tests/zygote.py -m MODULE ...   a client: what torchrun starts as a rank when a test runs torchrun here.
                                           It has the server fork `python -m MODULE ...` with the client's own
                                           environment and stdio, passes on the signals it gets, and exits as the
                                           child did (its code, or killed by the same signal).

A child whose client goes away (a test that gave up on it, a rank torchrun SIGKILLed) is SIGKILLed by the server.
This file imports nothing heavy at the top: the client is a light process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

ENV = "HOLOTRAIN_TEST_ZYGOTE"  # the server's socket, for clients started by torchrun
# What `holotrain train` and torchrun import, loaded once in the server (none of them starts a thread on import).
PRELOAD = ("torch", "numpy", "tokenizers", "safetensors", "holotrain.cli", "holotrain.config", "holotrain.train",
           "holotrain.train.trainer", "holotrain.export", "holotrain.generate", "holotrain.plan.planner",
           "holotrain.data.plane", "holotrain.data.worker", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch.distributed.run", "torch.distributed.pipelining", "torch._dynamo",
           "torch.utils.checkpoint", "holotrain.profile.report", "tomli_w", "torch.utils.tensorboard")
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


# ------------------------------------------------------------------------------------------------------------------
# Client side


def _request(path: str, argv: list[str], env: dict, cwd: str, fds: tuple[int, int, int],
             unbuffered: bool) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    header = json.dumps({"argv": argv, "env": env, "cwd": cwd, "unbuffered": unbuffered}).encode()
    socket.send_fds(conn, [len(header).to_bytes(8, "little") + header], list(fds))
    return conn


class _Replies:
    """The server's lines on one connection: `pid N`, then `exit CODE` (CODE as Popen.returncode: -N for a signal)."""

    def __init__(self, conn: socket.socket):
        self.conn, self.buffer = conn, b""

    def line(self, timeout: float | None) -> str | None:
        self.conn.settimeout(timeout)
        while b"\n" not in self.buffer:
            try:
                data = self.conn.recv(4096)
            except (socket.timeout, BlockingIOError):
                return None
            if not data:
                raise ConnectionError("the test process server closed the connection")
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


class Launched:
    """A forked command, as much like subprocess.Popen as the tests use: pid, poll, wait, send_signal, kill."""

    def __init__(self, path: str, argv: list[str], env: dict, cwd: str, fds: tuple[int, int, int],
                 unbuffered: bool = False):
        self.args = argv
        self._conn = _request(path, argv, env, cwd, fds, unbuffered)
        self._replies = _Replies(self._conn)
        self.pid = int(self._replies.line(None).split()[1])
        self.returncode: int | None = None

    def _read_exit(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self._replies.line(timeout)
            if line is not None:
                self.returncode = int(line.split()[1])
                self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._read_exit(0)

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if self._read_exit(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def client(argv: list[str]) -> None:
    """Has the server fork `python <argv>` here (this process's environment, working directory and stdio), passes
    on the signals this process gets, and exits as the child did."""
    unbuffered = getattr(sys.stdout, "write_through", False)  # python -u, as torchrun starts a rank
    launched = Launched(os.environ[ENV], argv, dict(os.environ), os.getcwd(), (0, 1, 2), unbuffered)
    for sig in RELAYED:
        signal.signal(sig, lambda signum, _frame: launched.send_signal(signum))
    code = launched.wait()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# ------------------------------------------------------------------------------------------------------------------
# Server side


def serve(path: str) -> None:
    import importlib
    import select
    import threading

    for name in PRELOAD:
        importlib.import_module(name)
    assert threading.active_count() == 1, threading.enumerate()  # forking a process with other threads is unsafe

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD reaches the wakeup pipe
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}  # pid -> its client's connection
    while True:
        ready, _, _ = select.select([sys.stdin, listener, wake_r, *children.values()], [], [])
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):
            return  # the test process is gone
        if listener in ready:
            conn, _ = listener.accept()
            request, fds = _receive(conn)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for c in children.values():
                    c.close()
                _child(conn, request, fds, (wake_r, wake_w))  # never returns
            for fd in fds:
                os.close(fd)
            conn.sendall(f"pid {pid}\n".encode())
            children[pid] = conn
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        for pid, conn in list(children.items()):
            if conn in ready and pid in children:  # the client went away (no request ever sends more)
                try:
                    gone = not conn.recv(1)
                except OSError:
                    gone = True
                if gone:
                    _kill(pid)
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
                    pass
                conn.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    size = int.from_bytes(data[:8], "little")
    data = data[8:]
    while len(data) < size:
        data += conn.recv(size - len(data))
    return json.loads(data), fds


def _child(conn: socket.socket, request: dict, fds: list[int], wake: tuple[int, int]) -> None:
    """In the forked child: become the requested command, then leave through the interpreter's shutdown."""
    import io
    import runpy

    try:
        signal.set_wakeup_fd(-1)
        for fd in wake:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        conn.close()  # the server keeps its copy: it reports this process's exit
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "OMP_NUM_THREADS" in os.environ:  # read by the OpenMP runtime when torch loaded, in the server
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        write_through = request["unbuffered"]
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                        write_through=write_through)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                                        line_buffering=True, write_through=write_through,
                                                        errors="backslashreplace")
        argv = request["argv"]
        if argv[0] == "-m":  # the working directory leads the module path, as `python -m` has it
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
        else:  # a script: its folder leads the module path, as `python SCRIPT` has it
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    except BaseException:  # noqa: BLE001 - nothing may return into the server's loop
        import traceback

        traceback.print_exc()
        os._exit(70)
    # As `python -m MODULE` or `python SCRIPT`: it runs as __main__; its SystemExit (or exception) ends this process
    # as it ends that one.
    if argv[0] == "-m":
        # Run from its source as __main__, as `python -m` does: the server's imported copy (loaded for what the module
        # imports) is not this process's module of that name until something imports it.
        sys.modules.pop(argv[1], None)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])
