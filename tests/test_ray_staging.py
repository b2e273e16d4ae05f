"""How a Ray job's files travel through the storage root (resources/ray_staging.py) and how rollout replicas split
and join (resources/ray_launch.py), without a cluster: the paths that travel, their rewriting on a node, the
upload / download round trip of what a job wrote, the replicas' shards and merged numbers."""

import os
import time

import dagster as dg
import pandas as pd

from batchrl.common import fsutil
from batchrl.resources import TrainerLauncherResource, ray_staging
from batchrl.resources.ray_driver import merged_numbers
from batchrl.resources.ray_launch import REPLICA_SEED_STRIDE, RayJobs, join_shards, shard_configs


def test_the_paths_that_travel_are_the_outermost_existing_or_writable_ones(tmp_path):
    work = tmp_path / "work"
    (work / "model").mkdir(parents=True)
    (tmp_path / "pairs.parquet").write_text("x")
    config = {"out_dir": str(work), "model_path": str(work / "model"), "pairs_parquet": str(tmp_path / "pairs.parquet"),
              "result_json": str(tmp_path / "result.json"), "missing": "/no/such/folder/file", "name": "relative/path",
              "engine": {"compile_cache_dir": str(tmp_path), "kind": "transformers"}, "uri": "s3://bucket/x"}
    assert ray_staging.path_roots(config) == sorted([str(tmp_path / "pairs.parquet"), str(tmp_path / "result.json"),
                                                     str(work)])
    moved = ray_staging.rewrite_paths(config, {str(work): "/scratch/0/work"})
    assert moved["model_path"] == "/scratch/0/work/model" and moved["out_dir"] == "/scratch/0/work"
    assert moved["engine"]["compile_cache_dir"] == str(tmp_path)  # a node's own cache stays the node's


def test_what_a_job_wrote_comes_back_and_nothing_else(tmp_path):
    fs, prefix = fsutil.filesystem_for(str(tmp_path / "storage"))
    work = tmp_path / "here" / "work"
    (work / "checkpoints").mkdir(parents=True)
    (work / "checkpoints" / "old.pt").write_text("old")
    ray_staging.upload(fs, f"{prefix}/in/0", ray_staging.local_files(str(work)))
    node = tmp_path / "node" / "work"
    assert ray_staging.download(fs, f"{prefix}/in/0", str(node)) == 1
    found = ray_staging.snapshot([str(node)])
    (node / "model").mkdir()
    (node / "model" / "weights.bin").write_text("new")
    changed = ray_staging.changed_files(str(node), found)
    assert changed == {"tree/model/weights.bin": str(node / "model" / "weights.bin")}
    ray_staging.upload(fs, f"{prefix}/out/0", changed)
    ray_staging.download(fs, f"{prefix}/out/0", str(work), link=True)
    assert (work / "model" / "weights.bin").read_text() == "new" and (work / "checkpoints" / "old.pt").exists()
    assert not [f for f in os.listdir(work / "model") if ".tmp-" in f]
    # a local storage root (one host): a finished job's outputs travel as hard links, its inputs as copies it may
    # change without touching the Dagster side's
    inode = os.stat(node / "model" / "weights.bin").st_ino
    assert os.stat(work / "model" / "weights.bin").st_ino == inode
    assert os.stat(f"{prefix}/in/0/tree/checkpoints/old.pt").st_ino == os.stat(work / "checkpoints" / "old.pt").st_ino
    assert os.stat(node / "checkpoints" / "old.pt").st_ino != os.stat(work / "checkpoints" / "old.pt").st_ino
    (tmp_path / "next.bin").write_text("next")  # a name uploaded again is replaced, never written in place
    ray_staging.upload(fs, f"{prefix}/out/0", {"tree/model/weights.bin": str(tmp_path / "next.bin")})
    assert (work / "model" / "weights.bin").read_text() == "new"
    assert open(f"{prefix}/out/0/tree/model/weights.bin").read() == "next"


def test_where_no_link_can_be_made_the_files_are_copied(tmp_path, monkeypatch):
    fs, prefix = fsutil.filesystem_for(str(tmp_path / "storage"))
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "weights.bin").write_text("w")

    def cross_device(source, dest):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(os, "link", cross_device)
    ray_staging.upload(fs, f"{prefix}/out/0", ray_staging.local_files(str(tmp_path / "job")))
    assert ray_staging.download(fs, f"{prefix}/out/0", str(tmp_path / "back"), link=True) == 1
    assert (tmp_path / "back" / "weights.bin").read_text() == "w"
    assert not [f for f in os.listdir(f"{prefix}/out/0/tree") if ".tmp-" in f]


def test_a_single_file_root_round_trips(tmp_path):
    fs, prefix = fsutil.filesystem_for(str(tmp_path / "storage"))
    (tmp_path / "result.json").write_text("{}")
    ray_staging.upload(fs, f"{prefix}/out/1", ray_staging.local_files(str(tmp_path / "result.json")))
    assert ray_staging.download(fs, f"{prefix}/out/1", str(tmp_path / "back.json")) == 1
    assert (tmp_path / "back.json").read_text() == "{}"


def test_replicas_sample_contiguous_shards_joined_in_order(tmp_path):
    pd.DataFrame({"prompt": [f"p{i}" for i in range(5)]}).to_parquet(tmp_path / "prompts.parquet")
    config = {"prompts_parquet": str(tmp_path / "prompts.parquet"), "out_parquet": str(tmp_path / "samples.parquet"),
              "seed": 7, "n": 2}
    shards = shard_configs(config, str(tmp_path), 2)
    assert [c["seed"] for c in shards] == [7 * REPLICA_SEED_STRIDE, 7 * REPLICA_SEED_STRIDE + 1]
    assert [pd.read_parquet(c["prompts_parquet"])["prompt"].tolist() for c in shards] == [["p0", "p1"],
                                                                                          ["p2", "p3", "p4"]]
    for c in shards:  # each replica numbers its own prompts from 0
        count = len(pd.read_parquet(c["prompts_parquet"]))
        pd.DataFrame({"prompt_index": [i for i in range(count) for _ in range(2)]}).to_parquet(c["out_parquet"])
    join_shards(shards, config["out_parquet"])
    assert pd.read_parquet(config["out_parquet"])["prompt_index"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert len(shard_configs(config, str(tmp_path), 9)) == 5  # never an empty shard


def test_replicas_numbers_merge_into_one_report():
    merged = merged_numbers([{"samples": 4, "generate_s": 2.0, "generated_tokens_per_s": 10.0, "stop_rate": 1.0,
                              "engine_reused": False},
                             {"samples": 12, "generate_s": 3.0, "generated_tokens_per_s": 30.0, "stop_rate": 0.5,
                              "engine_reused": False}])
    assert merged == {"samples": 16, "generate_s": 3.0, "generated_tokens_per_s": 40.0, "stop_rate": 0.625,
                      "engine_reused": False}


@dg.asset
def scored(context: dg.AssetExecutionContext, trainer: TrainerLauncherResource) -> None:
    workdir = os.path.dirname(trainer.ray.storage_root)
    trainer.run_job(context, "inference", {"task": "rewards", "out": os.path.join(workdir, "out.json")}, workdir)


def test_an_unreachable_cluster_fails_the_step_with_the_address(tmp_path):
    ray = RayJobs(address="http://127.0.0.1:9", storage_root=str(tmp_path / "storage"))  # nothing listens on 9
    result = dg.materialize([scored], resources={"trainer": TrainerLauncherResource(backend="ray", ray=ray)},
                            raise_on_error=False)
    message = [e.step_failure_data.error.message for e in result.all_events if e.is_step_failure][0]
    assert "could not reach the Ray cluster's job server at http://127.0.0.1:9" in message


def test_the_ray_environment_takes_its_cluster_and_storage_from_the_variables(monkeypatch):
    from batchrl.resources.environments import environment_resources

    monkeypatch.delenv("BATCHRL_PROFILE", raising=False)
    for name, value in {"BATCHRL_RAY_ADDRESS": "http://head:8265", "BATCHRL_RAY_WORLD_SIZE": "4",
                        "BATCHRL_RAY_ROLLOUT_REPLICAS": "2", "BATCHRL_RAY_PLACEMENT": "STRICT_SPREAD",
                        "BATCHRL_RAY_CPUS_PER_RANK": "8", "BATCHRL_RAY_RESIDENT_IDLE_S": "0",
                        "BATCHRL_S3_ROOT": "s3://team/artifacts", "BATCHRL_S3_ENDPOINT": "http://127.0.0.1:9"}.items():
        monkeypatch.setenv(name, value)
    resources = environment_resources("ray")
    trainer = resources["trainer"]
    assert trainer.backend == "ray" and (trainer.ray.address, trainer.ray.world_size) == ("http://head:8265", 4)
    assert (trainer.ray.rollout_replicas, trainer.ray.placement_strategy) == (2, "STRICT_SPREAD")
    assert (trainer.ray.cpus_per_rank, trainer.ray.resident_worker_idle_s) == (8.0, 0.0)  # 0: a fresh process per job
    assert trainer.ray.storage_root == resources["storage"].root == "s3://team/artifacts"
    assert trainer.ray.storage_options == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    assert resources["rollout_engine"].in_subprocess and resources["compute"].in_subprocess  # every model stage a job


def test_a_failed_rank_is_named_with_its_node_and_why(monkeypatch):
    from batchrl.resources import ray_driver

    monkeypatch.setattr(ray_driver, "FAILURE_GRACE_S", 0.2)
    outcomes = ray_driver.RankOutcomes(3)
    outcomes.end(0, {"exit": 1, "stderr_tail": ["Traceback (most recent call last):", "RuntimeError: gloo: peer gone"]})
    outcomes.end(1, ConnectionError("actor died\nmore"))
    outcomes.wait()  # rank 2 never ends: the grace runs out instead of waiting for it
    assert outcomes.failed() == [0, 1]
    message = ray_driver.failure_message({"job": "train_dpo"}, outcomes, {0: "10.0.0.1 (node a)", 1: "10.0.0.2 (node b)"})
    assert "batchrl job 'train_dpo' failed on the Ray cluster (3 rank(s)); nothing was uploaded" in message
    assert "rank 0 on 10.0.0.1 (node a): exited with code 1; last stderr lines:" in message
    assert "    RuntimeError: gloo: peer gone" in message
    assert "rank 1 on 10.0.0.2 (node b): lost (ConnectionError: actor died)" in message
    assert "rank 2 on unknown node: still running when the job was stopped" in message


class _Handler:
    """What the reader calls of Dagster's message handler (the real one runs in the two-node test)."""

    def __init__(self):
        self.messages, self.at = [], []

    @property
    def received_closed_message(self) -> bool:
        return any(m["method"] == "closed" for m in self.messages)

    def handle_message(self, message: dict) -> None:
        self.messages.append(message)
        self.at.append(time.monotonic())


def test_the_drivers_message_chunks_reach_the_reader_in_order_as_they_come(tmp_path, capsys):
    """The Ray job's Pipes messages through the storage root: the driver's lines in numbered chunks, handled in
    order by the step's reader while the job runs (within a fraction of a second of their chunk); lines that are not
    Pipes messages go to the step's stdout, the driver's lines after the job's closed message too (where the job
    ran, what it read): the reader ends once the Ray job has, having read every chunk."""
    from batchrl.resources import ray_messages
    from batchrl.resources.ray_launch import StorageMessageReader

    uri = str(tmp_path / "job" / "messages")
    writer = ray_messages.ChunkWriter(uri, {})
    handler, reader = _Handler(), StorageMessageReader(uri, {})
    with reader.read_messages(handler) as params:
        assert params == {"stdio": "stdout"}
        written = time.monotonic()
        writer.emit('{"__dagster_pipes_version": "0.1", "method": "opened", "params": {}}')
        deadline = time.monotonic() + 5
        while not handler.messages and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [m["method"] for m in handler.messages] == ["opened"]  # while the job still runs
        assert handler.at[0] - written < ray_messages.CHUNK_INTERVAL_S + 3 * ray_messages.POLL_S + 0.3
        writer.emit("batchrl job 'rollouts': 1 rank(s) on ['127.0.0.1']")
        writer.emit('{"__dagster_pipes_version": "0.1", "method": "closed", "params": {}}')
        deadline = time.monotonic() + 5
        while len(handler.messages) < 2 and time.monotonic() < deadline:  # the closed message read, in its chunk
            time.sleep(0.01)
        writer.emit("batchrl job 'rollouts': published inputs {0: (1, 0, 0)}")  # the driver's, after the job
        writer.close()
    assert [m["method"] for m in handler.messages] == ["opened", "closed"] and reader.chunks_read == 3
    out = capsys.readouterr().out  # each line once as the driver writes it, and the non-Pipes ones as read
    assert out.count("batchrl job 'rollouts': 1 rank(s) on ['127.0.0.1']\n") == 2
    assert out.count("batchrl job 'rollouts': published inputs {0: (1, 0, 0)}\n") == 2


def test_a_job_that_ended_without_closing_leaves_the_reader_at_once(tmp_path):
    """A failed job's driver writes no closed message: once the Ray job is over, what was written is read and the
    reader ends (no wait for messages that cannot come)."""
    from batchrl.resources import ray_messages
    from batchrl.resources.ray_launch import StorageMessageReader

    uri = str(tmp_path / "messages")
    writer = ray_messages.ChunkWriter(uri, {})
    handler = _Handler()
    with StorageMessageReader(uri, {}).read_messages(handler):
        writer.emit('{"__dagster_pipes_version": "0.1", "method": "opened", "params": {}}')
        writer.close()  # the driver exits; the job's status becomes terminal after that
        ended = time.monotonic()
    assert time.monotonic() - ended < 1.0 and [m["method"] for m in handler.messages] == ["opened"]


def test_the_resident_driver_leaves_a_spec_being_written_and_exits_when_idle(tmp_path):
    """A local storage root's spec still being written (its temp file) is not claimed; with nothing to run the
    driver exits after its idle seconds (the next step submits a new one)."""
    from batchrl.resources.ray_resident_driver import ResidentDriver

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "rollouts-1.json.tmp-0a1b").write_text('{"job": "roll')  # half written
    driver = ResidentDriver(str(inbox), idle_s=0.3, storage_options={})
    started = time.monotonic()
    driver.serve()
    assert 0.3 <= time.monotonic() - started < 5 and driver.running == 0
    assert [p.name for p in inbox.iterdir()] == ["rollouts-1.json.tmp-0a1b"]
