"""Retention (resources/retention.py, runs/retention.py, runs/expire.py, cli/prune_command.py) on real storage roots
(a local folder; an s3:// root on the moto server), a real DuckDB catalog and a real Dagster instance. The artifacts
are published the way ``assets.common.train_and_publish`` publishes a trainer's export: hard links of a work dir's
``model/`` (the RL loop with real trainer jobs: tests/test_retention_loop.py).
"""
from __future__ import annotations

import argparse
import json
import os

import dagster as dg
import pytest

from batchrl.cli.prune_command import add_command, policy_of, prune, run_retention
from batchrl.common import fsutil
from batchrl.lineage.audit import format_tree, lineage_tree
from batchrl.resources import CatalogResource, StorageResource
from batchrl.resources.artifacts import make_local
from batchrl.resources.profiles import ProfileError, load_profile
from batchrl.common.expired import MARKER
from batchrl.resources.retention import ArtifactExpiredError, RetentionPolicy, carried_state_problem
from batchrl.runs.expire import _work_dir
from batchrl.runs.retention import plan

WEIGHTS, STATE = "model.safetensors", "optimizer/state-00001-of-00001.safetensors"


def _checkpoint(storage: StorageResource, catalog: CatalogResource, asset: str, n: int, state: bool = True,
                recorded: bool = True, companions: dict | None = None, subdir: str = "model",
                workdir: str = "") -> dict:
    """A trainer's export in a work dir (weights, optionally AdamW's state, a resume record), published from links
    to it and recorded in the catalog as train_and_publish records it: ``{"ref", "workdir", "size"}``."""
    workdir = workdir or os.path.join(storage.cache_dir, "_work", asset, f"digest{n}")
    export = os.path.join(workdir, subdir)
    os.makedirs(os.path.join(export, "optimizer") if state else export)
    with open(os.path.join(export, WEIGHTS), "wb") as f:
        f.write(bytes([n]) * (1000 * n))
    if state:
        with open(os.path.join(export, STATE), "wb") as f:
            f.write(bytes([n]) * 3000)
    os.makedirs(os.path.join(workdir, "checkpoints"), exist_ok=True)
    with open(os.path.join(workdir, "checkpoints", "completed.json"), "w") as f:
        f.write("{}")
    with storage.staging_dir(asset) as staging:
        fsutil.link_tree(export, staging)
        ref = storage.publish(staging, asset, {"inputs": {}}, sidecars={"train_metrics.json": {"loss": 1.0}})
    metadata = {**({"optimizer_state_step": 4} if state else {}),
                **({"work_dir": os.path.relpath(export if subdir != "model" else workdir, storage.cache_dir)}
                   if recorded else {}),
                **{f"{name}_data_version": companion["ref"].data_version for name, companion in
                   (companions or {}).items()}}
    catalog.record(asset=asset, data_version=ref.data_version, uri=ref.uri, run_id=f"run{n}", code_version="c",
                   metadata=metadata, lineage={"asset": asset, "inputs": {}}, root=storage.root_uri())
    return {"ref": ref, "workdir": workdir, "size": 1000 * n + (3000 if state else 0)}


def _materialised(instance: dg.DagsterInstance, asset: str, ref, artifact_asset: str | None = None) -> None:
    """A materialisation of ``asset`` naming ``ref`` (as each asset's metadata does; a promotion names its
    artifact's asset)."""
    instance.report_runless_asset_event(dg.AssetMaterialization(asset, metadata={
        "uri": dg.MetadataValue.path(ref.uri), "data_version": ref.data_version,
        **({"artifact_asset": artifact_asset} if artifact_asset else {})}))


def _files(folder) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), folder) for d, _, names in os.walk(folder) for n in names}


@pytest.fixture
def chain(tmp_path):
    """Four policy checkpoints with their critics and two reward models in a local root; v1 published before work
    dirs were recorded; the latest rollouts sampled from v2 (off-policy: read again), v4 latest and promoted."""
    root = str(tmp_path / "root")
    storage = StorageResource(root=root, cache_dir=os.path.join(root, "_cache"))
    catalog = CatalogResource(path=os.path.join(root, "catalog.duckdb"))
    v, c = {}, {}
    for n in range(1, 5):
        workdir = os.path.join(storage.cache_dir, "_work", "policy_checkpoint", f"digest{n}")
        c[n] = _checkpoint(storage, catalog, "critic_checkpoint", n, state=False, subdir="critic", workdir=workdir)
        v[n] = _checkpoint(storage, catalog, "policy_checkpoint", n, recorded=n > 1, companions={
            "critic_checkpoint": c[n]}, workdir=workdir)
    r = {n: _checkpoint(storage, catalog, "reward_model", 10 + n, state=False) for n in (1, 2)}
    instance = dg.DagsterInstance.ephemeral()
    _materialised(instance, "policy_checkpoint", v[4]["ref"])
    _materialised(instance, "promoted_policy", v[4]["ref"], "policy_checkpoint")
    _materialised(instance, "reward_model", r[2]["ref"])
    _stage(storage, catalog, instance, "rollouts", {"policy": v[2]["ref"]})
    return storage, catalog, instance, v, c, r


def _stage(storage, catalog, instance, asset: str, inputs: dict) -> None:
    """The latest materialisation of a stage that is not trained, naming ``inputs`` in its lineage."""
    with storage.staging_dir(asset) as staging:
        open(os.path.join(staging, f"{asset}.parquet"), "w").close()
        ref = storage.publish(staging, asset, {"inputs": {}})
    catalog.record(asset=asset, data_version=ref.data_version, uri=ref.uri, run_id="r", code_version="c", metadata={},
                   lineage={"inputs": {name: input_ref.to_dict() for name, input_ref in inputs.items()}},
                   root=storage.root_uri())
    _materialised(instance, asset, ref)


def test_prune_expires_the_old_versions_frees_their_links_and_keeps_what_is_in_use(chain):
    storage, catalog, instance, v, c, r = chain
    policy = RetentionPolicy(keep_last_checkpoints=1, keep_optimizer_states=1)
    pins = [r[1]["ref"].data_version]
    dry = prune(storage, catalog, instance, policy, pins, dry_run=True, by="test")
    expected = {("policy_checkpoint", v[3]["ref"].data_version, "all"), ("policy_checkpoint", v[1]["ref"].data_version,
                "all"), ("critic_checkpoint", c[3]["ref"].data_version, "all"),
                ("critic_checkpoint", c[1]["ref"].data_version, "all"),
                ("policy_checkpoint", v[2]["ref"].data_version, "optimizer")}
    assert {(e["asset"], e["data_version"], e["part"]) for e in dry["expiries"]} == expected
    kept = {(k["asset"], k["data_version"]): k["why"] for k in dry["kept"]}
    assert kept[("policy_checkpoint", v[2]["ref"].data_version)].startswith("read by the latest rollouts")
    assert kept[("critic_checkpoint", c[2]["ref"].data_version)].startswith("companion of policy_checkpoint")
    assert kept[("reward_model", r[1]["ref"].data_version)] == "pinned (--keep)"
    by_version = {(e["data_version"], e["part"]): e for e in dry["expiries"]}
    v1 = by_version[(v[1]["ref"].data_version, "all")]  # no work dir recorded: its links keep the bytes
    assert v1["work_dir"] is None and v1["bytes_freed"] == 0 and v1["still_linked_bytes"] == v[1]["size"]
    assert by_version[(v[3]["ref"].data_version, "all")]["bytes_freed"] >= v[3]["size"]  # both links go
    # a dry run deletes nothing and records nothing
    assert all(not os.path.exists(os.path.join(e["ref"].uri, MARKER)) for e in v.values())
    assert os.path.exists(os.path.join(v[3]["ref"].uri, WEIGHTS)) and os.path.isdir(v[3]["workdir"])
    assert catalog.query("SELECT count(*) FROM artifact_expiries")[0][0] == 0

    done = prune(storage, catalog, instance, policy, pins, dry_run=False, by="test")
    assert done["expiries"] == dry["expiries"] and done["bytes_freed"] == dry["bytes_freed"] > 0
    v3 = v[3]["ref"].uri
    assert _files(v3) == {"lineage.json", "train_metrics.json", MARKER} and not os.path.exists(v[3]["workdir"])
    with open(os.path.join(v3, MARKER)) as f:
        (entry,) = json.load(f)["expiries"]
    assert entry["part"] == "all" and entry["removed"] == ["model.safetensors", "optimizer"] and entry["by"] == "test"
    assert entry["reason"].startswith("keep_last_checkpoints 1") and entry["bytes_freed"] >= v[3]["size"]
    assert os.path.exists(os.path.join(v[1]["workdir"], "model", WEIGHTS))  # unrecorded work dir: left alone
    v2 = v[2]["ref"].uri  # in use: the weights stay, its optimizer state goes, and with it the work dir's links
    assert _files(v2) == {WEIGHTS, "lineage.json", "train_metrics.json", MARKER} and not os.path.exists(v[2]["workdir"])
    assert os.stat(os.path.join(v2, WEIGHTS)).st_nlink == 1
    assert os.stat(os.path.join(v[4]["ref"].uri, STATE)).st_nlink == 2  # latest: untouched, still linked
    assert os.path.exists(os.path.join(c[2]["ref"].uri, WEIGHTS))
    rows = catalog.query("SELECT asset, data_version, part, bytes_freed, reason FROM artifact_expiries")
    assert {row[:3] for row in rows} == expected and all(row[4] for row in rows)
    assert prune(storage, catalog, instance, policy, pins, dry_run=False, by="test")["expiries"] == []  # done once

    # the boundaries: loading the expired one, carrying an expired state, the audit
    with pytest.raises(ArtifactExpiredError) as raised:
        make_local(storage, v[3]["ref"])
    message = str(raised.value)
    assert f"policy_checkpoint {v[3]['ref'].data_version} has expired" in message
    assert "keep_last_checkpoints 1" in message
    assert f"batchrl reproduce policy_checkpoint/{v[3]['ref'].data_version}" in message
    assert make_local(storage, v[2]["ref"]).path == v2  # only its state expired: the weights load
    problem = carried_state_problem(v2, "policy_checkpoint", v[2]["ref"].data_version)
    assert "carry_optimizer_state" in problem and "keep_optimizer_states 1" in problem
    assert carried_state_problem(v[4]["ref"].uri, "policy_checkpoint", v[4]["ref"].data_version) is None
    tree = lineage_tree(v3)
    assert tree["expired"][0]["part"] == "all" and "  EXPIRED " in format_tree(tree)

    # the same content published again restores it: files back, no marker, loads; the expiry no longer holds
    again = _checkpoint(storage, catalog, "policy_checkpoint", 3, workdir=v[3]["workdir"] + "-again")
    assert again["ref"] == v[3]["ref"] and not os.path.exists(os.path.join(v3, MARKER))
    assert os.path.exists(os.path.join(make_local(storage, v[3]["ref"]).path, STATE))


def test_the_policy_the_promotion_gate_may_promote_again_keeps_its_optimizer_state(chain):
    storage, catalog, instance, v, _, _ = chain
    _stage(storage, catalog, instance, "evaluation", {"policy_checkpoint": v[2]["ref"]})
    planned = plan(storage, catalog, instance, RetentionPolicy(keep_optimizer_states=1))
    assert [(e.version.data_version, e.part) for e in planned.expiries] == [(v[3]["ref"].data_version, "optimizer"),
                                                                            (v[1]["ref"].data_version, "optimizer")]
    assert planned.kept[("policy_checkpoint", v[2]["ref"].data_version)].startswith("read by the latest evaluation")


def test_keep_every_keeps_each_assets_every_mth_version_whole(chain):
    storage, catalog, instance, v, c, r = chain
    planned = plan(storage, catalog, instance, RetentionPolicy(keep_last_checkpoints=1, keep_every=3))
    assert {(e.version.asset, e.version.data_version) for e in planned.expiries} == {
        ("policy_checkpoint", v[1]["ref"].data_version), ("critic_checkpoint", c[1]["ref"].data_version),
        ("reward_model", r[1]["ref"].data_version)}
    assert planned.kept[("policy_checkpoint", v[3]["ref"].data_version)] == \
        "keep_every 3: policy_checkpoint's version no. 3"
    assert planned.kept[("critic_checkpoint", c[3]["ref"].data_version)].startswith("keep_every 3")
    # the points keep their places when the same content is published again later
    _checkpoint(storage, catalog, "policy_checkpoint", 1, workdir=v[1]["workdir"] + "-again")
    again = plan(storage, catalog, instance, RetentionPolicy(keep_last_checkpoints=1, keep_every=3))
    assert again.kept[("policy_checkpoint", v[3]["ref"].data_version)].startswith("keep_every 3")


def test_an_s3_root_loses_its_objects_and_this_hosts_cached_copy(s3_options, tmp_path):
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options)
    fs.mkdir("retention")
    storage = StorageResource(root="s3://retention/root", storage_options=s3_options, cache_dir=str(tmp_path / "c"))
    catalog = CatalogResource(path=str(tmp_path / "catalog.duckdb"))
    v = {n: _checkpoint(storage, catalog, "policy_checkpoint", n) for n in (1, 2, 3)}
    cached = {n: storage.cached_path("policy_checkpoint", v[n]["ref"].data_version) for n in v}
    assert os.stat(os.path.join(cached[1], WEIGHTS)).st_nlink == 2  # the uploaded copy, linked from the work dir
    with dg.DagsterInstance.ephemeral() as instance:
        _materialised(instance, "policy_checkpoint", v[3]["ref"])
        report = prune(storage, catalog, instance, RetentionPolicy(keep_last_checkpoints=2, keep_optimizer_states=1),
                       [], dry_run=False, by="test")
    assert [(e["data_version"], e["part"]) for e in report["expiries"]] == [
        (v[1]["ref"].data_version, "all"), (v[2]["ref"].data_version, "optimizer")]
    # stored bytes (the objects) plus this host's (the cached copy and the work dir, both links of each file)
    assert report["expiries"][0]["bytes_freed"] >= 2 * v[1]["size"]
    remote = {n: v[n]["ref"].uri.split("://", 1)[1] for n in v}
    assert {p.rsplit("/", 1)[1] for p in fs.find(remote[1])} == {"lineage.json", "train_metrics.json", MARKER}
    assert not os.path.exists(cached[1]) and not os.path.exists(v[1]["workdir"])
    assert not fs.exists(f"{remote[2]}/{STATE}") and fs.exists(f"{remote[2]}/{WEIGHTS}")
    assert not os.path.exists(os.path.join(cached[2], "optimizer")) and fs.exists(f"{remote[3]}/{STATE}")
    # the update that trains v2 reads this host's copy: it says the state expired, as the root does
    assert "has expired" in carried_state_problem(cached[2], "policy_checkpoint", v[2]["ref"].data_version)
    with pytest.raises(ArtifactExpiredError, match="has expired"):  # told before any download
        make_local(storage, v[1]["ref"])
    assert not os.path.exists(cached[1])
    assert storage.read_lineage(v[1]["ref"])["data_version"] == v[1]["ref"].data_version  # the records stay readable
    assert lineage_tree(v[1]["ref"].uri, s3_options)["expired"][0]["bytes_freed"] > 0


def test_the_policy_is_checked_where_it_is_written(tmp_path, capsys):
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        RetentionPolicy(keep_last_checkpoints=0)
    for profile in ("gsm8k", "gsm8k-1.5b", "gsm8k-1.5b-lora"):  # the GPU runs that filled a disk keep 3, state 1
        for env in ("local", "gpu"):
            assert load_profile(profile, env)["retention"] == {"keep_last_checkpoints": 3, "keep_optimizer_states": 1}
    assert load_profile("real")["retention"] == {}  # not set: the embedded default and the rest keep everything
    bad = tmp_path / "bad.yaml"
    bad.write_text("extends: gsm8k\nretention: {keep_last_checkpoints: 0, keep_last: 2}\n")
    with pytest.raises(ProfileError) as raised:
        load_profile(str(bad))
    assert f"{bad}: retention.keep_last_checkpoints=0: Input should be greater than or equal to 1" in str(raised.value)
    assert f"{bad}: retention.keep_last=2: Extra inputs are not permitted" in str(raised.value)

    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["prune", "--keep-last", "0"])
    assert "'0': a whole number, at least 1, or all" in capsys.readouterr().err
    # `batchrl run`: the profile's, a -c file's over it, the flags over both
    written = tmp_path / "keep.yaml"
    written.write_text("retention: {keep_optimizer_states: 2}\n")
    args = argparse.Namespace(profile="gsm8k", config=[str(written)], keep_last_checkpoints=5,
                              keep_optimizer_states=None)
    assert run_retention(args).model_dump() == {"keep_last_checkpoints": 5, "keep_optimizer_states": 2,
                                                "keep_every": None}
    assert policy_of(argparse.Namespace(keep_last_checkpoints=None, keep_optimizer_states=None)) is None
    # `all` undoes a profile's number: the gsm8k profile with both flags at all keeps everything (no prune)
    keep_all = parser.parse_args(["prune", "--keep-last", "all", "--optimizer-states", "all"])
    assert run_retention(argparse.Namespace(profile="gsm8k", config=[], keep_last_checkpoints=
                                            keep_all.keep_last_checkpoints, keep_optimizer_states=
                                            keep_all.keep_optimizer_states)) is None
    args.keep_last_checkpoints = "all"
    assert run_retention(args).model_dump() == {"keep_last_checkpoints": None, "keep_optimizer_states": 2,
                                                "keep_every": None}
    assert parser.parse_args(["prune", "--keep-every", "7"]).keep_every == 7


def test_a_pin_that_names_no_version_or_a_work_dir_outside_the_cache_deletes_nothing(chain):
    storage, catalog, instance, *_ = chain
    with pytest.raises(ValueError, match="--keep 0123456789abcdef: no trained artifact has this data version"):
        prune(storage, catalog, instance, RetentionPolicy(keep_last_checkpoints=1), ["0123456789abcdef"], False, "t")
    assert catalog.query("SELECT count(*) FROM artifact_expiries")[0][0] == 0
    cache = storage.cache_dir  # the catalog's record of a work dir is followed only below <cache>/_work
    assert _work_dir(cache, "_work/policy_checkpoint/d1") == os.path.realpath(f"{cache}/_work/policy_checkpoint/d1")
    for outside in ("_work", "_work/../..", "/etc"):
        with pytest.raises(ValueError, match="not one under"):
            _work_dir(cache, outside)
