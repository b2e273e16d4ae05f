"""A Ray job's Pipes messages through the storage root, not through Ray's job logs.

dagster-ray's default reader follows the Ray job's log through the dashboard, which polls the driver's log once a
second and tells the end of a job from a status loop of its own (another second): measured on the dev box, a job's
last messages reached the Dagster step ~5.5 s after its driver had exited, on every job (bench/RESULTS.md, issue 49).
Here the driver (``resources/ray_driver.py``) still prints rank 0's lines to its log, and also writes them in
numbered chunks (``<job prefix>/messages/<n>.jsonl``, one atomic write each, every ``CHUNK_INTERVAL_S``) that
``ray_launch.StorageMessageReader`` (a ``dg.PipesMessageReader`` with a reader thread of its own) reads in order;
the session ends with the job's ``closed`` message, read in the last chunk as soon as the job is over. The job
itself still writes its messages to stdout, as under dagster-ray's reader; lines that are not Pipes messages go to
the step's stdout.
"""
from __future__ import annotations

import threading

from batchrl.common import fsutil

CHUNK_INTERVAL_S = 0.2
POLL_S = 0.1  # how often the Dagster side asks for the next chunk
PIPES_MESSAGE_PREFIX = '{"__dagster_pipes_version"'  # how a Pipes message line starts


def chunk_path(base: str, index: int) -> str:
    return fsutil.join(base, f"{index}.jsonl")


class ChunkWriter:
    """The driver's side: ``emit`` prints a line and queues it; a thread writes what is queued as the next chunk
    every ``CHUNK_INTERVAL_S``; ``close`` writes the rest."""

    def __init__(self, uri: str, storage_options: dict):
        self.fs, self.base = fsutil.filesystem_for(uri, storage_options)
        self.index, self.pending, self.lock = 0, [], threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def emit(self, line: str) -> None:
        print(line, flush=True)  # the Ray job's log keeps every line too
        with self.lock:
            self.pending.append(line)

    def _flush(self) -> None:
        with self.lock:
            lines, self.pending = self.pending, []
            if lines:
                self.index += 1
                fsutil.atomic_write_bytes(self.fs, chunk_path(self.base, self.index), "\n".join(lines).encode())

    def _loop(self) -> None:
        while not self.stopped.wait(CHUNK_INTERVAL_S):
            self._flush()

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self._flush()
