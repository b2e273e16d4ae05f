"""Reading a sandboxed process's output under a deadline and a byte cap, without threads.

A flood is cut at once (the process is killed as soon as a stream passes ``cut`` bytes), never held in memory until
the timeout; a stream is complete at its end of file or, for the persistent interpreter, at the end marker it writes
after each cell.
"""
from __future__ import annotations

import os
import selectors
import time
from typing import Any


class Stream:
    """One pipe's bytes for one run or cell: complete at EOF or at ``marker``; over when its payload passes ``cut``."""

    def __init__(self, fd: int, cut: int, marker: bytes | None = None) -> None:
        self.fd, self.cut, self.marker = fd, cut, marker
        self.buf = bytearray()
        self.eof = False

    def feed(self, data: bytes) -> None:
        self.eof = not data
        self.buf += data

    @property
    def _end(self) -> int:
        return -1 if self.marker is None else self.buf.find(self.marker)

    @property
    def complete(self) -> bool:
        return self.eof or self._end >= 0

    @property
    def over(self) -> bool:
        end = self._end
        if end >= 0:
            return end > self.cut
        return len(self.buf) > self.cut + len(self.marker or b"")

    def text(self) -> str:
        end = self._end
        payload = self.buf[:end] if end >= 0 else self.buf
        return bytes(payload[:self.cut]).decode(errors="replace")


def pump(streams: list[Stream], deadline: float, feed: tuple[Any, bytes] | None = None) -> str:
    """Read ``streams`` (and write ``feed``'s bytes to its file, closed when all are written) until all are
    complete (``done``), one passes its cap (``over``) or ``deadline`` (``timeout``)."""
    selector = selectors.DefaultSelector()
    for stream in streams:
        if not stream.complete:
            selector.register(stream.fd, selectors.EVENT_READ, stream)
    pending = feed[1] if feed and feed[1] else b""
    if pending:
        selector.register(feed[0].fileno(), selectors.EVENT_WRITE, None)
    try:
        while any(not s.complete for s in streams):
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            for key, _ in selector.select(left):
                if key.data is None:
                    pending = _write_some(feed[0], pending, selector)
                    continue
                key.data.feed(os.read(key.fd, 65536))
                if key.data.over:
                    return "over"
                if key.data.complete:
                    selector.unregister(key.fd)
        return "done"
    finally:
        selector.close()


def _write_some(file: Any, pending: bytes, selector) -> bytes:
    try:
        written = os.write(file.fileno(), pending[:4096])
    except OSError:  # the program exited without reading all of its stdin
        written = len(pending)
    pending = pending[written:]
    if not pending:
        selector.unregister(file.fileno())
        file.close()
    return pending
