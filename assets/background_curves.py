"""The per-step chart drawn while the training job still runs, so the RL loop does not wait for matplotlib.

A chart of a dozen panels takes matplotlib 0.4-0.7 s on the dev box and more on the GPU host, on the critical path
of every RL iteration when drawn after the job (issue 32: an iteration is ~7-10 s). The job writes each step's
record to ``steps.jsonl`` as it goes; a thread of the step's process draws the chart of the records there each time
the file has grown, while the process itself only waits for the job. The last step's record is written before the
job exports, hashes and reports its model (~1 s on the GPU host), so the final chart is usually drawn by the time
the job returns; ``metadata`` uses it when its series are exactly the ones to show, and draws them otherwise.
"""
from __future__ import annotations

import json
import os
import threading

import dagster as dg

from batchrl.assets.curves import Series, curve_metadata, read_steps, step_series
from batchrl.training.jobs._runtime import STEPS_FILE

POLL_S = 0.05  # the final chart starts at most this long after the last step is written


def _fingerprint(series: Series) -> str:
    return json.dumps(series, sort_keys=True)


class BackgroundCurves:
    """``with BackgroundCurves(workdir) as curves: run the job``; then ``curves.metadata(series)``."""

    def __init__(self, workdir: str) -> None:
        self.path = os.path.join(workdir, STEPS_FILE)
        self.workdir = workdir
        self._stop = threading.Event()
        self._drawn: tuple[str, dict[str, dg.MetadataValue]] | None = None  # (series fingerprint, metadata)
        self._thread = threading.Thread(target=self._draw_while_running, name="batchrl-curves", daemon=True)

    def __enter__(self) -> "BackgroundCurves":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _file_state(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_size, st.st_mtime_ns

    def _draw_while_running(self) -> None:
        drawn_state = None
        while not self._stop.wait(POLL_S):
            state = self._file_state()
            if state is None or state == drawn_state:
                continue
            try:
                series = step_series(read_steps(self.workdir))
            except ValueError:  # a line half written: read it again at the next poll
                continue
            drawn_state = state
            if series:
                self._drawn = (_fingerprint(series), curve_metadata(series))

    def metadata(self, series: Series) -> dict[str, dg.MetadataValue]:
        """The curves' metadata of ``series`` (``curves.curve_metadata``): the one drawn in the background when it
        shows these very series, else drawn now. Call after the job and the ``with`` block have ended."""
        drawn = self._drawn
        if drawn is not None and drawn[0] == _fingerprint(series):
            return drawn[1]
        return curve_metadata(series)
