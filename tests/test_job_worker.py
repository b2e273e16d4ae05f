"""The long-lived job worker (launcher backend ``worker``): jobs run in one warm process and report
through Dagster Pipes exactly as fresh subprocesses do; a failed job is reported and the next one gets
a fresh worker."""
import os
import signal

import dagster as dg
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from batchrl.resources import TrainerLauncherResource


def _graph(arith_job_inputs, root):
    ref_out = str(root / "ref" / "reference_logprobs.parquet")

    @dg.asset
    def reference_logprobs(context: dg.AssetExecutionContext, trainer: TrainerLauncherResource):
        os.makedirs(root / "ref", exist_ok=True)
        return trainer.run_job(context, "reference_logprobs", {
            "model_path": arith_job_inputs["model_path"], "pairs_parquet": arith_job_inputs["pairs_parquet"],
            "out_parquet": ref_out, "max_length": 64}, str(root / "ref"))

    @dg.asset(deps=[reference_logprobs])
    def dpo_checkpoint(context: dg.AssetExecutionContext, trainer: TrainerLauncherResource):
        os.makedirs(root / "dpo", exist_ok=True)
        return trainer.run_job(context, "train_dpo", {
            "trainer": {"epochs": 1, "micro_batch_size": 8}, "pairs_parquet": arith_job_inputs["pairs_parquet"],
            "model_path": arith_job_inputs["model_path"], "reference_parquet": ref_out, "out_dir": str(root / "dpo")},
            str(root / "dpo"))

    return [reference_logprobs, dpo_checkpoint]


def _own_process_asset(arith_job_inputs, folder):
    """Reference log-probs as a job in a process of its own, writing ``folder``/ref.parquet."""

    @dg.asset
    def own_process(context: dg.AssetExecutionContext, trainer: TrainerLauncherResource):
        os.makedirs(folder, exist_ok=True)
        return trainer.run_job(context, "reference_logprobs", {
            "model_path": arith_job_inputs["model_path"], "pairs_parquet": arith_job_inputs["pairs_parquet"],
            "out_parquet": str(folder / "ref.parquet"), "max_length": 64}, str(folder),
            fresh_process=True)  # e.g. vLLM rollouts: their engine process and memory must go with the job

    return own_process


def _metadata(result, node):
    return {k: v.value for k, v in result.asset_materializations_for_node(node)[-1].metadata.items()}


@pytest.fixture(scope="module")
def fresh(arith_job_inputs, tmp_path_factory):
    """The graph's jobs in fresh subprocesses (the default launcher), once for the module: what the warm worker's
    runs must equal. ``.folder``: where its outputs lie."""
    folder = tmp_path_factory.mktemp("fresh")
    result = dg.materialize(_graph(arith_job_inputs, folder), resources={"trainer": TrainerLauncherResource()})
    assert result.success
    result.folder = folder
    return result


def _reference_logprobs(folder) -> pd.DataFrame:
    return pd.read_parquet(folder / "ref" / "reference_logprobs.parquet")


def _dpo_weights(folder) -> dict:
    return load_file(folder / "dpo" / "model" / "model.safetensors")


def test_jobs_in_a_warm_worker_match_fresh_subprocesses(arith_job_inputs, fresh, tmp_path):
    worker = TrainerLauncherResource(backend="worker", worker_idle_s=60, env={"BATCHRL_STORAGE": str(tmp_path)})
    warm = dg.materialize(_graph(arith_job_inputs, tmp_path / "warm"), resources={"trainer": worker})
    assert warm.success
    pids = set()
    for node in ("reference_logprobs", "dpo_checkpoint"):
        got, want = _metadata(warm, node), _metadata(fresh, node)
        pids.add(got["worker_pid"])
        assert "worker_pid" not in want and got.keys() - {"worker_pid"} == want.keys()
    # the same numbers out (the folders differ only in the paths their records name)
    pd.testing.assert_frame_equal(_reference_logprobs(tmp_path / "warm"), _reference_logprobs(fresh.folder))
    weights = [_dpo_weights(tmp_path / "warm"), _dpo_weights(fresh.folder)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])
    assert len(pids) == 1  # both jobs in one process
    pid = pids.pop()
    assert pid != os.getpid()

    @dg.asset
    def broken(context: dg.AssetExecutionContext, trainer: TrainerLauncherResource):
        return trainer.run_job(context, "train_dpo", {"trainer": {"epochs": 1}, "pairs_parquet": "/nonexistent.parquet",
                                                      "model_path": arith_job_inputs["model_path"],
                                                      "reference_parquet": "/x",
                                                      "out_dir": str(tmp_path / "broken")}, str(tmp_path))

    failed = dg.materialize([broken], resources={"trainer": worker}, raise_on_error=False)
    assert not failed.success
    failure = [e for e in failed.all_events if e.event_type_value == "STEP_FAILURE"][0]
    assert "failed in the job worker" in str(failure.event_specific_data.error) and "nonexistent" in str(
        failure.event_specific_data.error)
    again = dg.materialize(_graph(arith_job_inputs, tmp_path / "again")[:1], resources={"trainer": worker})
    new_pid = _metadata(again, "reference_logprobs")["worker_pid"]
    assert new_pid != pid  # the failed worker exited; a fresh one took the next job

    own_process = _own_process_asset(arith_job_inputs, tmp_path / "own")

    alone = dg.materialize([own_process], resources={"trainer": worker})
    assert alone.success and "worker_pid" not in _metadata(alone, "own_process")
    os.kill(new_pid, signal.SIGTERM)


def test_the_next_job_in_the_worker_builds_its_model_from_the_weight_cache(arith_job_inputs, fresh, tmp_path):
    """With the weight cache on (``BATCHRL_WEIGHT_CACHE_GB``; off by default on a host without CUDA): reference
    log-probs load the base model and keep its weights; DPO, the next job in the same worker, builds its model
    from them (a hit) and trains it in place; a third job still finds the base model's weights. Every output is
    what fresh subprocesses give."""
    worker = TrainerLauncherResource(backend="worker", worker_idle_s=60,
                                     env={"BATCHRL_STORAGE": str(tmp_path), "BATCHRL_WEIGHT_CACHE_GB": "1"})
    warm = dg.materialize(_graph(arith_job_inputs, tmp_path / "warm"), resources={"trainer": worker})
    again = dg.materialize(_graph(arith_job_inputs, tmp_path / "again")[:1], resources={"trainer": worker})
    assert warm.success and again.success
    cache = lambda result, node: tuple(_metadata(result, node)[f"weight_cache_{k}"] for k in ("hits", "misses"))
    assert cache(warm, "reference_logprobs") == (0, 1)  # loaded from the files, kept
    assert cache(warm, "dpo_checkpoint") == (1, 0)  # the same folder, dtype and device: built from the cache
    assert cache(again, "reference_logprobs") == (1, 0)  # DPO trained its model, not the cached weights
    assert cache(fresh, "reference_logprobs") == cache(fresh, "dpo_checkpoint") == (0, 0)  # off outside the worker
    pids = {_metadata(warm, node)["worker_pid"] for node in ("reference_logprobs", "dpo_checkpoint")}
    assert pids == {_metadata(again, "reference_logprobs")["worker_pid"]}
    for run in ("warm", "again"):
        pd.testing.assert_frame_equal(_reference_logprobs(tmp_path / run), _reference_logprobs(fresh.folder))
    weights = [_dpo_weights(tmp_path / "warm"), _dpo_weights(fresh.folder)]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])
    os.kill(pids.pop(), signal.SIGTERM)


def test_gpu_job_slots_run_a_job_beside_a_busy_worker(arith_job_inputs, tmp_path):
    """gpu_job_slots 2: while one worker runs a job (its slot held, as by another step of a multiprocess
    run), the next job goes to a second warm worker instead of queueing; once the slot is free, jobs go to
    the first again. Both give the same numbers."""
    import fcntl

    from batchrl.resources.job_worker import slot_path

    worker = TrainerLauncherResource(backend="worker", worker_idle_s=60, gpu_job_slots=2,
                                     env={"BATCHRL_STORAGE": str(tmp_path)})
    run = lambda name: dg.materialize(_graph(arith_job_inputs, tmp_path / name)[:1], resources={"trainer": worker})
    pid = lambda result: _metadata(result, "reference_logprobs")["worker_pid"]
    first = pid(run("first"))
    with open(slot_path(worker.job_env(), 0) + ".busy", "w") as busy:
        fcntl.flock(busy, fcntl.LOCK_EX)  # slot 0 is running another step's job
        beside = pid(run("beside"))
    again = pid(run("again"))
    assert beside != first and again == first
    read = lambda name: pd.read_parquet(tmp_path / name / "ref" / "reference_logprobs.parquet")
    pd.testing.assert_frame_equal(read("first"), read("beside"))
    for worker_pid in (first, beside):
        os.kill(worker_pid, signal.SIGTERM)


def test_a_job_in_processes_of_its_own_waits_for_a_gpu_job_slot(arith_job_inputs, tmp_path, monkeypatch):
    """A job outside the warm workers (vLLM rollouts, data-parallel training) holds a GPU job slot too: while
    the only slot runs another step's job, it does not start; once the slot is free, it runs."""
    import fcntl
    import threading

    from batchrl.resources import job_worker
    from batchrl.resources.job_worker import slot_path

    worker = TrainerLauncherResource(backend="worker", worker_idle_s=30, env={"BATCHRL_STORAGE": str(tmp_path)})
    config_path = str(tmp_path / "own" / "reference_logprobs.json")
    busy_path = slot_path(worker.job_env(), 0) + ".busy"

    # the step's tries for the slot, seen as they happen (the real flock still decides): two refusals mean it
    # found the slot busy and came back for it, i.e. it is waiting
    refused, waiting = [], threading.Event()
    real_flock = job_worker.fcntl.flock

    def watched_flock(file, operation):
        try:
            return real_flock(file, operation)
        except BlockingIOError:
            if getattr(file, "name", None) == busy_path:
                refused.append(operation)
                if len(refused) >= 2:
                    waiting.set()
            raise

    monkeypatch.setattr(job_worker.fcntl, "flock", watched_flock)
    own_process = _own_process_asset(arith_job_inputs, tmp_path / "own")
    results = []
    with open(busy_path, "w") as busy:
        real_flock(busy, fcntl.LOCK_EX)  # the one slot runs another step's job
        run = lambda: results.append(dg.materialize([own_process], resources={"trainer": worker}))
        step = threading.Thread(target=run)
        step.start()
        assert waiting.wait(timeout=240), "the step never asked for the slot"
        assert step.is_alive() and not os.path.exists(tmp_path / "own" / "ref.parquet")
        assert not [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, config_path)]
    step.join(timeout=240)
    assert results and results[0].success and os.path.exists(tmp_path / "own" / "ref.parquet")


def test_prestart_starts_one_worker_ahead_of_the_first_job(tmp_path):
    """`batchrl run` starts the worker before its first step: one worker, whatever the number of calls, that
    has its imports done when the first job comes; the subprocess backend starts none."""
    from batchrl.resources.job_worker import request, socket_path

    worker = TrainerLauncherResource(backend="worker", worker_idle_s=30, env={"BATCHRL_STORAGE": str(tmp_path)})
    env = worker.job_env()
    path = socket_path(env)
    worker.prestart_worker()
    worker.prestart_worker()
    pids = {request(path, {"ping": True}, env, 30)["pid"] for _ in range(2)}
    assert len(pids) == 1
    pid = pids.pop()
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert path.encode() in f.read()
    serving = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, path)]
    assert serving == [str(pid)]
    os.kill(pid, signal.SIGTERM)
    plain = TrainerLauncherResource(env={"BATCHRL_STORAGE": str(tmp_path / "other")})
    plain.prestart_worker()
    assert not os.path.exists(socket_path(plain.job_env()))


def test_a_concurrent_run_prestarts_the_worker_of_every_gpu_job_slot(tmp_path):
    """gpu_job_slots 2: a run of one step at a time starts slot 0's worker only; a concurrent run starts both,
    so the job that runs beside another finds its worker warm too."""
    from batchrl.resources.job_worker import named_worker_path, request, slot_path

    worker = TrainerLauncherResource(backend="worker", worker_idle_s=30, gpu_job_slots=2,
                                     env={"BATCHRL_STORAGE": str(tmp_path)})
    env = worker.job_env()
    worker.prestart_worker()
    assert os.path.exists(slot_path(env, 0)) and not os.path.exists(slot_path(env, 1))
    worker.prestart_worker(concurrent=True)
    pids = [request(slot_path(env, slot), {"ping": True}, env, 30)["pid"] for slot in (0, 1)]
    assert pids[0] != pids[1]
    # an off-policy run's rollouts worker: one of its own, beside the slots'
    worker.prestart_worker(named=("rollouts",))
    pids.append(request(named_worker_path(env, "rollouts"), {"ping": True}, env, 30)["pid"])
    assert len(set(pids)) == 3
    for pid in pids:
        os.kill(pid, signal.SIGTERM)


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return text.encode() in f.read()
    except OSError:
        return False


def test_edited_code_gets_a_worker_of_its_own(tmp_path):
    """A warm worker must not run yesterday's code: the socket a job goes to is keyed by the package's sources."""
    from batchrl.common.package import code_fingerprint

    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "__init__.py").write_text("")
    (tmp_path / "venv").mkdir()  # not a package: not walked
    (tmp_path / "venv" / "site.py").write_text("x = 1\n")
    module = tmp_path / "training" / "loop.py"
    module.write_text("STEP = 1\n")
    (tmp_path / "notes.txt").write_text("x")
    before = code_fingerprint(str(tmp_path))
    (tmp_path / "notes.txt").write_text("not code")
    (tmp_path / "venv" / "site.py").write_text("x = 22\n")
    assert code_fingerprint(str(tmp_path)) == before
    module.write_text("STEP = 2\n")  # same size: the mtime tells
    os.utime(module, ns=(module.stat().st_atime_ns, module.stat().st_mtime_ns + 1_000_000))
    assert code_fingerprint(str(tmp_path)) != before


def test_preload_imports_what_jobs_would_import_lazily():
    import subprocess
    import sys

    code = ("import sys; from batchrl.training.jobs.worker import PRELOAD_MODULES, preload; "
            "assert 'transformers.models.auto.modeling_auto' not in sys.modules; preload(); "
            "missing = [m for m in PRELOAD_MODULES if m not in sys.modules]; print(missing); assert not missing")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_a_job_sees_exactly_the_batchrl_settings_of_its_step(tmp_path, monkeypatch):
    """A worker started by one run's step serves the next run's: its own BATCHRL_ settings must not leak into a
    job whose step lacks them, and the step's settings reach the job even where they equal this process's."""
    from batchrl.resources.job_worker import job_request_env
    from batchrl.training.jobs.worker import _job_environment

    monkeypatch.setenv("BATCHRL_PROFILE_JOBS", str(tmp_path))  # left by the run that started the worker
    monkeypatch.setenv("BATCHRL_CUDNN_ATTENTION", "1")
    monkeypatch.setenv("UNRELATED", "kept")
    step_env = {**{k: v for k, v in os.environ.items() if k != "BATCHRL_PROFILE_JOBS"}, "PIPES_X": "p"}
    sent = job_request_env(step_env)
    assert sent["BATCHRL_CUDNN_ATTENTION"] == "1" and sent["PIPES_X"] == "p" and "UNRELATED" not in sent
    with _job_environment(sent, str(tmp_path)):
        assert "BATCHRL_PROFILE_JOBS" not in os.environ and os.environ["BATCHRL_CUDNN_ATTENTION"] == "1"
        assert os.environ["PIPES_X"] == "p" and os.environ["UNRELATED"] == "kept"
    assert os.environ["BATCHRL_PROFILE_JOBS"] == str(tmp_path) and "PIPES_X" not in os.environ
