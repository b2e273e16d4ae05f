"""S3 through a real S3 API (moto server) behind a fault-injecting proxy: 503s and read timeouts are
retried with backoff by botocore/s3fs; an outage mid-publish leaves no artifact a reader would take."""
from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest
from bad_inputs import good, jl
from flaky_s3 import FlakyS3Proxy

from batchrl.ingest import IngestConfig, discover_inputs, ingest_logs
from batchrl.resources import StorageResource
from batchrl.resources.storage import LINEAGE_FILE


def _options(url: str, **config) -> dict:
    return {"client_kwargs": {"endpoint_url": url}, "config_kwargs": {"retries": {"max_attempts": 6}, **config}}


@pytest.fixture
def landed(s3_options):
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options)
    if not fs.exists("flaky-landing"):
        fs.mkdir("flaky-landing")
    for i in range(2):
        fs.pipe(f"flaky-landing/drop/part-{i}.jsonl", jl(*good(50, start=100 * i)))
    return "s3://flaky-landing/drop"


def _ingest(uri: str, options: dict, out) -> tuple:
    cfg = IngestConfig(storage_options=options)
    _, report = ingest_logs(discover_inputs(uri, options), str(out), cfg, keep_cleaned=False)
    return report.valid, report.content_hash


@pytest.mark.parametrize("faults", [{"fail_every": 4}, {"delay_every": 5, "delay_s": 1.0}])
def test_ingest_retries_transient_5xx_and_timeouts(s3_server, landed, tmp_path, faults):
    import s3fs

    direct = _ingest(landed, {"client_kwargs": {"endpoint_url": s3_server}}, tmp_path / "direct")
    with FlakyS3Proxy(s3_server, **faults) as proxy:
        s3fs.S3FileSystem.clear_instance_cache()
        flaky = _ingest(landed, _options(proxy.url, read_timeout=0.5, connect_timeout=1), tmp_path / "flaky")
    assert flaky == direct and direct[0] == 100
    assert proxy.failed + proxy.delayed >= 3  # faults really happened and were ridden out


def test_publish_retries_and_an_outage_leaves_no_complete_artifact(s3_server, tmp_path):
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    fs.mkdir("flaky-artifacts")
    staging = tmp_path / "staging"
    staging.mkdir()
    parts = {f"part-{i}.bin": os.urandom(64 << 10) for i in range(3)}
    for name, data in parts.items():
        (staging / name).write_bytes(data)
    with FlakyS3Proxy(s3_server, fail_every=4) as proxy:
        s3fs.S3FileSystem.clear_instance_cache()
        storage = StorageResource(root="s3://flaky-artifacts/a", storage_options=_options(proxy.url),
                                  cache_dir=str(tmp_path / "cache"))
        ref = storage.publish(str(staging), "thing", {"k": 1})
        assert proxy.failed >= 2
    for name, data in parts.items():
        assert fs.cat(f"flaky-artifacts/a/thing/{ref.data_version}/{name}") == data
    # an outage after a few requests: publish fails, lineage.json (written last) is absent; a publish takes its
    # staging folder (here: into the host's cache), so the next one builds another
    staging.mkdir()
    for name, data in {**parts, "part-0.bin": b"new content"}.items():
        (staging / name).write_bytes(data)
    with FlakyS3Proxy(s3_server, fail_after=3) as proxy:
        s3fs.S3FileSystem.clear_instance_cache()
        broken = StorageResource(root="s3://flaky-artifacts/a", storage_options=_options(
            proxy.url, retries={"max_attempts": 1}), cache_dir=str(tmp_path / "cache"))
        with pytest.raises(Exception):
            broken.publish(str(staging), "thing", {"k": 2})
    versions = [p.rsplit("/", 1)[-1] for p in fs.ls("flaky-artifacts/a/thing")]
    complete = [v for v in versions if fs.exists(f"flaky-artifacts/a/thing/{v}/{LINEAGE_FILE}")]
    assert complete == [ref.data_version]  # the half-uploaded version is not marked complete
    s3fs.S3FileSystem.clear_instance_cache()
    healthy = StorageResource(root="s3://flaky-artifacts/a", storage_options={"client_kwargs": {
        "endpoint_url": s3_server}}, cache_dir=str(tmp_path / "cache2"))
    again = healthy.publish(str(staging), "thing", {"k": 2})  # the rerun completes it
    assert fs.exists(f"flaky-artifacts/a/thing/{again.data_version}/{LINEAGE_FILE}")
    assert open(os.path.join(healthy.localize(again), "part-0.bin"), "rb").read() == b"new content"
