"""Pipes messages from a job (subprocess or warm worker), every one of them read.

Dagster's file message reader tails the messages file with ``readline()`` and stops at the first empty read after
the session closed; it reads that flag *after* the empty read. When the job writes its last message (the
materialisation report that carries every statistic of the job) and the session closes between the two, the
reader stops with the message unread: the step then materialises without the job's metadata. Seen on the 2-core
box under load (a resident-loop test's rollouts lost ``engine_reused``). ``DrainingTempFileMessageReader`` reads
the flag first and the file second, so a message written before the session closed is always read.

The same tail also yields whatever ``readline()`` returns at the end of the file: a line the job is still writing
(a materialisation report of many kilobytes goes out in several ``write`` calls) comes back cut, ``json.loads``
fails, the reader thread dies and every later message is lost (seen in CI: a policy update materialised without
its ``loss_curve``). Here a line is yielded only once its newline has arrived.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import dagster as dg

FILE_NAME = "messages"
POLL_S = 0.01


def tail_until_closed(path: str, closed: Callable[[], bool]) -> Iterator[str]:
    """The lines appended to ``path`` until ``closed()`` and every line written before it became true, each whole
    (a line caught half-written is held until its newline comes; one cut for good, by a killed writer, is yielded
    last as it is, for the caller's parser to report)."""
    with open(path, encoding="utf-8") as stream:
        pending = ""
        while True:
            stop = closed()  # before the read: whatever was written before the close is read below
            chunk = stream.readline()
            if chunk:
                pending += chunk
                if pending.endswith("\n"):
                    yield pending
                    pending = ""
            elif stop:
                if pending:
                    yield pending
                return
            else:
                time.sleep(POLL_S)


class _DrainingFileMessageReader(dg.PipesFileMessageReader):
    def _reader_thread(self, handler, is_resource_complete) -> None:
        try:
            for line in tail_until_closed(self._path, is_resource_complete.is_set):
                handler.handle_message(json.loads(line))
        except:  # noqa: E722  (as Dagster's reader: reported to the step, then raised in the thread)
            handler.report_pipes_framework_exception(f"{type(self).__name__} reader thread", sys.exc_info())
            raise


class DrainingTempFileMessageReader(dg.PipesTempFileMessageReader):
    """``PipesTempFileMessageReader`` whose reader thread drains the file after the session closed."""

    @contextmanager
    def read_messages(self, handler) -> Iterator[dict]:
        with tempfile.TemporaryDirectory() as folder:
            with _DrainingFileMessageReader(os.path.join(folder, FILE_NAME),
                                            include_stdio_in_messages=self._include_stdio_in_messages
                                            ).read_messages(handler) as params:
                yield params
