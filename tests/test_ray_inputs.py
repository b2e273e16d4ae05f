"""A Ray job's published inputs (resources/ray_inputs.py) against the moto S3 server, without a cluster: which roots
are read where they are published, a node's copy fetched once and reused, the least recently used dropped."""
from __future__ import annotations

import os
import shutil
import time

from batchrl.common import fsutil
from batchrl.resources import StorageResource
from batchrl.resources.ray_inputs import PRODUCED_MIN_BYTES, NodeInputCache, artifact_sources


def _published(storage: StorageResource, tmp_path, name: str, text: str) -> str:
    """A published artifact of ``text`` and its local folder (as ``localize`` lays it out for a job config)."""
    staging = tmp_path / f"staging-{name}-{text}"
    (staging / "weights").mkdir(parents=True)
    (staging / "weights" / "model.bin").write_text(text)
    (staging / "config.json").write_text("{}")
    ref = storage.publish(str(staging), name, {"inputs": {}})
    return storage.localize(ref)


def _s3(s3_options, bucket: str):
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options)
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    return fs


def test_published_roots_are_read_where_they_are_and_the_rest_travel(s3_options, tmp_path):
    fs = _s3(s3_options, "ray-inputs")
    storage = StorageResource(root="s3://ray-inputs/root", storage_options=s3_options, cache_dir=str(tmp_path / "c"))
    model = _published(storage, tmp_path, "base_model", "weights v1")
    work = tmp_path / "work"
    work.mkdir()
    renamed = tmp_path / "copy"  # an artifact's record in a folder that is not the artifact's own
    shutil.copytree(model, renamed)
    elsewhere = StorageResource(root=str(tmp_path / "local_root"), cache_dir=str(tmp_path / "c2"))
    unpublished_here = _published(elsewhere, tmp_path, "base_model", "weights v2")  # not under this storage root
    roots = [model, str(work), str(renamed), unpublished_here, str(tmp_path / "missing.parquet")]
    sources = artifact_sources(roots, fs, "ray-inputs/root")
    assert sources == {0: fsutil.join("ray-inputs/root", "base_model", os.path.basename(model))}


def test_a_node_fetches_an_artifact_once_and_drops_the_least_recently_used(s3_options, tmp_path):
    fs = _s3(s3_options, "ray-node-cache")
    storage = StorageResource(root="s3://ray-node-cache/root", storage_options=s3_options,
                              cache_dir=str(tmp_path / "c"))
    folders = [_published(storage, tmp_path, "policy_checkpoint", f"weights {i}") for i in range(3)]
    remotes = [fsutil.join("ray-node-cache/root", "policy_checkpoint", os.path.basename(f)) for f in folders]
    cache = NodeInputCache(folder=str(tmp_path / "node"), entries=2)
    first = cache.local(fs, remotes[0])
    assert open(os.path.join(first, "weights", "model.bin")).read() == "weights 0"
    assert sorted(os.listdir(first)) == sorted(os.listdir(folders[0]))  # lineage.json too
    assert (cache.fetched, cache.reused) == (1, 0)
    inode = os.stat(first).st_ino
    assert cache.local(fs, remotes[0]) == first and (cache.fetched, cache.reused) == (1, 1)
    assert os.stat(first).st_ino == inode  # the same copy, not fetched again
    os.utime(first, (1, 1))  # used long ago
    cache.local(fs, remotes[1])
    cache.local(fs, remotes[2])  # a third entry: the least recently used (the first) goes
    kept = sorted(os.listdir(tmp_path / "node" / "policy_checkpoint"))
    assert kept == sorted(os.path.basename(f) for f in folders[1:])


def test_a_node_fetches_from_a_local_storage_root_too(tmp_path):
    """One machine's cluster (bench_ray_overhead.py) keeps its storage root in a local folder: same copy."""
    storage = StorageResource(root=str(tmp_path / "root"), cache_dir=str(tmp_path / "c"))
    folder = _published(storage, tmp_path, "base_model", "local weights")
    fs, base = fsutil.filesystem_for(str(tmp_path / "root"))
    assert artifact_sources([folder], fs, base) == {0: fsutil.join(base, "base_model", os.path.basename(folder))}
    copy = NodeInputCache(folder=str(tmp_path / "node")).local(fs, fsutil.join(base, "base_model",
                                                                              os.path.basename(folder)))
    assert open(os.path.join(copy, "weights", "model.bin")).read() == "local weights"
    assert sorted(os.listdir(copy)) == sorted(os.listdir(folder))


def test_what_jobs_leave_on_a_node_is_no_cached_artifact_and_goes_after_an_hour(tmp_path):
    """The node's own folder (``ray_staging.node_cache``: samples an update drew ahead) sits beside the artifact
    copies without counting as one of them; an entry an hour untouched is removed when a job next stages there."""
    storage = StorageResource(root=str(tmp_path / "root"), cache_dir=str(tmp_path / "c"))
    fs, base = fsutil.filesystem_for(str(tmp_path / "root"))
    cache = NodeInputCache(folder=str(tmp_path / "node"), entries=1)
    own = cache.node_folder()
    fresh, stale = (os.path.join(own, "rollout_prefetch", name) for name in ("fresh", "stale"))
    for folder in (fresh, stale):
        os.makedirs(folder)
    os.utime(stale, (1, 1))
    for text in ("a", "b"):  # past the one entry kept: eviction runs, and leaves the node's folder alone
        folder = _published(storage, tmp_path, "base_model", text)
        cache.local(fs, fsutil.join(base, "base_model", os.path.basename(folder)))
    assert os.path.isdir(fresh) and os.path.isdir(stale)
    assert cache.node_folder() == own and os.path.isdir(fresh) and not os.path.exists(stale)


def test_an_output_a_job_wrote_on_the_node_is_linked_not_downloaded_once_published(tmp_path):
    """The update's new policy, read by the next jobs on the node that wrote it: its big files come from the
    links the rank kept (here told apart by content, which a real publication never changes), every other file
    from the storage root; the kept links are used once, and only the newest few are kept."""
    storage = StorageResource(root=str(tmp_path / "root"), cache_dir=str(tmp_path / "c"))
    fs, base = fsutil.filesystem_for(str(tmp_path / "root"))
    size = PRODUCED_MIN_BYTES + 1
    written, staging = tmp_path / "scratch" / "model", tmp_path / "staging"
    for folder, byte, config in ((written, b"x", '{"job": 1}'), (staging, b"w", '{"published": 1}')):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(byte * size)
        (folder / "config.json").write_text(config)
    version = "f" * 64  # the job's hash of what it wrote
    ref = storage.publish(str(staging), "policy_checkpoint", {"inputs": {}}, content_hash=version)
    cache = NodeInputCache(folder=str(tmp_path / "node"))
    cache.keep_produced(str(written), version)
    shutil.rmtree(tmp_path / "scratch")  # the rank's scratch goes; the links it kept stay
    copy = cache.local(fs, fsutil.join(base, "policy_checkpoint", ref.data_version))
    assert (cache.produced, cache.fetched) == (1, 0)
    assert open(os.path.join(copy, "model.safetensors"), "rb").read(1) == b"x"  # linked
    assert open(os.path.join(copy, "config.json")).read() == '{"published": 1}'  # small: downloaded
    assert os.path.isfile(os.path.join(copy, "lineage.json"))
    assert not os.listdir(os.path.join(cache.node_folder(), "produced"))  # used once
    for i in range(3):  # outputs no later job here read: the newest two are kept
        (tmp_path / f"out{i}").mkdir()
        (tmp_path / f"out{i}" / "w.bin").write_bytes(b"y")
        cache.keep_produced(str(tmp_path / f"out{i}"), f"{i}" * 64)
        made = time.time() - 60 + i  # in order, within the hour
        os.utime(os.path.join(cache.node_folder(), "produced", f"{i}" * 16), (made, made))
    assert sorted(os.listdir(os.path.join(cache.node_folder(), "produced"))) == ["1" * 16, "2" * 16]
