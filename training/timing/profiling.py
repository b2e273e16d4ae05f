"""Where a job left the GPU idle: an optional torch-profiler pass over each job, summarised.

``BATCHRL_PROFILE_JOBS=DIR`` (in the environment the jobs run in: set it before ``batchrl run`` or the UI
starts) profiles every job (``run_job``) with ``torch.profiler`` (CPU ops, and CUDA kernels on a GPU host)
and writes ``DIR/<job>[-<task>]-<pid>-<n>.json``:

- ``wall_s``, ``gpu_busy_s`` (the union of kernel, memcpy and memset intervals), ``gpu_busy_pct``;
- ``phases``: each ``phase`` of the job (``training/timing/phases.py``, annotated while profiling) with its wall
  and GPU-busy seconds;
- ``gaps``: the longest stretches with no GPU work (offset, length, the phases around it, the CPU ops the
  host ran meanwhile) — what to take off the GPU's critical path;
- ``kernels``: the kernels with the most GPU time (count, total ms).

``BATCHRL_PROFILE_TRACE=1`` also keeps the Chrome trace (``.trace.json``: large, open it in Perfetto). Off
by default: profiling costs host time and its kernels-per-second ceiling hides small gaps. Not for CI timing.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import tempfile
from typing import Any, Iterator

from batchrl.common.environment_variables import read

ENV = "BATCHRL_PROFILE_JOBS"
TRACE_ENV = "BATCHRL_PROFILE_TRACE"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
TOP = 15
_COUNTER = itertools.count()


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of ``(start, end)`` intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(union: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of ``[start, end]`` inside the merged intervals ``union``."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


def summarize(events: list[dict[str, Any]], *, top: int = TOP) -> dict[str, Any]:
    """The summary above from Chrome-trace events (``ph == "X"``: ``ts``/``dur`` in microseconds, ``cat``)."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if not spans:
        return {"wall_s": 0.0, "gpu_busy_s": 0.0, "gpu_busy_pct": 0.0, "phases": {}, "gaps": [], "kernels": []}
    origin = min(float(e["ts"]) for e in spans)
    end = max(float(e["ts"]) + float(e["dur"]) for e in spans)
    gpu = [e for e in spans if e.get("cat") in GPU_CATEGORIES]
    busy = merged([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu])
    phases = [e for e in spans if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("phase/")]
    by_phase: dict[str, dict[str, float]] = {}
    for e in phases:
        start, stop = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        row = by_phase.setdefault(e["name"][len("phase/"):], {"wall_s": 0.0, "gpu_busy_s": 0.0})
        row["wall_s"] += (stop - start) / 1e6
        row["gpu_busy_s"] += covered(busy, start, stop) / 1e6
    idle = [(a, b) for a, b in zip([origin] + [b for _, b in busy], [a for a, _ in busy] + [end]) if b > a]
    cpu_ops = [e for e in spans if e.get("cat") == "cpu_op"]
    gaps = []
    for a, b in sorted(idle, key=lambda gap: gap[0] - gap[1])[:top]:
        around = sorted({e["name"][len("phase/"):] for e in phases
                         if float(e["ts"]) < b and float(e["ts"]) + float(e["dur"]) > a})
        ops: dict[str, float] = {}
        for e in cpu_ops:
            inside = min(b, float(e["ts"]) + float(e["dur"])) - max(a, float(e["ts"]))
            if inside > 0:
                ops[e["name"]] = ops.get(e["name"], 0.0) + inside
        gaps.append({"at_s": round((a - origin) / 1e6, 4), "idle_ms": round((b - a) / 1e3, 2), "phases": around,
                     "cpu_ops_ms": {k: round(v / 1e3, 2) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:5]}})
    kernels: dict[str, list[float]] = {}
    for e in gpu:
        row = kernels.setdefault(str(e.get("name", "?"))[:100], [0, 0.0])
        row[0] += 1
        row[1] += float(e["dur"])
    wall, busy_s = (end - origin) / 1e6, sum(b - a for a, b in busy) / 1e6
    return {
        "wall_s": round(wall, 4), "gpu_busy_s": round(busy_s, 4),
        "gpu_busy_pct": round(100.0 * busy_s / wall, 1) if wall else 0.0,
        "gpu_idle_s_in_gaps_over_1ms": round(sum(b - a for a, b in idle if b - a > 1e3) / 1e6, 4),
        "phases": {k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in by_phase.items()},
        "gaps": gaps,
        "kernels": [{"name": k, "count": int(c), "total_ms": round(t / 1e3, 2)}
                    for k, (c, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]],
    }


@contextlib.contextmanager
def profiled(name: str) -> Iterator[None]:
    """Profile the block into ``$BATCHRL_PROFILE_JOBS/<name>-<pid>-<n>.json`` (nothing when unset)."""
    out_dir = read(ENV)
    if not out_dir:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    from batchrl.training.timing import phases

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    stem = os.path.join(out_dir, f"{name}-{os.getpid()}-{next(_COUNTER)}")
    os.makedirs(out_dir, exist_ok=True)
    with profile(activities=activities) as prof, phases.annotated():
        yield
    keep_trace = read(TRACE_ENV)
    if keep_trace:
        trace = f"{stem}.trace.json"
    else:
        with tempfile.NamedTemporaryFile(suffix=".json", dir=out_dir, delete=False) as scratch:
            trace = scratch.name
    prof.export_chrome_trace(trace)
    try:
        with open(trace) as f:
            summary = summarize(json.load(f).get("traceEvents", []))
    finally:
        if not keep_trace:
            os.unlink(trace)
    with open(f"{stem}.json", "w") as f:
        json.dump({"job": name, **summary}, f, indent=1)
