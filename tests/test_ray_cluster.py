"""The `ray` environment on a real Ray cluster of two nodes (a head and a second node, `ray start` each, one CPU
slot each) with storage on the moto S3 server: DPO and an RL iteration train data-parallel with 2 ranks, one on
each node (placement group STRICT_SPREAD, gloo rendezvous through Ray), and give the data versions of the local
environment for the same seed (its trainers data-parallel too: 2 gloo ranks under torchrun); a node killed in the
middle of the DPO job fails the step with a message naming the lost rank, publishes nothing, and the rerun
completes; rollout replicas join their shards in a fixed order. The DPO path and the replicas run a Ray job per
step (dagster-ray's client, the default); the RL iteration runs through a driver resident on the cluster.

Everything runs in a network namespace whose only interface is loopback (``helpers_ray``): the outer test starts
this module's `on_the_cluster` tests there and passes when they pass.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import threading
import time

import dagster as dg
import pandas as pd
import pytest
from helpers_ray import (
    DASHBOARD_PORT, GCS_PORT, bring_loopback_up, job_processes, kill_node, listening_addresses, namespaces_command,
    only_loopback, start_node, wait_for_nodes,
)
from pipeline_helpers import RL_LOOP, SMALL, UPSTREAM, latest_metadata, recipe, run_assets

from batchrl.assets.rollout_prefetch import NEXT_ROLLOUTS_SEED_TAG
from batchrl.resources import (
    CatalogResource, ComputeResource, LandingResource, RolloutEngineResource, StorageResource,
    TrainerLauncherResource,
)
from batchrl.resources.ray_launch import RayJobs

# The cases below run only inside the loopback-only namespace: the outer test collects them there by their prefix
# (``cluster_case_``), so outside they are neither collected nor reported as skipped.
INNER_FUNCTIONS = "cluster_case_*"
DPO_PATH = ["dpo_pairs", "reference_logprobs", "dpo_checkpoint"]
RUN_CONFIG = {**SMALL, "ops": {**SMALL["ops"],
                      "dpo_pairs": {"config": {"max_logged_pairs": 16}},
                      "dpo_checkpoint": {"config": {"epochs": 1, "micro_batch_size": 2, "global_batch_size": 4}}}}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_node_ray_cluster_in_a_loopback_only_network(tmp_path):
    unshare = namespaces_command()
    if unshare is None:
        pytest.skip("no user+network namespaces here (`unshare --user --net`): Ray's servers listen on every "
                    "interface, which tests here must not")
    # one thread per process everywhere, as on the 1-CPU nodes: the same float sums in every process
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "BATCHRL_RAY_INPUT_CACHE_DIR": str(tmp_path / "node_inputs")}
    command = [*unshare, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra",
               "--durations=0", "--basetemp", str(tmp_path / "inner"), os.path.abspath(__file__),
               "-o", f"python_functions={INNER_FUNCTIONS}"]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=840)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-12000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1]


def resources(storage: StorageResource, catalog: str, trainer: TrainerLauncherResource, jobs: bool) -> dict:
    """``jobs``: every model stage a job (the rollouts and the inference tasks too, as in the ray environment);
    else as in the local environment (those in this process)."""
    return {"storage": storage, "catalog": CatalogResource(path=catalog), "landing": LandingResource(),
            "rollout_engine": RolloutEngineResource(in_subprocess=jobs), "trainer": trainer,
            "compute": ComputeResource(in_subprocess=jobs)}


@pytest.fixture(scope="module")
def cluster(s3_server):
    """The two nodes (the second restartable: ``nodes["second"]``) once the namespace's loopback is up."""
    bring_loopback_up()
    assert only_loopback()
    nodes = {"head": start_node(head=True), "second": start_node(head=False)}
    wait_for_nodes(2)
    yield nodes
    for temp_dir in nodes.values():
        kill_node(temp_dir)


@pytest.fixture(scope="module")
def on_ray(cluster, s3_server, tmp_path_factory):
    """The ray environment's resources (2 ranks, one per node) over s3://ray-test/root, and a Dagster home."""
    import s3fs

    options = {"client_kwargs": {"endpoint_url": s3_server}}
    s3fs.S3FileSystem(**options).mkdir("ray-test")
    folder = tmp_path_factory.mktemp("on_ray")
    root = "s3://ray-test/root"
    ray = RayJobs(address=f"http://127.0.0.1:{DASHBOARD_PORT}", world_size=2, placement_strategy="STRICT_SPREAD",
                  storage_root=root, storage_options=options)
    storage = StorageResource(root=root, storage_options=options, cache_dir=str(folder / "cache"))
    trainer = TrainerLauncherResource(backend="ray", ray=ray)
    (folder / "home").mkdir()
    return {"resources": resources(storage, str(folder / "catalog.duckdb"), trainer, jobs=True),
            "home": str(folder / "home"), "root": root, "options": options, "ray": ray}


@pytest.fixture(scope="module")
def local_versions(tmp_path_factory) -> dict[str, str]:
    """The local environment's data versions of the same runs (its trainers on 2 gloo ranks under torchrun; the
    rollouts and the inference tasks in this process, one torch thread like the nodes')."""
    folder = tmp_path_factory.mktemp("local")
    root = str(folder / "storage")
    storage = StorageResource(root=root, cache_dir=str(folder / "cache"))
    trainer = TrainerLauncherResource(num_gpus=2)
    (folder / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(folder / "home")) as instance:
        assert run_assets(resources(storage, str(folder / "catalog.duckdb"), trainer, jobs=False), instance,
                          UPSTREAM + DPO_PATH + RL_LOOP, RUN_CONFIG).success
        return {a: latest_metadata(instance, a)["data_version"] for a in DPO_PATH + RL_LOOP + ["base_model"]}


def _kill_second_node_when_training(cluster: dict, killed: dict) -> None:
    """Once the DPO job's rank on the second node (0 or 1: Ray picks each bundle's node) has run 2 s: the whole node
    SIGKILLed, as a machine lost."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not killed:
        procs = job_processes(cluster["second"], "batchrl.training.jobs.train_dpo")
        if procs and time.time() - procs[0].create_time() > 2.0:
            killed["processes"] = kill_node(cluster["second"])
            killed["at"] = time.monotonic()
        time.sleep(0.1)


def _step_failures(result) -> list[str]:
    return [e.step_failure_data.error.message for e in result.all_events if e.is_step_failure]


def cluster_case_a_node_lost_mid_dpo_fails_the_step_and_publishes_nothing(cluster, on_ray):
    import s3fs

    killed: dict = {}
    killer = threading.Thread(target=_kill_second_node_when_training, args=(cluster, killed), daemon=True)
    killer.start()
    with dg.DagsterInstance.local_temp(on_ray["home"]) as instance:
        result = run_assets(on_ray["resources"], instance, UPSTREAM + DPO_PATH, RUN_CONFIG)
        killer.join(timeout=5)
        assert killed.get("processes"), "the second node was never seen running a rank"
        assert not result.success
        failures = _step_failures(result)
        assert len(failures) == 1 and "job 'train_dpo' failed on the Ray cluster" in failures[0], failures
        assert "nothing was uploaded" in failures[0], failures[0]
        assert len(re.findall(r"rank [01] on 127\.0\.0\.1 \(node \w+\): lost \(", failures[0])) == 1, failures[0]
        nodes = re.findall(r"rank [01] on 127\.0\.0\.1 \(node (\w+)\)", failures[0])
        assert len(set(nodes)) == 2, failures[0]  # the placement group put one rank on each node
        assert instance.get_latest_materialization_event(dg.AssetKey("dpo_checkpoint")) is None
        assert latest_metadata(instance, "reference_logprobs")["data_version"]  # the steps before it published
    fs = s3fs.S3FileSystem(**on_ray["options"])
    assert not fs.exists(f"{on_ray['root']}/dpo_checkpoint")  # nothing partial under the storage root
    wait_for_nodes(1)  # the lost node marked dead first: else the count of 2 below could still include it
    cluster["second"] = start_node(head=False)  # a replacement node for the rerun
    wait_for_nodes(2)


def cluster_case_the_dpo_rerun_completes_with_the_local_data_versions(cluster, on_ray, local_versions):
    with dg.DagsterInstance.local_temp(on_ray["home"]) as instance:
        started = time.perf_counter()
        assert run_assets(on_ray["resources"], instance, ["dpo_checkpoint"], RUN_CONFIG).success
        print(f"dpo_checkpoint on 2 nodes: {time.perf_counter() - started:.1f} s")
        for asset in ("base_model", "reference_logprobs", "dpo_checkpoint"):
            assert latest_metadata(instance, asset)["data_version"] == local_versions[asset], asset


def cluster_case_rollout_replicas_join_their_shards_in_order(cluster, on_ray):
    """2 replicas, one per node: shard r (a contiguous half of the prompts) sampled with seed s * 1000 + r, the
    shards joined in order with the prompt indices of the whole request: the table sampling each shard here gives."""
    from batchrl.resources.ray_launch import REPLICA_SEED_STRIDE
    from batchrl.training.rollout.sampling_job import sample_to_parquet
    from batchrl.training.data.text import prompt_messages

    replicated = {**on_ray["resources"], "trainer": TrainerLauncherResource(
        backend="ray", ray=on_ray["ray"].model_copy(update={"rollout_replicas": 2}))}
    seed = 3
    config = {**RUN_CONFIG,
              "ops": {**RUN_CONFIG["ops"], "rollouts": {"config": {**SMALL["ops"]["rollouts"]["config"], "seed": seed}}}}
    with dg.DagsterInstance.local_temp(on_ray["home"]) as instance:
        assert run_assets(replicated, instance, ["rollouts"], config).success
        meta = latest_metadata(instance, "rollouts")
    storage = on_ray["resources"]["storage"]
    table = pd.read_parquet(_localized(storage, meta["uri"]))
    rows = table.drop_duplicates("prompt_index").to_dict("records")
    policy = _localized(storage, meta["policy"])
    engine = on_ray["resources"]["rollout_engine"].engine_options(policy, storage.cache_dir)
    half, expected = len(rows) // 2, []
    for r, shard in enumerate((rows[:half], rows[half:])):
        out = os.path.join(storage.cache_dir, f"shard{r}.parquet")
        sample_to_parquet(engine, [row["prompt"] for row in shard], n=2, seed=seed * REPLICA_SEED_STRIDE + r,
                          out_parquet=out, messages=prompt_messages(shard))
        expected.append(pd.read_parquet(out).assign(prompt_index=lambda t, o=r * half: t["prompt_index"] + o))
    expected = pd.concat(expected, ignore_index=True)
    assert table["prompt_index"].tolist() == expected["prompt_index"].tolist()
    assert table["response"].tolist() == expected["response"].tolist()


def _running_drivers(address: str) -> dict[str, str]:
    """The resident drivers running on the cluster: each one's log."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(address)
    return {j.submission_id: client.get_job_logs(j.submission_id) for j in client.list_jobs()
            if (j.submission_id or "").startswith("batchrl-driver-") and str(j.status).endswith("RUNNING")}


def _stop_the_driver_once_it_claimed(address: str, job: str, stopped: dict) -> None:
    """Once the running resident driver has claimed one more ``job`` than it had (its log says so): its Ray job
    stopped, as a lost driver."""
    from ray.job_submission import JobSubmissionClient

    def claims() -> dict[str, int]:
        return {driver: log.count(f"claimed job {job!r}") for driver, log in _running_drivers(address).items()}

    before, deadline = claims(), time.monotonic() + 120
    while time.monotonic() < deadline and not stopped:
        for driver, count in claims().items():
            if count > before.get(driver, 0):
                JobSubmissionClient(address).stop_job(driver)
                stopped["driver"] = driver
        time.sleep(0.2)


def cluster_case_an_rl_iteration_through_a_resident_driver_gives_the_local_data_versions(cluster, on_ray,
                                                                                        local_versions, capsys):
    """``resident_driver_idle_s``: the RL iteration's jobs (2 ranks for the update, one on each node) handed to one
    driver that stays on the cluster, with the data versions of the local environment, the base model read from the
    copies the DPO path's jobs left on the nodes; a job of the same shape as the one before runs on the ranks that
    job left (same table); a driver stopped while it runs a job (here: waiting for a placement the cluster cannot
    give) fails the step with its fate, and the next run submits a new driver and completes. (The per-step path's
    jobs: the DPO path's and the rollout replicas'.)"""
    resident = on_ray["ray"].model_copy(update={"resident_driver_idle_s": 30.0})
    on_driver = {**on_ray["resources"], "trainer": TrainerLauncherResource(backend="ray", ray=resident)}
    with dg.DagsterInstance.local_temp(on_ray["home"]) as instance:
        started = time.perf_counter()
        assert run_assets(on_driver, instance, RL_LOOP, RUN_CONFIG).success
        took = time.perf_counter() - started
        out = capsys.readouterr().out
        reads = _published_input_reads(out)
        assert reads and any(cached for read in reads for cached, _, _ in read.values()), out[-6000:]
        print(f"RL iteration on 2 nodes through the resident driver: {took:.1f} s; published inputs per job {reads}")
        drivers = _running_drivers(resident.address)  # the rollouts and the update: one driver took both
        assert len(drivers) == 1 and all(f"claimed job {job!r}" in log for log in drivers.values()
                                         for job in ("rollouts", "train_policy")), drivers
        for asset in RL_LOOP:
            assert latest_metadata(instance, asset)["data_version"] == local_versions[asset], asset
        assert latest_metadata(instance, "policy_checkpoint")["global_step"] > 0
        capsys.readouterr()
        versions = []
        for _ in range(2):  # after the update's 2-rank gang: a new 1-rank gang, then the same one kept
            assert run_assets(on_driver, instance, ["rollouts"], RUN_CONFIG).success
            versions.append(latest_metadata(instance, "rollouts")["data_version"])
        placed = re.findall(r"batchrl job 'rollouts': 1 rank\(s\) on .*", capsys.readouterr().out)
        assert len(placed) == 2 and "kept from an earlier job" in placed[1] and "kept" not in placed[0], placed
        assert versions[0] == versions[1]
        unplaceable = {**on_driver, "trainer": TrainerLauncherResource(
            backend="ray", ray=resident.model_copy(update={"cpus_per_rank": 2.0}))}  # 1-CPU nodes: it waits
        stopped: dict = {}
        stopper = threading.Thread(target=_stop_the_driver_once_it_claimed, args=(resident.address, "rollouts",
                                                                                  stopped), daemon=True)
        stopper.start()
        failed = run_assets(unplaceable, instance, ["rollouts"], RUN_CONFIG)
        stopper.join(timeout=5)
        assert stopped.get("driver") and not failed.success
        failures = _step_failures(failed)
        assert len(failures) == 1 and f"the resident Ray driver {stopped['driver']} ended (STOPPED)" in failures[0], \
            failures
        assert "job 'rollouts' failed on the Ray cluster" in failures[0] and "nothing is published" in failures[0]
        rerun = run_assets(on_driver, instance, ["rollouts"], RUN_CONFIG)
        assert rerun.success
        assert [driver for driver, log in _running_drivers(resident.address).items()
                if "claimed job 'rollouts'" in log and driver not in drivers]  # a new one took the rerun
        # a driver that ends as a job is handed to it (its idle time up) without taking it: the job is taken back
        # and handed to a new driver
        idling = _an_ending_driver_as_the_current_one(on_ray, resident.address)
        handed_back = run_assets(on_driver, instance, ["rollouts"], RUN_CONFIG)
        assert handed_back.success
        handed = [e.user_message for e in instance.all_logs(handed_back.run_id)
                  if "handed to the resident Ray driver" in e.user_message]
        assert len(handed) == 2 and idling["submission_id"] in handed[0], handed  # the ending one's, then a new one's
        assert any("claimed job 'rollouts'" in log for log in _running_drivers(resident.address).values())
        assert not _files_under(on_ray, idling["inbox"])  # nothing left behind in the ended driver's inbox


def _published_input_reads(out: str, job: str = r"\w+") -> list[dict]:
    """Each ``job``'s ``{rank: (from its node's cache, built from a job's output on its node, fetched)}``."""
    lines = re.findall(rf"batchrl job '{job}': published inputs \(rank: from its node's cache, built from a job's "
                       r"output on its node, fetched\) (\{.*\})", out)
    return [ast.literal_eval(line) for line in lines]


def cluster_case_an_update_on_one_rank_samples_the_next_rollouts_ahead_on_its_node(cluster, on_ray, capsys):
    """With one rank and the nodes' resident workers, the policy update samples the next iteration's rollouts from
    its new weights on its node while it exports them (as the gpu environment's warm worker does); the next rollouts
    job, on the gang the update left, takes them from that node's cache: the samples it would have drawn itself
    (the same data version as a rerun that samples). That job's node builds its copy of the new policy from the
    update's output it kept (its weights linked, not downloaded)."""
    one_rank = on_ray["ray"].model_copy(update={"world_size": 1, "resident_driver_idle_s": 30.0})
    on_one_rank = {**on_ray["resources"], "trainer": TrainerLauncherResource(backend="ray", ray=one_rank)}
    # another lr than the RL iteration's update: a policy no node has read yet
    ahead = {**RUN_CONFIG, "resources": recipe(samples_per_prompt=2, sample_ahead=True),
             "ops": {**RUN_CONFIG["ops"], "policy_checkpoint": {"config": {"micro_batch_size": 4, "lr": 3.0e-4}}}}
    next_rollouts = {**ahead, "ops": {**ahead["ops"], "rollouts": {"config": {"max_prompts": 8, "seed": 7}}}}
    with dg.DagsterInstance.local_temp(on_ray["home"]) as instance:
        assert run_assets(on_one_rank, instance, ["policy_checkpoint"], ahead, tags={NEXT_ROLLOUTS_SEED_TAG: "7"}
                          ).success
        update = latest_metadata(instance, "policy_checkpoint")
        assert update["sample_ahead_seed"] == "7"
        # where the step's wall went on the Ray path: the job's own wall lies within its hand-over to its end
        assert 0 < update["wall_s"] < update["ray_s/job"] and update["ray_s/stage_in"] >= 0 <= update["ray_s/stage_out"]
        capsys.readouterr()
        taken = []
        for _ in range(2):  # the first takes what the update drew ahead; the second samples the same request
            assert run_assets(on_one_rank, instance, ["rollouts"], next_rollouts).success
            taken.append(latest_metadata(instance, "rollouts"))
        out = capsys.readouterr().out
        (first, *_) = _published_input_reads(out, "rollouts")
        assert first[0][1] == 1, (taken, out[-8000:])  # the new policy: built from the update's output there
        assert [(m["prefetched"], m["sampled_ahead"]) for m in taken] == [(True, True), (False, False)], taken
        assert taken[0]["data_version"] == taken[1]["data_version"]


def _an_ending_driver_as_the_current_one(on_ray: dict, address: str) -> dict:
    """A Ray job that stays 8 s and takes no job, recorded as the current resident driver."""
    import s3fs
    from ray.job_submission import JobSubmissionClient

    from batchrl.resources.ray_resident_driver import CURRENT, drivers_prefix

    client = JobSubmissionClient(address)
    submission_id = client.submit_job(entrypoint="python -c 'import time; time.sleep(8)'",
                                      submission_id=f"batchrl-driver-ending{int(time.time())}")
    prefix = drivers_prefix(on_ray["root"].removeprefix("s3://"))
    current = {"submission_id": submission_id, "inbox": f"{prefix}/{submission_id}/inbox",
               "results": f"{prefix}/{submission_id}/results"}
    s3fs.S3FileSystem(**on_ray["options"]).pipe_file(f"{prefix}/{CURRENT}", json.dumps(current).encode())
    deadline = time.monotonic() + 30
    while not str(client.get_job_status(submission_id)).endswith("RUNNING") and time.monotonic() < deadline:
        time.sleep(0.1)
    return current


def _files_under(on_ray: dict, folder: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(**on_ray["options"])
    return fs.find(folder) if fs.exists(folder) else []


def cluster_case_a_job_its_step_gave_up_on_ends_and_gives_back_its_placement(cluster):
    """A job in the resident driver ends when its step gives up on it (a stopped Dagster run), here while Ray
    places ranks the cluster cannot hold (2 CPUs on 1-CPU nodes): it fails with that reason within seconds, not
    after the placement timeout, and its placement group is removed."""
    import ray
    from ray.util import placement_group_table

    from batchrl.resources.ray_driver import run

    ray.init(address=f"127.0.0.1:{GCS_PORT}", log_to_driver=False)
    try:
        before, errors, started = set(placement_group_table()), [], time.monotonic()
        spec = {"job": "rollouts", "world_size": 1, "configs": [{}], "cpus_per_rank": 2.0, "gpus_per_rank": 0.0,
                "placement_strategy": "PACK"}
        code = run(spec, {}, print, error=errors.append, cancelled=lambda: time.monotonic() - started > 1.5)
        assert code == 1 and time.monotonic() - started < 10, errors
        assert errors == ["batchrl job 'rollouts' was cancelled by its Dagster step while Ray placed its ranks"]
        created = {k: v for k, v in placement_group_table().items() if k not in before}
        assert len(created) == 1 and all(g["state"] == "REMOVED" for g in created.values()), created
    finally:
        ray.shutdown()


def _localized(storage: StorageResource, uri: str) -> str:
    """The local copy of the artifact at ``uri`` (``<root>/<asset>/<version>``): its folder, or its one parquet."""
    asset, version = uri.rstrip("/").split("/")[-2:]
    folder = storage.localize({"asset": asset, "data_version": version, "uri": uri})
    tables = [f for f in os.listdir(folder) if f.endswith(".parquet")]
    return os.path.join(folder, tables[0]) if asset == "rollouts" else folder


def cluster_case_every_listener_is_on_loopback(cluster):
    assert listening_addresses() <= {"127.0.0.1", "::1", "0.0.0.0", "::", "::ffff:127.0.0.1"}
    assert only_loopback()  # 0.0.0.0 in a namespace whose one interface is lo: loopback only


def cluster_case_one_process_jobs_ran_in_the_nodes_resident_workers(cluster):
    """The reference pass and the rollouts (one rank each) and the two rollout replicas ran in job workers resident
    on their nodes (re-parented, so nobody's child), keyed by node and rank slot: both slots seen."""
    import psutil

    sockets = [part for proc in psutil.process_iter(["cmdline"]) for part in proc.info["cmdline"] or []
               if "-ray-" in part and part.endswith(".sock")]
    assert {s.rsplit("-", 1)[1] for s in sockets} == {"0.sock", "1.sock"}, sockets
