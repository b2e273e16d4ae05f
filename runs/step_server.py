"""The server that the step processes of a multiprocess run fork from (``definitions.step_executor``: runs
from the UI, the daemon, or ``batchrl run --concurrent-steps``). It imports ``batchrl.runs.step_preload`` once per
run; a spawned interpreter per step, Dagster's default, paid those imports in every step (dev box: 2.9 s for
Dagster and the definitions, 6.8 s with torch). Light to import: the run's own process starts it first thing.

In a command that the warm command server (``cli.warm_server``) forked, the step server is a fork of the command's
process too (``fork_step_server``), so the first step no longer waits for a second interpreter's imports."""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import socket
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported here: the run's own process starts this server before it imports Dagster
    import dagster as dg

PRELOAD = ["batchrl.runs.step_preload"]
STARTED_ENV = "BATCHRL_STEP_SERVER_STARTED"

# set in a command forked from the warm server (``mark_warm_command``): its connection to the client, which a
# forked step server must not keep open
_warm_command_connection: socket.socket | None = None
_forked_from_warm_server = False


def start(log_path: str | None = None) -> None:
    """Start the server now, so that its imports overlap the run's own start-up and per-drop runs instead of
    delaying the first step; ``log_path``: its output, and so its step processes', goes there (the run's log)."""
    from batchrl.common.log_file import output_to_log

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    os.environ[STARTED_ENV] = f"{time.time():.3f}"  # the server says when its preload was done (step_preload)
    with output_to_log(log_path) if log_path else contextlib.nullcontext():
        if not fork_step_server():  # a command of the warm server forks it: no imports to wait for
            multiprocessing.forkserver.ensure_running()  # the server keeps the fds it starts with


def mark_warm_command(connection: socket.socket) -> None:
    """This process is a command forked from the warm server, answering its client over ``connection``."""
    global _warm_command_connection, _forked_from_warm_server
    _warm_command_connection, _forked_from_warm_server = connection, True


def forked_from_warm_server() -> bool:
    return _forked_from_warm_server


def fork_step_server() -> bool:
    """In a command forked from the warm server: start multiprocessing's fork server (the multiprocess executor's
    step processes fork from it) as a fork of this process, which has every module the steps need; its step
    preload runs again for this command's environment. False elsewhere (the caller starts a fresh one)."""
    import threading

    # a fork copies no other thread, nor what one was holding
    if not forked_from_warm_server() or threading.active_count() > 1:
        return False
    import importlib
    import inspect
    from multiprocessing import connection, forkserver, resource_tracker

    if set(inspect.signature(forkserver.main).parameters) - {"listener_fd", "alive_r", "preload", "main_path",
                                                              "sys_path"}:
        return False  # a fork server protocol this code does not know (Python 3.14 adds an auth key): spawn it
    server = forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is not None:
            return True
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(alive_w)
                    if _warm_command_connection is not None:
                        _warm_command_connection.close()
                    for name in ("batchrl.runs.step_preload", "batchrl.definitions"):
                        sys.modules.pop(name, None)
                    importlib.import_module("batchrl.runs.step_preload")
                    forkserver.main(listener.fileno(), alive_r, [])
                finally:
                    os._exit(0)
            os.close(alive_r)
            server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def steps_run_models(definitions: dg.Definitions) -> bool:
    """Whether a step process runs model code itself (rollouts or model inference in process, the CPU
    environments), so the step server preloads torch for it; on the GPU host every model stage is a job and
    torch stays out of the step processes (its import held the first steps back: bench/RESULTS.md)."""
    resources = definitions.resources
    return not (resources["rollout_engine"].in_subprocess and resources["compute"].in_subprocess)
