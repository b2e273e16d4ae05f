"""A process's output sent to a log file: its stdout/stderr file descriptors are pointed at the file, so the
libraries' output and the child processes' (trainers, the step server) follow."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import IO, Iterator

# set by a command that already sends its runs' output where it wants (`batchrl run`: its log file, or the console
# with -v): the executor's run log (runs/run_log.py) leaves it alone
OUTPUT_ROUTED_ENV = "BATCHRL_OUTPUT_ROUTED"


@contextlib.contextmanager
def output_to_log(log_path: str) -> Iterator[IO[str]]:
    """Send fd 1 and 2 (this process and its children) to ``log_path``; yield a stream to the terminal."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    terminal = os.fdopen(os.dup(saved_out), "w", buffering=1)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    try:
        yield terminal
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        for fd in (saved_out, saved_err, log_fd):
            os.close(fd)
        terminal.close()
