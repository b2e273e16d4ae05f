"""The server that the step processes of a multiprocess run fork from (``definitions.step_executor``: runs
from the UI, the daemon, or ``batchrl run --concurrent-steps``). It imports ``batchrl.runs.step_preload`` once per
run; a spawned interpreter per step, Dagster's default, paid those imports in every step (dev box: 2.9 s for
Dagster and the definitions, 6.8 s with torch). Light to import: the run's own process starts it first thing."""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import time

PRELOAD = ["batchrl.runs.step_preload"]
STARTED_ENV = "BATCHRL_STEP_SERVER_STARTED"


def start(log_path: str | None = None) -> None:
    """Start the server now, so that its imports overlap the run's own start-up and per-drop runs instead of
    delaying the first step; ``log_path``: its output, and so its step processes', goes there (the run's log)."""
    from batchrl.cli import warm_server
    from batchrl.cli.console import output_to_log

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    os.environ[STARTED_ENV] = f"{time.time():.3f}"  # the server says when its preload was done (step_preload)
    with output_to_log(log_path) if log_path else contextlib.nullcontext():
        if not warm_server.fork_step_server():  # a command of the warm server forks it: no imports to wait for
            multiprocessing.forkserver.ensure_running()  # the server keeps the fds it starts with
