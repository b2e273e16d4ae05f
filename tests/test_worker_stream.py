"""The job worker asked without Dagster (``training/jobs/worker_client.py``), as a Ray rank asks its node's resident
worker: the job's output lines stream back as it prints them, the worker outlives its caller (nobody's child)
and serves the next job warm, a failed job answers with its traceback and takes the worker down, and a caller
that goes away mid-job takes the job (and the worker) with it."""
import json
import os
import socket
import subprocess
import sys
import time

import pandas as pd
import psutil

from batchrl.training.jobs import worker_client


def _job(arith_job_inputs, folder, name: str) -> dict:
    config = {"model_path": arith_job_inputs["model_path"], "pairs_parquet": arith_job_inputs["pairs_parquet"],
              "out_parquet": str(folder / f"{name}.parquet"), "max_length": 64}
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    return {"job": "reference_logprobs", "config": str(path), "cwd": str(folder)}


def _env() -> dict[str, str]:  # no Pipes session: the job reports its materialisation as a JSON line
    return {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES_")}


def _stop(pid: int) -> None:
    try:
        psutil.Process(pid).kill()
    except psutil.NoSuchProcess:
        pass


def test_streamed_jobs_report_their_lines_in_an_orphaned_worker_until_one_fails(arith_job_inputs, tmp_path):
    path = worker_client.named_worker_path(_env(), f"stream-test-{os.getpid()}")
    answers, lines = [], []
    for name in ("first", "second"):
        for kind, item in worker_client.stream_job(path, _job(arith_job_inputs, tmp_path, name), _env(), 60):
            (lines if kind == "out" else answers if kind == "answer" else []).append(item)
    pid = answers[0]["pid"]
    try:
        assert [a["ok"] for a in answers] == [True, True], answers
        assert answers[1]["pid"] == pid  # the second job ran in the process the first started
        assert psutil.Process(pid).ppid() != os.getpid()  # re-parented: it outlives a caller whose children die
        reports = [json.loads(line) for line in lines if line.startswith('{"materialization"')]
        assert len(reports) == 2, lines
        assert reports[0]["materialization"]["mean_ref_chosen_logp"] == \
            reports[1]["materialization"]["mean_ref_chosen_logp"]
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "first.parquet"),
                                      pd.read_parquet(tmp_path / "second.parquet"))
        # a failed job: its traceback streamed, its error answered, and the worker gone (a failure may leave
        # state behind: the next job gets a fresh process)
        request = {**_job(arith_job_inputs, tmp_path, "bad"), "config": str(tmp_path / "missing.json")}
        events = list(worker_client.stream_job(path, request, _env(), 60))
        kind, answer = events[-1]
        assert kind == "answer" and not answer["ok"] and answer["pid"] == pid, events
        assert "missing.json" in answer["error"]
        assert any("Traceback" in item for k, item in events if k == "err"), events
        psutil.Process(pid).wait(timeout=30)
    finally:
        _stop(pid)


def test_the_worker_exits_when_its_requester_leaves_mid_job():
    """The watchdog of a streamed job (``worker._exit_when_requester_leaves``) on a socket pair: the far end
    closed, as when a Ray actor dies, and the process running the job exits at once."""
    code = ("import socket, sys, threading, time; from batchrl.training.jobs import worker; "
            "conn = socket.socket(fileno=int(sys.argv[1])); "
            "threading.Thread(target=worker._exit_when_requester_leaves, args=(conn, threading.Event())).start(); "
            "print('watching', flush=True); time.sleep(60)")
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                            stdout=subprocess.PIPE, text=True)
    theirs.close()
    assert proc.stdout.readline().strip() == "watching"
    started = time.monotonic()
    ours.close()
    assert proc.wait(timeout=10) == 1
    assert time.monotonic() - started < 5
