"""The entry point of a batchrl job on a Ray cluster: ``python -m batchrl.resources.ray_driver <spec uri>``,
submitted by ``resources/ray_launch.py`` through dagster-ray's ``PipesRayJobClient``.

The driver asks Ray for a placement group of one bundle per rank (CPU slots, or GPUs), starts one ``JobRank``
actor in each bundle, hands every rank the process group's rendezvous (rank 0's node address and a free port there,
``RANK``/``WORLD_SIZE``; gloo on CPU, NCCL on GPUs, as under torchrun) and relays rank 0's output lines unchanged
to its own stdout, where the Pipes message reader of the Ray job's logs finds the job's Pipes messages. Replicas
of a sharded job (data-parallel rollouts) report here instead: the driver merges their numbers into one report.

Failures are Ray's to detect: a rank whose process exits non-zero, or whose actor or node dies (``RayActorError``),
fails the whole job with a message naming each rank's fate; every actor is killed, the placement group removed,
and nothing is uploaded, so the Dagster step publishes nothing.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import threading
import time

from batchrl.common import fsutil
from batchrl.common.environment_variables import read
from batchrl.resources.ray_messages import ChunkWriter
from batchrl.resources.ray_rank import PIPES_ENV_PREFIX

PLACEMENT_TIMEOUT_S = read("BATCHRL_RAY_PLACEMENT_TIMEOUT_S")
FAILURE_GRACE_S = 5.0  # after one rank fails: how long the others get to end (and say why) before they are killed


class RankOutcomes:
    """What each rank ended with: its exit report, or the error Ray raised for it."""

    def __init__(self, world: int):
        self.ended: dict[int, dict | BaseException] = {}
        self.changed = threading.Condition()
        self.world = world

    def end(self, rank: int, outcome: dict | BaseException) -> None:
        with self.changed:
            self.ended[rank] = outcome
            self.changed.notify_all()

    def failed(self) -> list[int]:
        return [r for r, o in self.ended.items() if isinstance(o, BaseException) or o.get("exit") != 0]

    def wait(self, cancelled=lambda: False) -> None:
        """Until every rank ended, or one failed and the others had ``FAILURE_GRACE_S`` to end too, or
        ``cancelled()`` (asked about once a second)."""
        deadline = None
        with self.changed:
            while len(self.ended) < self.world and not cancelled():
                if deadline is None and self.failed():
                    deadline = time.monotonic() + FAILURE_GRACE_S
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    return
                self.changed.wait(timeout=timeout if timeout is not None else 1.0)


def _relay(rank: int, stream, outcomes: RankOutcomes, reports: dict[int, dict], emit) -> None:
    """Print rank ``rank``'s lines (``emit`` given: rank 0 of an unsharded job, unchanged through ``emit``, the Pipes
    protocol's; else tagged with the rank) and keep
    its exit report and a replica's final report (a ``{"materialization": ...}`` line)."""
    import ray

    outcome: dict | BaseException = RuntimeError("ended without an exit report")
    try:
        for ref in stream:
            item = ray.get(ref)
            if isinstance(item, dict):
                outcome = item
            elif emit is not None:
                emit(item)
            else:
                if item.startswith('{"materialization"'):
                    reports[rank] = json.loads(item)["materialization"]
                print(f"[rank {rank}] {item}", flush=True)
    except Exception as error:  # RayActorError (the actor or its node died), ObjectLostError...
        outcome = error
    outcomes.end(rank, outcome)


def rank_env(rank: int, world: int, address: str, port: int, pipes: bool,
             job_env: dict[str, str] | None = None) -> dict[str, str | None]:
    """A rank's variables: ``job_env`` (the spec's: a job handed to the resident driver brings its Pipes session
    and the launcher's variables along) and the rendezvous (torchrun's names; each rank sees only its own GPUs, so
    local rank 0); without Pipes (``pipes`` False) the Pipes variables removed (None)."""
    env: dict[str, str | None] = dict(job_env or {})
    if world > 1:
        env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": address, "MASTER_PORT": str(port)})
    if not pipes:  # a replica: reports through the driver, never on its own
        env.update({k: None for k in [*os.environ, *env] if k.startswith(PIPES_ENV_PREFIX)})
    return env


def failure_message(spec: dict, outcomes: RankOutcomes, nodes: dict[int, str]) -> str:
    lines = [f"batchrl job {spec['job']!r} failed on the Ray cluster ({outcomes.world} rank(s)); nothing was "
             "uploaded, so the step publishes nothing, and a rerun starts it again:"]
    for rank in range(outcomes.world):
        outcome, where = outcomes.ended.get(rank), nodes.get(rank, "unknown node")
        if outcome is None:
            lines.append(f"  rank {rank} on {where}: still running when the job was stopped")
        elif isinstance(outcome, BaseException):
            lines.append(f"  rank {rank} on {where}: lost ({type(outcome).__name__}: "
                         f"{str(outcome).splitlines()[0] if str(outcome) else ''})")
        elif outcome["exit"] != 0:
            lines.append(f"  rank {rank} on {where}: exited with code {outcome['exit']}; last stderr lines:")
            lines.extend(f"    {line}" for line in outcome["stderr_tail"][-12:])
        else:
            lines.append(f"  rank {rank} on {where}: finished")
    return "\n".join(lines)


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(spec: dict, storage_options: dict, emit, error=_to_stderr, cancelled=lambda: False, gangs=None) -> int:
    """The job on the cluster; ``emit`` takes the lines the Dagster step reads (``ray_messages.ChunkWriter``),
    ``error`` the account of a failure (the Ray job's stderr; the resident driver hands it to the step);
    ``cancelled()`` true: the step gave up on the job (the resident driver's jobs: a stopped Dagster run), which
    ends as a failed one does; ``gangs``: where its ranks come from (``ray_gangs``; a new gang by default)."""
    import ray

    from batchrl.resources.ray_gangs import FreshGangs

    world, sharded = spec["world_size"], len(spec["configs"]) > 1
    gangs = gangs or FreshGangs()
    gang = gangs.take(spec, storage_options, cancelled, error, PLACEMENT_TIMEOUT_S)
    if gang is None:
        return 1
    ranks, succeeded = gang.ranks, False
    try:
        address, port = ray.get(ranks[0].rendezvous.remote())
        nodes = dict(enumerate(ray.get([r.node.remote() for r in ranks])))
        emit(f"batchrl job {spec['job']!r}: {world} rank(s) on {sorted(set(nodes.values()))}"
             + (" (kept from an earlier job)" if gang.reused else ""))
        outcomes, reports = RankOutcomes(world), {}
        for r, rank in enumerate(ranks):
            stream = rank.run.options(num_returns="streaming").remote(
                rank_env(r, world if not sharded else 1, address, port, pipes=not sharded, job_env=spec.get("env")))
            threading.Thread(target=_relay, args=(r, stream, outcomes, reports, emit if r == 0 and not sharded
                                                  else None),
                             daemon=True).start()
        outcomes.wait(cancelled)
        if cancelled():
            error(f"batchrl job {spec['job']!r} was cancelled by its Dagster step; nothing was uploaded")
            return 1
        if outcomes.failed() or len(outcomes.ended) < world:
            error(failure_message(spec, outcomes, nodes))
            return 1
        reads = dict(enumerate(ray.get([rank.inputs_read.remote() for rank in ranks])))
        if any(sum(read.values()) for read in reads.values()):
            emit(f"batchrl job {spec['job']!r}: published inputs (rank: from its node's cache, built from a job's "
                 f"output on its node, fetched) "
                 f"{ {r: (read['cached'], read['produced'], read['fetched']) for r, read in reads.items()} }")
        resident = {r: o["worker_pid"] for r, o in outcomes.ended.items() if o.get("worker_pid")}
        if resident:
            emit(f"batchrl job {spec['job']!r}: ran in the nodes' resident job workers (rank: pid) {resident}")
        ray.get([rank.publish.remote() for rank in ranks[1:]])
        ray.get(ranks[0].publish.remote())  # last: rank 0's copy of a name every rank wrote wins
        ray.get([rank.close.remote() for rank in ranks])
        if sharded:
            report_merged(reports, world, emit)
        succeeded = True
        return 0
    finally:
        gangs.give_back(gang, succeeded)


def merged_numbers(reports: list[dict]) -> dict:
    """Replicas' sampling numbers as one: counts and rates add up, times are the slowest replica's, means weigh by
    samples, anything else is the first replica's."""
    total = sum(int(r.get("samples", 0)) for r in reports) or 1
    merged = dict(reports[0])
    for key, value in reports[0].items():
        values = [r.get(key, 0) for r in reports]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key == "samples" or key.endswith("tokens_per_s"):
            merged[key] = sum(values)
        elif key.endswith("_s"):
            merged[key] = max(values)
        else:
            merged[key] = sum(v * int(r.get("samples", 0)) for v, r in zip(values, reports)) / total
    return merged


def report_merged(reports: dict[int, dict], replicas: int, emit) -> None:
    """One Pipes materialisation for the replicas of a sharded job (``merged_numbers``)."""
    from dagster_pipes import open_dagster_pipes

    written = io.StringIO()
    with contextlib.redirect_stdout(written), open_dagster_pipes() as pipes:  # its messages go to stdout
        pipes.log.info(f"{replicas} replicas: " + ", ".join(f"{r}: {reports[r].get('samples')} samples"
                                                             for r in sorted(reports)))
        pipes.report_asset_materialization(metadata={**merged_numbers([reports[r] for r in sorted(reports)]),
                                                     "replicas": replicas})
    for line in written.getvalue().splitlines():
        emit(line)


def main(argv: list[str]) -> int:
    import ray

    storage_options = read("BATCHRL_RAY_STORAGE_OPTIONS")
    fs, path = fsutil.filesystem_for(argv[0], storage_options)
    with fs.open(path) as f:
        spec = json.load(f)
    ray.init(address="auto", log_to_driver=True)  # the cluster this job was submitted to
    writer = ChunkWriter(spec["messages"], storage_options)
    try:
        return run(spec, storage_options, writer.emit)
    finally:
        writer.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
