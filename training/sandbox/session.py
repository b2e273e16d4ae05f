"""One sandboxed interpreter kept for a trajectory: its cells share state without replaying the earlier ones.

The interpreter starts at the trajectory's first call and is killed, its scratch dir removed, by ``close()`` when the
trajectory ends. Cells travel on a control pipe (the model's ``input()`` reads an empty stdin, as in a fresh
process); after a cell the interpreter writes an end marker (a per-cell random token) on stdout and stderr and the
exit code on the control pipe. A cell that runs past ``timeout_s`` or floods past ``max_output_bytes`` kills the
interpreter (as the one-shot sandbox does); so does one that exits the process itself (``os._exit``). The next call
then starts a fresh interpreter and replays the kept cells silently first (the one-shot replay's cost, paid only
after such a fault). Model code can write the current cell's marker itself: that garbles only its own observation.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import struct
import tempfile
import time

from batchrl.training.sandbox import SandboxResult, kill
from batchrl.training.sandbox.launch import SandboxLimits, start
from batchrl.training.sandbox.streams import Stream, pump


def _exit_code(reply: Stream) -> int | None:
    """The cell's exit code from the interpreter's reply line; None when it died without one."""
    line = bytes(reply.buf).split(b"\n")[0].strip()
    return int(json.loads(line)["exit"]) if line else None


class PythonSandbox:
    """``run(code, name)`` runs one cell in this trajectory's interpreter; ``close()`` ends it."""

    def __init__(self, level: str, limits: SandboxLimits) -> None:
        self.level, self.limits = level, limits
        self.proc = None
        self.scratch: str | None = None
        self.kept: list[tuple[str, str]] = []  # (cell, name) run without a fault: replayed after a restart

    def start(self) -> None:
        """Start the interpreter now (it boots while the caller goes on: the trajectory's first turn is generated
        meanwhile); ``run`` starts it itself when needed."""
        self.scratch = self.scratch or tempfile.mkdtemp(prefix="batchrl-sandbox-")
        to_child, self._control = os.pipe()
        self._replies, from_child = os.pipe()
        try:
            self.proc = start(self.level, self.scratch, self.limits, "serve", pass_fds=(to_child, from_child),
                              control=(to_child, from_child))
        finally:
            os.close(to_child)
            os.close(from_child)
        self.proc.stdin.close()
        for cell, name in self.kept:
            self._send({"cell": cell, "name": name, "silent": True, "token": secrets.token_hex(8)})

    def _send(self, message: dict) -> None:
        body = json.dumps(message).encode()
        os.write(self._control, struct.pack("I", len(body)) + body)

    def run(self, code: str, name: str) -> SandboxResult:
        """Run ``code`` as cell ``name`` (its traceback's file name); never raises for anything the code does."""
        started = time.monotonic()
        if self.proc is None:
            self.start()
        token = secrets.token_hex(8)
        marker = b"\0" + token.encode() + b"\0"
        out = Stream(self.proc.stdout.fileno(), self.limits.max_output_bytes, marker)
        err = Stream(self.proc.stderr.fileno(), self.limits.max_output_bytes, marker)
        reply = Stream(self._replies, 1 << 16, b"\n")
        try:
            self._send({"cell": code, "name": name, "token": token})
        except OSError:  # the interpreter is gone (the next call starts another)
            pass
        outcome = pump([out, err, reply], started + self.limits.timeout_s)
        exit_code = _exit_code(reply) if outcome == "done" else None
        if outcome != "done" or exit_code is None:
            exit_code = self._stop(outcome)
        if outcome == "done":
            self.kept.append((code, name))
        return SandboxResult(exit_code, out.text(), err.text(), outcome == "timeout", self.level,
                             time.monotonic() - started, output_truncated=outcome == "over")

    def _stop(self, outcome: str) -> int | None:
        """Kill the interpreter after a fault; the code the caller sees (the process's exit status when it exited
        itself, -9 when killed for a flood, None on a timeout)."""
        proc, self.proc = self.proc, None
        if outcome == "done":  # it exited in the cell (os._exit): its own status
            try:
                proc.wait(timeout=1.0)
            except Exception:  # noqa: BLE001 - still running: killed below
                pass
        kill(proc)
        self._close_pipes()
        if outcome == "timeout":
            return None
        return -9 if outcome == "over" else proc.returncode

    def _close_pipes(self) -> None:
        for fd in (getattr(self, "_control", None), getattr(self, "_replies", None)):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._control = self._replies = None

    def close(self) -> None:
        """Kill the interpreter and remove its scratch dir (the trajectory is over)."""
        if self.proc is not None:
            kill(self.proc)
            self.proc = None
        self._close_pipes()
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
