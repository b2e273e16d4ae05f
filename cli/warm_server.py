"""A warm command server: ``batchrl serve`` keeps Dagster, the definitions' modules, pandas and the instance's
storage code imported, and each ``batchrl`` command that finds it runs in a fork of it instead of a fresh
interpreter — the imports were ~2.7 s of every command's start on the H200 host (bench/RESULTS.md), 40-65%
of a retrain's orchestration overhead. The multiprocess runs' step server is a fork of the command's process
too (``runs.step_server.fork_step_server``), so the first step no longer waits for a second interpreter's imports.

The command (``cli.main.console_main``) is a thin client (``warm_client``) while a server of its environment
answers: it passes its arguments, working dir, environment and its stdin/stdout/stderr (the descriptors
themselves, over the Unix socket), forwards Ctrl-C and termination to the forked child, and exits with the
child's status. The child takes the client's environment and working dir, rebuilds the code location from them
(``batchrl.definitions`` is imported again, as a fresh process would) and runs the command (``cli.main.main``,
handed to ``serve``): same output, same exit status, same runs.

A server serves the commands of its environment (``warm_client.server_key``); a command from another environment
runs in its own process as before. The server exits after ``--idle`` seconds without a command; ``batchrl serve
--stop`` ends it (commands running go on).
``BATCHRL_SERVER=off`` makes a command run in its own process even when a server answers.
"""
from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from typing import Callable

from batchrl.cli.warm_client import STREAMS, ping, socket_path, stop
from batchrl.common.dagster_internals import RUN_MODULES

DEFAULT_IDLE_S = 1800.0
Command = Callable[[list[str]], int]  # a command's argv -> its exit status (``cli.main.main``)

# what a command's process would import in its first seconds: Dagster, the definitions' modules (pandas, the
# assets, the resources), the instance's storage code and migration scripts (``step_preload``), the CLI and the
# run's executors
PRELOAD = ("batchrl.runs.step_preload", "batchrl.cli.main", "batchrl.cli.console", "batchrl.runs.execute",
           "batchrl.runs.run_config", "batchrl.resources.environments", "batchrl.resources.profiles",
           "batchrl.assets.run_rules", *RUN_MODULES, "multiprocessing.forkserver")


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)


def serve(run_command: Command, idle_s: float = DEFAULT_IDLE_S, path: str | None = None) -> int:
    """Preload, then fork one child per command, which runs ``run_command(argv)``, until ``idle_s`` pass without
    one (or a stop request)."""
    started = time.time()
    path = path or socket_path(dict(os.environ), os.getcwd())
    if ping(dict(os.environ), os.getcwd()) is not None:
        print(f"batchrl serve: a server already answers at {path}", file=sys.stderr)
        return 1
    _preload()
    import gc

    gc.freeze()  # the preloaded objects are never garbage: the commands' collections skip them, pages stay shared
    if os.path.exists(path):
        os.unlink(path)  # a server that died without removing it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)  # a child's exit wakes the loop
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, _terminated)
    print(f"batchrl serve: ready in {time.time() - started:.2f} s (pid {os.getpid()}, {path}); exits after "
          f"{idle_s:.0f} s without a command", flush=True)
    children: dict[int, tuple[socket.socket, list[str]]] = {}
    served, last = 0, time.monotonic()
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            selector.register(wake_r, selectors.EVENT_READ)
            while True:
                wait = None if children else idle_s - (time.monotonic() - last)
                if wait is not None and wait <= 0:
                    print(f"batchrl serve: {idle_s:.0f} s without a command, exiting", flush=True)
                    return 0
                for key, _ in selector.select(wait):
                    if key.fileobj is wake_r:
                        with contextlib.suppress(BlockingIOError):
                            while os.read(wake_r, 4096):
                                pass
                        _reap(children)
                        last = time.monotonic()
                        continue
                    conn, _ = listener.accept()
                    try:
                        request, fds = _receive(conn)
                    except (OSError, ValueError) as error:  # a client that sent no request, or a broken one
                        print(f"batchrl serve: a request could not be read ({error}); ignored", flush=True)
                        conn.close()
                        continue
                    if request.get("ping") or request.get("stop"):
                        conn.sendall(json.dumps({"pid": os.getpid(), "served": served, "running": len(children),
                                                 "since": started}).encode() + b"\n")
                        conn.close()
                        if request.get("stop"):
                            listener.close()  # no new command meanwhile: a client then runs in its own process
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(path)
                            _reap_ending(children, STOP_GRACE_S)
                            print("batchrl serve: stopped on request", flush=True)
                            return 0
                        continue
                    pid = os.fork()
                    if pid == 0:
                        try:  # never back into this loop: the child ends in _run_child (or here)
                            listener.close()
                            for fd in (wake_r, wake_w):
                                os.close(fd)
                            _run_child(conn, fds, request, run_command)
                        finally:
                            os._exit(1)
                    for fd in fds:
                        os.close(fd)
                    served += 1
                    children[pid] = (conn, request["argv"])
                    print(f"batchrl serve: `batchrl {' '.join(request['argv'])}` in process {pid}", flush=True)
    finally:
        listener.close()
        signal.set_wakeup_fd(-1)
        if os.path.exists(path):
            os.unlink(path)


STOP_GRACE_S = 5.0  # how long a stop waits for the exits of commands that are ending


def _terminated(signum, _frame) -> None:
    print(f"batchrl serve: {signal.Signals(signum).name} received, exiting (commands running go on)", flush=True)
    sys.exit(0)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request line and the descriptors sent with it (a command's come with its first bytes)."""
    conn.settimeout(30)  # the client sends its request right after connecting
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, STREAMS)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            break
        data += more
    try:
        return json.loads(data), list(fds)
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise


def _reap_ending(children: dict[int, tuple[socket.socket, list[str]]], grace_s: float) -> None:
    """Before the server stops: the exits of the commands that are ending, within ``grace_s`` (a command writes its
    own exit line to its client before its process is gone, so a client may ask for the stop first); commands
    still running after that go on without the server."""
    deadline = time.monotonic() + grace_s
    _reap(children)
    while children and time.monotonic() < deadline:
        time.sleep(0.05)
        _reap(children)


def _reap(children: dict[int, tuple[socket.socket, list[str]]]) -> None:
    """Exit statuses of the children that ended; the client takes the first ``exit`` line, so a child that died
    before writing its own (a signal, a crash) is still answered."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn, argv = children.pop(pid, (None, []))
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
        try:
            conn.sendall(f"exit {code}\n".encode())
        except OSError:
            pass  # the client is gone
        conn.close()
        print(f"batchrl serve: process {pid} (`batchrl {' '.join(argv)}`) exited {code}", flush=True)


def _stream(fd: int, encoding: str):
    import io

    raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
    if fd == 0:
        return io.TextIOWrapper(io.BufferedReader(raw), encoding=encoding)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding=encoding,
                            errors="backslashreplace" if fd == 2 else "strict",
                            line_buffering=fd == 2 or os.isatty(fd))  # as a fresh interpreter's streams


def _run_child(conn: socket.socket, fds: list[int], request: dict, run_command: Command) -> None:
    """The command in this forked child, as a fresh ``batchrl`` process would run it; never returns."""
    import atexit

    from batchrl.runs import step_server

    step_server.mark_warm_command(conn)  # its multiprocess runs fork their step server from this process
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        conn.sendall(f"pid {os.getpid()}\n".encode())
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        encoding = sys.__stdout__.encoding if sys.__stdout__ else "utf-8"
        sys.stdin, sys.stdout, sys.stderr = (_stream(fd, encoding) for fd in range(STREAMS))
        sys.argv = [request.get("argv0", sys.argv[0]), *request["argv"]]
        # the code location is built from this command's environment (and profile), as in a fresh process
        sys.modules.pop("batchrl.definitions", None)
        try:
            code = run_command(request["argv"])
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            if not isinstance(done.code, (int, type(None))):
                print(done.code, file=sys.stderr)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = 130
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        try:
            conn.sendall(f"exit {code}\n".encode())
        except OSError:
            pass
        os._exit(code)


# ---- `batchrl serve` ----------------------------------------------------------------------------------------

def add_command(sub, run_command: Command) -> None:
    """The ``serve`` subcommand; its server runs each command it is sent with ``run_command(argv)``."""
    serve_cmd = sub.add_parser("serve", help="keep a warm server for this environment: later batchrl commands "
                                             "run in forks of it, without the ~3 s of imports")
    serve_cmd.add_argument("--idle", type=float, default=DEFAULT_IDLE_S,
                           help=f"exit after this many seconds without a command (default {DEFAULT_IDLE_S:.0f})")
    serve_cmd.add_argument("--detach", action="store_true",
                           help="run in the background (output: DAGSTER_HOME/logs/server.log); returns once it "
                                "answers")
    serve_cmd.add_argument("--stop", action="store_true", help="stop this environment's server")
    serve_cmd.set_defaults(func=cmd_serve, run_command=run_command)


def cmd_serve(args) -> int:
    env, cwd = dict(os.environ), os.getcwd()  # the key: before anything sets a variable
    if args.stop:
        stopped = stop(env, cwd)
        print("batchrl serve: stopped" if stopped else "batchrl serve: no server for this environment")
        return 0 if stopped else 1
    if not args.detach:
        return serve(args.run_command, args.idle, socket_path(env, cwd))
    import subprocess

    home = os.path.abspath(env.get("DAGSTER_HOME") or ".dagster_home")
    os.makedirs(os.path.join(home, "logs"), exist_ok=True)
    log_path = os.path.join(home, "logs", "server.log")
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-c", "import sys; from batchrl.cli.main import main; "
                                    "sys.exit(main(sys.argv[1:]))", "serve", "--idle", str(args.idle)],
                                   env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # not in the terminal's process group: Ctrl-C spares it
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            print(f"batchrl serve: the server exited ({process.returncode}); see {log_path}", file=sys.stderr)
            return 1
        answer = ping(env, cwd)
        if answer is not None and answer["pid"] == process.pid:
            print(f"batchrl serve: ready (pid {process.pid}); output in {log_path}")
            return 0
        time.sleep(0.05)
    print(f"batchrl serve: no answer after 300 s; see {log_path}", file=sys.stderr)
    return 1
