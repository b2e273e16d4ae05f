"""Where a job's wall time went: named phases, summed over repeats, reported as ``phase_s/<name>``.

A GPU job's idle parts (model loads, tokenisation, writes) are only visible if the job says how long
each took. Library code marks its parts with ``phase(name)``; that is a no-op unless a caller is
``recording()`` (the jobs are), so the functions stay usable anywhere. Times are host wall-clock: a
phase that ends with a device read-back includes the device work it waited for.
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Callable, Iterator, TypeVar

T, M = TypeVar("T"), TypeVar("M")


class PhaseClock:
    """Seconds per named phase since ``started``; ``other`` is the rest of the wall time. A phase inside
    another counts for itself only (its time is taken out of the enclosing one), so phases add up."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self._inner_s: list[float] = []  # per open phase: the time of the phases inside it so far

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        self._inner_s.append(0.0)
        try:
            with _annotation(name):
                yield
        finally:
            took = time.perf_counter() - started
            self.add(name, took - self._inner_s.pop())
            if self._inner_s:
                self._inner_s[-1] += took

    def summary(self) -> dict[str, float]:
        total = time.perf_counter() - self.started
        out = dict(self.seconds)
        out["other"] = max(0.0, total - sum(self.seconds.values()))
        return {k: round(v, 3) for k, v in out.items()}


_ACTIVE: contextvars.ContextVar[PhaseClock | None] = contextvars.ContextVar("batchrl_phase_clock", default=None)
_ANNOTATED = contextvars.ContextVar("batchrl_phase_annotated", default=False)


@contextlib.contextmanager
def annotated() -> Iterator[None]:
    """While a job is profiled (``training/timing/profiling.py``): each phase is also a ``phase/<name>`` range in the
    profiler's trace, so its idle GPU stretches can be named."""
    token = _ANNOTATED.set(True)
    try:
        yield
    finally:
        _ANNOTATED.reset(token)


def _annotation(name: str) -> contextlib.AbstractContextManager:
    if not _ANNOTATED.get():
        return contextlib.nullcontext()
    import torch

    return torch.profiler.record_function(f"phase/{name}")


@contextlib.contextmanager
def recording(clock: PhaseClock | None = None) -> Iterator[PhaseClock]:
    """Make ``clock`` (default: a fresh one) the one ``phase`` records into, for the duration of the block: a
    library phase (a model's load) inside one of a job's own phases is then timed apart and taken out of it."""
    clock = clock if clock is not None else PhaseClock()
    token = _ACTIVE.set(clock)
    try:
        yield clock
    finally:
        _ACTIVE.reset(token)


def phase(name: str) -> contextlib.AbstractContextManager:
    """Time the block into the active clock's ``name`` (nothing when no one is recording)."""
    clock = _ACTIVE.get()
    return clock.phase(name) if clock is not None else contextlib.nullcontext()


def beside_load(work: Callable[[], T], load: Callable[[], M], name: str = "tokenise") -> tuple[M, T]:
    """``(load(), work())`` with ``work`` on a thread while ``load`` runs here: tokenising while a model loads
    (a fast tokenizer's batch call releases the GIL and spreads over the cores). The ``name`` phase is what
    remains of ``work`` once the load is done; a phase inside ``work`` is not recorded (another thread)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix=name) as pool:
        pending = pool.submit(work)
        loaded = load()
        with phase(name):
            return loaded, pending.result()
