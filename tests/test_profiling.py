"""BATCHRL_PROFILE_JOBS: a job's GPU-idle summary (the trace's arithmetic, and a real profiled job on CPU)."""
from __future__ import annotations

import json
import os

import pytest

from batchrl.training.timing import phases

from batchrl.training.timing import profiling


def _span(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_summary_counts_overlapping_kernels_once_and_names_the_gaps():
    events = [
        _span("user_annotation", "phase/load_model", 0, 4000),
        _span("user_annotation", "phase/logprobs", 4000, 6000),
        _span("cpu_op", "aten::to", 100, 3000),
        _span("kernel", "gemm", 4000, 3000), _span("kernel", "softmax", 5000, 3000),  # overlap: 4000..8000
        _span("gpu_memcpy", "Memcpy HtoD", 9000, 1000),
    ]
    summary = profiling.summarize(events)
    assert summary["wall_s"] == pytest.approx(0.010) and summary["gpu_busy_s"] == pytest.approx(0.005)
    assert summary["gpu_busy_pct"] == pytest.approx(50.0)
    assert summary["phases"]["logprobs"] == {"wall_s": pytest.approx(0.006), "gpu_busy_s": pytest.approx(0.005)}
    assert summary["phases"]["load_model"]["gpu_busy_s"] == 0.0
    first, second = summary["gaps"]
    assert (first["at_s"], first["idle_ms"], first["phases"]) == (0.0, 4.0, ["load_model"])
    assert first["cpu_ops_ms"] == {"aten::to": 3.0}
    assert (second["idle_ms"], second["phases"]) == (1.0, ["logprobs"])
    assert summary["gpu_idle_s_in_gaps_over_1ms"] == pytest.approx(0.004)  # the 1 ms gap is not over 1 ms
    assert summary["kernels"][0] == {"name": "gemm", "count": 1, "total_ms": 3.0}


def test_a_profiled_job_writes_its_phases(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv(profiling.ENV, str(tmp_path))
    with phases.recording(), profiling.profiled("reference_logprobs"):
        with phases.phase("logprobs"):
            torch.randn(512, 512) @ torch.randn(512, 512)  # long enough not to round to 0.0 s
    (written,) = [f for f in os.listdir(tmp_path) if f.endswith(".json")]  # the raw trace is not kept
    assert written.startswith("reference_logprobs-")
    summary = json.load(open(tmp_path / written))
    assert summary["job"] == "reference_logprobs" and summary["wall_s"] > 0
    assert summary["phases"]["logprobs"]["wall_s"] > 0 and summary["gpu_busy_s"] == 0.0  # no GPU here


def test_off_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(profiling.ENV, raising=False)
    with profiling.profiled("x"):
        with phases.phase("p"):
            pass
    assert not os.listdir(tmp_path)


def test_the_chrome_trace_is_kept_when_asked(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv(profiling.ENV, str(tmp_path))
    monkeypatch.setenv(profiling.TRACE_ENV, "1")
    with phases.recording(), profiling.profiled("evaluation"):
        torch.ones(4).sum()
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2 and names[0].endswith(".json") and names[1].endswith(".trace.json")
    assert json.load(open(tmp_path / names[1]))["traceEvents"]
