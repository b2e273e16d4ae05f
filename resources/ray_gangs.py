"""A job's ranks on the Ray cluster: a placement group and one ``JobRank`` actor per bundle (a gang).

A Ray job per step (``ray_driver`` as the step's own driver) places a new gang for its job and removes it at the
end (``FreshGangs``). The resident driver keeps a gang that finished its job well (``KeptGangs``) and hands it the
next job of the same shape (ranks, bundle, strategy): no placement group to wait for and no actor processes to
start, a large part of what a job cost once the submission was gone (bench/RESULTS.md, issue 49). Placement stays
Ray's: a kept gang holds its bundles, so taking a gang of another shape first gives back the idle ones (two
shapes that need the same GPUs never wait on each other), and the driver gives back those idle longer than
``KEPT_IDLE_S``. A gang whose job failed is never kept (a rank may have died with its node).
"""
from __future__ import annotations

import json
import threading
import time

KEPT_IDLE_S = 60.0


class Gang:
    def __init__(self, key: str, group, ranks: list, reused: bool = False):
        self.key, self.group, self.ranks, self.reused = key, group, ranks, reused
        self.idle_since = time.monotonic()


def gang_key(spec: dict) -> str:
    bundle = {"CPU": spec["cpus_per_rank"], **({"GPU": spec["gpus_per_rank"]} if spec["gpus_per_rank"] else {})}
    return json.dumps([spec["world_size"], bundle, spec["placement_strategy"]], sort_keys=True)


class FreshGangs:
    """A new gang per job, gone with the job."""

    def take(self, spec: dict, storage_options: dict, cancelled, error, placement_timeout_s: float) -> Gang | None:
        """The job's gang, its actors holding the job; None (said through ``error``) when Ray could not place it
        in time or the step gave up meanwhile."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from batchrl.resources.ray_rank import JobRank

        world, key = spec["world_size"], gang_key(spec)
        bundle = json.loads(key)[1]
        group = placement_group([dict(bundle) for _ in range(world)], strategy=spec["placement_strategy"])
        ready, deadline = group.ready(), time.monotonic() + placement_timeout_s
        while not ray.wait([ready], timeout=1.0)[0]:  # asked again each second: the step may give up meanwhile
            if cancelled() or time.monotonic() > deadline:
                error(f"batchrl job {spec['job']!r} was cancelled by its Dagster step while Ray placed its ranks"
                      if cancelled() else f"batchrl job {spec['job']!r}: Ray could not place {world} rank(s) of "
                      f"{bundle} ({spec['placement_strategy']}) within {placement_timeout_s:.0f} s")
                remove_placement_group(group)
                return None
        actor = ray.remote(max_restarts=0)(JobRank)  # a restarted rank cannot rejoin its process group
        ranks = [actor.options(num_cpus=spec["cpus_per_rank"], num_gpus=spec["gpus_per_rank"],
                               scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   group, placement_group_bundle_index=r)).remote(spec, storage_options, r)
                 for r in range(world)]
        return Gang(key, group, ranks)

    def give_back(self, gang: Gang, job_succeeded: bool) -> None:
        release(gang)


def release(gang: Gang) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for rank in gang.ranks:
        ray.kill(rank)
    remove_placement_group(gang.group)


class KeptGangs(FreshGangs):
    """Gangs kept between jobs (the resident driver's); thread-safe: the driver runs jobs side by side."""

    def __init__(self):
        self.idle: list[Gang] = []
        self.lock = threading.Lock()

    def take(self, spec: dict, storage_options: dict, cancelled, error, placement_timeout_s: float) -> Gang | None:
        import ray

        key = gang_key(spec)
        with self.lock:
            gang = next((g for g in self.idle if g.key == key), None)
            if gang is not None:
                self.idle.remove(gang)
                others = []
            else:  # a new shape: the idle gangs' bundles given back first
                others, self.idle = self.idle, []
        for other in others:
            release(other)
        if gang is not None:
            try:  # its actors take this job (a rank lost while idle: a new gang instead)
                ray.get([rank.take_job.remote(spec, r) for r, rank in enumerate(gang.ranks)])
                gang.reused = True
                return gang
            except ray.exceptions.RayError:
                release(gang)
        return super().take(spec, storage_options, cancelled, error, placement_timeout_s)

    def give_back(self, gang: Gang, job_succeeded: bool) -> None:
        if not job_succeeded:
            release(gang)
            return
        gang.idle_since = time.monotonic()
        with self.lock:
            self.idle.append(gang)

    def release_idle(self, older_than_s: float = KEPT_IDLE_S) -> None:
        with self.lock:
            old = [g for g in self.idle if time.monotonic() - g.idle_since > older_than_s]
            self.idle = [g for g in self.idle if g not in old]
        for gang in old:
            release(gang)
