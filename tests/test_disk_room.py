"""Room on disk for the next RL iteration (cli/disk_room.py): what an iteration published, measured on this host's
real folders, and the check `batchrl run` makes at each iteration's boundary (its run: tests/test_loop_kill.py)."""
import shutil

from batchrl.cli.disk_room import GB, RETENTION_HINT, IterationRoom, published_bytes, shortfall


def test_what_an_iteration_published_is_its_artifacts_here_or_their_cached_copies(tmp_path):
    local = tmp_path / "root" / "policy_checkpoint" / "v1"
    local.mkdir(parents=True)
    (local / "model.safetensors").write_bytes(b"x" * 5000)
    cached = tmp_path / "cache" / "rollouts" / "v2"  # an S3 root: the copy its publisher keeps
    cached.mkdir(parents=True)
    (cached / "samples.parquet").write_bytes(b"y" * 700)
    done = [{"asset": "policy_checkpoint", "ok": True, "metadata": {"uri": str(local), "data_version": "v1"}},
            {"asset": "rollouts", "ok": True,
             "metadata": {"uri": "s3://bucket/root/rollouts/v2", "data_version": "v2"}},
            {"asset": "rewards", "ok": False, "metadata": {}},  # a failed step published nothing
            {"asset": "advantages", "ok": True, "metadata": {"uri": "s3://bucket/root/advantages/v3",
                                                             "data_version": "v3"}}]  # not on this host
    assert published_bytes(done, str(tmp_path / "cache")) == 5700


def test_the_check_says_where_the_next_iteration_would_not_fit(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    assert shortfall([str(tmp_path)], 1000, 0) is None
    line = shortfall([str(tmp_path / "not" / "yet")], free + GB, 0)  # the nearest existing folder's file system
    assert line.startswith(f"{tmp_path} has ") and f"published {(free + GB) / GB:.2f} GB" in line
    assert shortfall([str(tmp_path)], 1000, free / GB + 1) is not None  # the room kept free counts too

    room = IterationRoom([str(tmp_path), "s3://bucket/root"], str(tmp_path), keep_free_gb=free / GB + 1,
                         loop_assets=frozenset({"policy_checkpoint"}))
    assert room.paths == [str(tmp_path)]
    assert room.stop("RL iteration 2 of 3") is None  # nothing published yet: no estimate, no stop
    folder = tmp_path / "policy_checkpoint" / "v1"
    folder.mkdir(parents=True)
    (folder / "w.bin").write_bytes(b"w" * 100)
    base = tmp_path / "base_model" / "v0"  # the first execution builds the base too: not an iteration's need
    base.mkdir(parents=True)
    (base / "b.bin").write_bytes(b"b" * 5000)
    room.record([{"asset": "base_model", "ok": True, "metadata": {"uri": str(base), "data_version": "v0"}},
                 {"asset": "policy_checkpoint", "ok": True, "metadata": {"uri": str(folder), "data_version": "v1"}}])
    room.record([{"asset": "evaluation", "ok": True, "metadata": {"uri": str(base), "data_version": "v0"}}])
    assert room.last_bytes == 100 and room.stop("evaluation") is None
    said = room.stop("RL iteration 2 of 3")
    assert said.startswith("=== disk: ") and said.endswith(f"no further RL iteration ({RETENTION_HINT})\n")
    assert "--keep-last N --optimizer-states K" in said  # what frees the room: retention
    assert room.stop("RL iteration 3 of 3") == ""  # skipped too, said once
