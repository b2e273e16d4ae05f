"""Jobs on a Ray cluster through dagster-ray's ``PipesRayJobClient`` (``TrainerLauncherResource.backend: ray``).

The Dagster side of a job: its files go up through the storage root (``resources/ray_staging.py``), a spec names
the job, its configs and its ranks, and ``python -m batchrl.resources.ray_driver <spec>`` is submitted as a Ray
job; the Pipes messages come back from the job's logs; on success the job's outputs come back down into the paths
its config named, so the asset code reads them as after a local job. Training jobs run ``world_size`` ranks
(DeepSpeed data parallel, placed by Ray); rollouts run ``rollout_replicas`` replicas, each sampling a contiguous
shard of the prompts, joined here in shard order.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import threading
import time
import uuid
from typing import Any, Iterator, Literal

import dagster as dg
from pydantic import Field

from batchrl.common import fsutil
from batchrl.resources import ray_inputs, ray_messages, ray_staging

REPLICA_SEED_STRIDE = 1000  # replica r of a request with seed s samples its shard with seed s * stride + r
SHARD_DIR = "ray_shards"


class RayJobs(dg.Config):
    address: str = Field("http://127.0.0.1:8265", description="the Ray cluster's dashboard (job submission) address")
    world_size: int = Field(2, ge=1, description="ranks of a training job (data parallel), one per bundle")
    rollout_replicas: int = Field(1, ge=1, description="rollout replicas, each sampling a shard of the prompts")
    cpus_per_rank: float = Field(1.0, ge=0, description="CPU slots of each rank's placement-group bundle")
    gpus_per_rank: float = Field(0.0, ge=0, description="GPUs of each rank's bundle (0: gloo on CPU)")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy of the ranks (STRICT_SPREAD: one node each)")
    storage_root: str = Field("", description="where job files travel (s3://... on a cluster; the storage root)")
    storage_options: dict[str, Any] = Field({}, description="fsspec options of storage_root (endpoint...)")
    python: str = Field("python", description="the cluster's Python, with batchrl installed")
    poll_interval_s: float = Field(0.1, gt=0, description="how often the Ray job's status is polled (its end is "
                                   "seen this late at most; one small request to the dashboard each)")
    resident_worker_idle_s: float = Field(
        600.0, ge=0, description="one-process jobs (one rank, rollout replicas) run in a job worker resident on "
        "their node, which exits after this many idle seconds; 0: a fresh process per job")
    resident_driver_idle_s: float = Field(
        0.0, ge=0, description="> 0: the steps' jobs go to one driver resident on the cluster (itself a Ray job, "
        "submitted when none runs, gone after this many idle seconds) instead of a Ray job per step through "
        "dagster-ray's PipesRayJobClient: no job submission and driver start per step (resources/"
        "ray_resident_driver.py)")


class StorageMessageReader(dg.PipesMessageReader):
    """A Ray job's Pipes messages read in chunks from the storage root as its driver writes them
    (``resources/ray_messages.py``: why not dagster-ray's log-following reader), on a thread of its own that asks
    for the next chunk every ``ray_messages.POLL_S``: Dagster's threaded blob-store reader sleeps a whole second
    between reads, which put up to a second before each Ray job's first message and up to another after its end.
    Once the Ray job has ended (the session closes) its driver has written every chunk: the rest is read and the
    thread ends, without waiting for more."""

    def __init__(self, uri: str, storage_options: dict):
        self.fs, self.base = fsutil.filesystem_for(uri, storage_options)
        self.chunks_read = 0

    @contextlib.contextmanager
    def read_messages(self, handler) -> Iterator[dict]:
        ended = threading.Event()
        thread = threading.Thread(target=self._follow, args=(handler, ended), daemon=True)
        thread.start()
        try:
            yield {"stdio": "stdout"}  # the job writes to its stdout; the driver relays and chunks it
        finally:
            ended.set()
            thread.join()

    def _follow(self, handler, ended: threading.Event) -> None:
        # not until the job's closing message: the driver's own lines (where the job ran, what it read) come after
        while True:
            last_pass = ended.is_set()  # set before this read: every chunk is written by now
            text = self._chunk(self.chunks_read + 1)
            if text is not None:
                self.chunks_read += 1
                self._handle(handler, text)
            elif last_pass:
                return
            else:
                time.sleep(ray_messages.POLL_S)

    def _chunk(self, index: int) -> str | None:
        try:
            return self.fs.cat_file(ray_messages.chunk_path(self.base, index)).decode()
        except FileNotFoundError:
            return None
        except OSError as error:  # a storage hiccup: said, then asked again
            print(f"reading {ray_messages.chunk_path(self.base, index)}: {error}", file=sys.stderr, flush=True)
            return None

    @staticmethod
    def _handle(handler, text: str) -> None:
        for line in text.split("\n"):
            try:
                message = json.loads(line) if line.startswith(ray_messages.PIPES_MESSAGE_PREFIX) else None
            except ValueError:  # a line cut short: shown, not handled
                message = None
            if message is not None:
                handler.handle_message(message)
            elif line:
                print(line, flush=True)  # the driver's and the job's other lines: to the step's compute log

    def no_messages_debug_text(self) -> str:
        return f"no message chunks were found under {self.base}"


def ranks_of(job: str, ray: RayJobs) -> int:
    from batchrl.training.jobs import TRAINING_JOBS

    return ray.world_size if job in TRAINING_JOBS else 1


def shard_configs(config: dict, workdir: str, replicas: int) -> list[dict]:
    """Per replica, the rollouts request on its contiguous shard of the prompts (fewer replicas than prompts)."""
    import pandas as pd

    table = pd.read_parquet(config["prompts_parquet"])
    count = max(1, min(replicas, len(table)))
    bounds = [len(table) * r // count for r in range(count + 1)]
    configs = []
    for r in range(count):
        folder = os.path.join(workdir, SHARD_DIR, str(r))
        os.makedirs(folder, exist_ok=True)
        table.iloc[bounds[r]:bounds[r + 1]].to_parquet(os.path.join(folder, "prompts.parquet"), index=False)
        configs.append({**config, "prompts_parquet": os.path.join(folder, "prompts.parquet"),
                        "out_parquet": os.path.join(folder, "samples.parquet"), "stats_json": None,
                        "prefetched_from": None, "seed": config["seed"] * REPLICA_SEED_STRIDE + r,
                        "shard_offset": bounds[r]})
    return configs


def join_shards(configs: list[dict], out_parquet: str) -> None:
    """The replicas' samples in shard order, prompt indices counted over the whole request."""
    import pandas as pd

    parts = [pd.read_parquet(c["out_parquet"]).assign(
        prompt_index=lambda t, offset=c["shard_offset"]: t["prompt_index"] + offset) for c in configs]
    pd.concat(parts, ignore_index=True).to_parquet(f"{out_parquet}.tmp", index=False)
    os.replace(f"{out_parquet}.tmp", out_parquet)


def job_spec(job: str, configs: list[dict], roots: list[str], prefix: str, ray: RayJobs,
             artifacts: dict[int, str] | None = None) -> dict:
    """``artifacts``: the roots read from their published artifact under the storage root (``ray_inputs``)."""
    return {"job": job, "configs": configs, "roots": roots, "prefix": prefix, "messages": messages_uri(prefix),
            "artifacts": {str(i): remote for i, remote in (artifacts or {}).items()},
            "world_size": len(configs) if len(configs) > 1 else ranks_of(job, ray),
            "cpus_per_rank": ray.cpus_per_rank, "gpus_per_rank": ray.gpus_per_rank,
            "placement_strategy": ray.placement_strategy, "resident_idle_s": ray.resident_worker_idle_s}


def messages_uri(prefix: str) -> str:
    return prefix.rstrip("/") + "/messages"


def run_on_ray(context: dg.AssetExecutionContext, ray: RayJobs, job: str, config: dict, workdir: str,
               env: dict[str, str]) -> tuple[dg.PipesClientCompletedInvocation, dict[str, float]]:
    """Stage, submit and wait for ``job`` on the cluster; its outputs back in place. A failed Ray job raises
    ``dg.Failure`` with the driver's account of each rank, before anything comes back. Also returns where the
    step's wall went (``ray_s/*``: the inputs up, the job from its hand-over to its end, the outputs down), which
    the job's own numbers beside it turn into the Ray path's cost."""
    from dagster_ray import PipesRayJobClient

    started = time.perf_counter()

    if not ray.storage_root:
        raise dg.Failure("TrainerLauncherResource backend 'ray' needs ray.storage_root: the cluster's nodes share "
                         "no disk with this process, the job's files travel through storage")
    sharded = job == "rollouts" and ray.rollout_replicas > 1 and not config.get("agent")
    configs = shard_configs(config, workdir, ray.rollout_replicas) if sharded else [config]
    roots = ray_staging.path_roots(*configs)
    fs, base = fsutil.filesystem_for(ray.storage_root, ray.storage_options)
    prefix = fsutil.join(base, "_ray_jobs", context.run.run_id, f"{job}-{uuid.uuid4().hex[:12]}")
    artifacts = ray_inputs.artifact_sources(roots, fs, base)  # the nodes read these where they are published
    for i, root in enumerate(roots):
        if os.path.exists(root) and i not in artifacts:
            ray_staging.upload(fs, fsutil.join(prefix, "in", str(i)), ray_staging.local_files(root))
    protocol = ray.storage_root.split("://", 1)[0] + "://" if "://" in ray.storage_root else ""
    spec = job_spec(job, configs, roots, protocol + prefix, ray, artifacts)
    reader = StorageMessageReader(messages_uri(protocol + prefix), ray.storage_options)
    runtime_env = {"env_vars": {**env, "BATCHRL_RAY_STORAGE_OPTIONS": json.dumps(ray.storage_options)}}
    handed = time.perf_counter()
    try:
        if ray.resident_driver_idle_s > 0:
            from batchrl.resources.ray_resident_driver import run_through_driver

            invocation = run_through_driver(context, ray, fs, base, protocol, spec, reader, runtime_env)
        else:
            fsutil.atomic_write_bytes(fs, fsutil.join(prefix, "spec.json"), json.dumps(spec).encode())
            spec_uri = protocol + fsutil.join(prefix, "spec.json")
            submit = {"entrypoint": f"{ray.python} -m batchrl.resources.ray_driver {shlex.quote(spec_uri)}",
                      "runtime_env": runtime_env}
            client = PipesRayJobClient(address=ray.address, poll_interval=ray.poll_interval_s, message_reader=reader)
            invocation = client.run(context=context, submit_job_params=submit)
    except RuntimeError as error:  # dagster-ray: the Ray job FAILED or STOPPED, with its logs' tail
        raise dg.Failure(f"job {job!r} failed on the Ray cluster at {ray.address}; nothing is published "
                         f"(work dir {workdir}).\n{error}") from error
    except OSError as error:  # requests' ConnectionError: no job server there
        raise dg.Failure(f"job {job!r}: could not reach the Ray cluster's job server at {ray.address} "
                         f"(trainer.ray.address, BATCHRL_RAY_ADDRESS): {error}") from error
    finally:  # the inputs were the job's only: gone whatever it ended with
        if fs.exists(fsutil.join(prefix, "in")):
            fs.rm(fsutil.join(prefix, "in"), recursive=True)
    ended = time.perf_counter()
    for i, root in enumerate(roots):
        if i not in artifacts:  # a published artifact is an input: jobs never write into one
            ray_staging.download(fs, fsutil.join(prefix, "out", str(i)), root, link=True)
    fs.rm(prefix, recursive=True)
    if sharded:
        join_shards(configs, config["out_parquet"])
    return invocation, {"ray_s/stage_in": round(handed - started, 3), "ray_s/job": round(ended - handed, 3),
                        "ray_s/stage_out": round(time.perf_counter() - ended, 3)}
