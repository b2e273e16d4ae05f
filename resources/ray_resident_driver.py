"""A driver that stays on the Ray cluster and takes the steps' jobs (``RayJobs.resident_driver_idle_s`` > 0).

A Ray job per step costs each step Ray's job submission (the job supervisor) and a driver process (its
interpreter, ``import ray``, ``ray.init``) before the job's ranks are even asked for (how much: bench/RESULTS.md,
issue 49). Here one driver, itself a Ray job submitted through Ray's job submission API, lives
across steps and runs: ``python -m batchrl.resources.ray_resident_driver <inbox uri> <idle s>``. A step drops its
job's spec (the same spec a per-step driver reads, with the step's Pipes session in ``env``) into the driver's inbox
under the storage root; the driver claims it, runs it as a per-step driver would (``ray_driver.run``: placement
group, ranks, failure detection, all Ray's), writes its messages in chunks as before and then the job's result next
to the spec. The step reads the chunks with the same ``StorageMessageReader`` in a Pipes session of its own, and
watches the driver's Ray job while it waits: a driver that ended or was lost fails the step with its status and log
tail. The driver exits after ``idle s`` without a job; the next step submits a new one. Steps that find no driver
at once may each submit one: each hands its job to the driver it submitted, so no job waits on another's.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import uuid

import dagster as dg

from batchrl.common import fsutil
from batchrl.resources.ray_gangs import KeptGangs

POLL_S = 0.05  # how often the driver lists its inbox, and a step looks for its job's result
STATUS_EVERY_S = 1.0  # how often a waiting step asks Ray whether the driver is still running
CURRENT = "current.json"  # under the drivers' folder: the driver steps hand their jobs to
LIVE = ("PENDING", "RUNNING")
HAND_OVER_TRIES = 3  # drivers a job is handed to before the step gives up (one that idled out as the job came)


def drivers_prefix(base: str) -> str:
    return fsutil.join(base, "_ray_jobs", "_resident_driver")


def _current_driver(client, fs, prefix: str) -> dict | None:
    try:
        current = json.loads(fs.cat_file(fsutil.join(prefix, CURRENT)))
    except FileNotFoundError:
        return None
    try:
        status = _status(client, current["submission_id"])
    except RuntimeError:  # not known to this cluster (restarted): a new one is submitted
        return None
    return current if status in LIVE else None


def _status(client, submission_id: str) -> str:
    return str(client.get_job_status(submission_id)).split(".")[-1]  # "JobStatus.RUNNING" or "RUNNING"


def _submit_driver(client, fs, prefix: str, protocol: str, ray, runtime_env: dict) -> dict:
    submission_id = f"batchrl-driver-{uuid.uuid4().hex[:12]}"
    inbox, results = fsutil.join(prefix, submission_id, "inbox"), fsutil.join(prefix, submission_id, "results")
    client.submit_job(entrypoint=f"{ray.python} -m batchrl.resources.ray_resident_driver {protocol}{inbox} "
                                 f"{ray.resident_driver_idle_s}", submission_id=submission_id,
                      runtime_env=runtime_env)
    current = {"submission_id": submission_id, "inbox": inbox, "results": results}
    fsutil.atomic_write_bytes(fs, fsutil.join(prefix, CURRENT), json.dumps(current).encode())
    return current


def run_through_driver(context: dg.AssetExecutionContext, ray, fs, base: str, protocol: str, spec: dict,
                       reader: dg.PipesMessageReader, runtime_env: dict) -> dg.PipesClientCompletedInvocation:
    """``spec``'s job run by the cluster's resident driver (submitted first if none is running; a driver that
    ends without taking the job, idle as it came, is replaced); raises ``RuntimeError`` (the step's ``dg.Failure``
    in ``ray_launch``) with the driver's account of a failed job, or with the driver's fate if it ended meanwhile."""
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(ray.address)
    except (ConnectionError, RuntimeError) as error:
        raise OSError(str(error)) from error  # as dagster-ray's: "could not reach the Ray cluster's job server"
    prefix = drivers_prefix(base)
    job_id = spec["prefix"].rstrip("/").rsplit("/", 1)[-1]
    with dg.open_pipes_session(context=context, context_injector=dg.PipesEnvContextInjector(),
                               message_reader=reader) as session:
        job = {**spec, "env": {**runtime_env["env_vars"], **session.get_bootstrap_env_vars()}}
        for _ in range(HAND_OVER_TRIES):
            driver = (_current_driver(client, fs, prefix)
                      or _submit_driver(client, fs, prefix, protocol, ray, runtime_env))
            result_path = fsutil.join(driver["results"], f"{job_id}.json")
            spec_path = fsutil.join(driver["inbox"], f"{job_id}.json")
            fsutil.atomic_write_bytes(fs, spec_path, json.dumps({**job, "result": protocol + result_path}).encode())
            context.log.info(f"job {spec['job']!r} handed to the resident Ray driver {driver['submission_id']}")
            try:
                result = _wait_for_result(client, fs, result_path, spec_path, driver["submission_id"], spec["job"])
            except BaseException:  # the run stopped (Dagster interrupts the step) or the driver lost: the job too
                fsutil.atomic_write_bytes(fs, cancel_path(result_path), b"")
                raise
            if result is not None:
                break
        else:
            raise RuntimeError(f"{HAND_OVER_TRIES} resident Ray drivers in a row ended before they took job "
                               f"{spec['job']!r}")
        if result["exit"] != 0:
            raise RuntimeError(result.get("error") or f"exit code {result['exit']}")
    fs.rm(result_path)
    return dg.PipesClientCompletedInvocation(session)


def _wait_for_result(client, fs, path: str, spec_path: str, submission_id: str, job: str) -> dict | None:
    """The job's result; None if the driver ended without taking the job (it went idle as the job came: the job is
    taken back, for a new driver)."""
    asked = time.monotonic()
    while True:
        try:
            return json.loads(fs.cat_file(path))
        except FileNotFoundError:
            pass
        if time.monotonic() - asked > STATUS_EVERY_S:
            asked = time.monotonic()
            status = _status(client, submission_id)
            if status not in LIVE and not _exists(fs, path):
                if _exists(fs, spec_path):  # never claimed
                    fs.rm(spec_path)
                    return None
                logs = client.get_job_logs(submission_id).splitlines()[-20:]
                raise RuntimeError(f"the resident Ray driver {submission_id} ended ({status}) while it ran job "
                                   f"{job!r}; its last log lines:\n" + "\n".join(logs))
        time.sleep(POLL_S)


def cancel_path(result_path: str) -> str:
    """Where a step that gave up on its job says so, for the driver."""
    return result_path.removesuffix(".json") + ".cancel"


def _exists(fs, path: str) -> bool:
    try:
        fs.cat_file(path)
        return True
    except FileNotFoundError:
        return False


class ResidentDriver:
    """The cluster's side: claims the specs dropped into ``inbox`` and runs each on a thread of its own."""

    def __init__(self, inbox_uri: str, idle_s: float, storage_options: dict):
        self.fs, self.inbox = fsutil.filesystem_for(inbox_uri, storage_options)
        self.idle_s, self.storage_options = idle_s, storage_options
        self.running, self.lock = 0, threading.Lock()
        self.last_end = time.monotonic()
        self.gangs = KeptGangs()  # rank actors and their placement kept for the next job of the same shape

    def serve(self) -> None:
        while True:
            claimed = self._claim_new()
            self.gangs.release_idle()
            with self.lock:
                idle = self.running == 0 and time.monotonic() - self.last_end > self.idle_s
            if idle and not claimed:
                print(f"batchrl resident driver: idle for {self.idle_s:.0f} s, exiting", flush=True)
                return
            time.sleep(POLL_S)

    def _claim_new(self) -> int:
        self.fs.invalidate_cache(self.inbox)  # a listing is cached otherwise (s3fs)
        try:
            paths = sorted(self.fs.ls(self.inbox, detail=False))
        except FileNotFoundError:  # nothing dropped yet (an object store has no empty folders)
            paths = []
        claimed = 0
        for path in (p for p in paths if p.endswith(".json")):  # not a local root's temp file of a spec being written
            try:
                spec = json.loads(self.fs.cat_file(path))
                self.fs.rm(path)  # claimed: one driver per inbox, so no other reads it
            except FileNotFoundError:
                continue
            print(f"batchrl resident driver: claimed job {spec['job']!r} ({spec['prefix']})", flush=True)
            with self.lock:
                self.running += 1
            threading.Thread(target=self._run, args=(spec,), daemon=True).start()
            claimed += 1
        return claimed

    def _run(self, spec: dict) -> None:
        from batchrl.resources.ray_driver import run
        from batchrl.resources.ray_messages import ChunkWriter

        errors: list[str] = []
        writer = ChunkWriter(spec["messages"], self.storage_options)
        fs, path = fsutil.filesystem_for(spec["result"], self.storage_options)
        try:
            code = run(spec, self.storage_options, writer.emit, error=errors.append,
                       cancelled=lambda: _exists(fs, cancel_path(path)), gangs=self.gangs)
        except Exception as error:  # noqa: BLE001 - the step gets it; the driver serves the next job
            code, errors = 1, [*errors, f"batchrl job {spec['job']!r}: {type(error).__name__}: {error}"]
        finally:
            writer.close()
        for text in errors:
            print(text, file=sys.stderr, flush=True)
        if _exists(fs, cancel_path(path)):  # its step is gone: nobody waits for the result
            fs.rm(cancel_path(path))
        else:
            fsutil.atomic_write_bytes(fs, path, json.dumps({"exit": code, "error": "\n".join(errors)}).encode())
        with self.lock:
            self.running -= 1
            self.last_end = time.monotonic()


def main(argv: list[str]) -> int:
    import ray

    from batchrl.common.environment_variables import read

    ray.init(address="auto", log_to_driver=True)  # the cluster this driver was submitted to
    ResidentDriver(argv[0], float(argv[1]), read("BATCHRL_RAY_STORAGE_OPTIONS")).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
