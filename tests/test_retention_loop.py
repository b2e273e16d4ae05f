"""Retention in the RL loop as a user runs it: `batchrl run --rl-iterations 3 --keep-last 2 --optimizer-states 1`
with ``carry_optimizer_state`` (real trainer jobs on the tiny model, on the session's upstream assets) prunes after
each iteration, saying what and how much; the space is really freed (the trainer work dirs whose exports the
checkpoints link go too); audit shows the expired ones; loading an expired checkpoint fails at the IO manager with
the message that names it; an update that would carry an expired optimizer state fails before its job starts."""
from __future__ import annotations

import copy
import json
import os
import subprocess

import dagster as dg
from helpers_batchrl_run import BATCHRL
from pipeline_helpers import RL_LOOP, SMALL, local_resources, run_assets

from batchrl.cli.main import main
from batchrl.resources import CatalogResource
from batchrl.common.expired import MARKER

CARRY = copy.deepcopy(SMALL)  # the tiny base model of the upstream copy; each update carries its AdamW state
CARRY["ops"]["policy_checkpoint"]["config"]["carry_optimizer_state"] = True


def _chain(home: str) -> list[dict]:
    """promoted_policy's materialisations, oldest first: each checkpoint's data version and uri."""
    with dg.DagsterInstance.local_temp(home) as instance:
        records = instance.fetch_materializations(dg.AssetKey("promoted_policy"), limit=10).records
        return [{key: r.asset_materialization.metadata[key].value for key in ("data_version", "uri")}
                for r in reversed(records)]


def _promote(home: str, checkpoint: dict) -> None:
    """``promoted_policy`` back to ``checkpoint``, as the promotion gate does when a policy got worse."""
    with dg.DagsterInstance.local_temp(home) as instance:
        instance.report_runless_asset_event(dg.AssetMaterialization("promoted_policy", metadata={
            "uri": dg.MetadataValue.path(checkpoint["uri"]), "data_version": checkpoint["data_version"],
            "artifact_asset": "policy_checkpoint"}))


def _failure(result: dg.ExecuteInProcessResult) -> tuple[str, str]:
    """(the failed step, its error with every cause)."""
    event = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    error, text = event.step_failure_data.error, []
    while error is not None:
        text.append(error.message)
        error = error.cause
    return event.step_key, "\n".join(text)


def test_the_loop_prunes_between_iterations_and_expired_artifacts_fail_at_the_boundaries(tmp_path, upstream_copy,
                                                                                         monkeypatch, capsys):
    root, home = upstream_copy(tmp_path)
    config = tmp_path / "carry.yaml"
    config.write_text(json.dumps(CARRY))  # YAML reads JSON
    env = {**os.environ, "DAGSTER_HOME": home, "BATCHRL_STORAGE": root, "BATCHRL_SERVER": "off"}
    run = subprocess.run([BATCHRL, "run", "--select", ",".join(RL_LOOP), "--rl-iterations", "3", "-c", str(config),
                          "--keep-last", "2", "--optimizer-states", "1"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    v1, v2, v3 = _chain(home)
    said = [line for line in run.stdout.splitlines() if line.startswith("=== retention")]
    assert len(said) == 3, run.stdout  # one line after each iteration
    assert "nothing to expire" in said[0]
    assert f"policy_checkpoint {v1['data_version']} optimizer state" in said[1]
    assert f"policy_checkpoint {v1['data_version']}, policy_checkpoint {v2['data_version']} optimizer state" in said[2]
    assert all(line.endswith(" MB freed") for line in said) and "; 0.0 MB" not in said[1] + said[2]

    catalog = CatalogResource(path=os.path.join(root, "catalog.duckdb"))
    rows = catalog.query("SELECT data_version, part, bytes_freed FROM artifact_expiries ORDER BY expired_at")
    assert [row[:2] for row in rows] == [(v1["data_version"], "optimizer"), (v1["data_version"], "all"),
                                         (v2["data_version"], "optimizer")] and all(row[2] > 0 for row in rows)
    work = {dv: os.path.join(root, "_cache", json.loads(meta)["work_dir"]) for dv, meta in catalog.query(
        "SELECT data_version, metadata FROM artifacts WHERE asset = 'policy_checkpoint'")}
    records = {"lineage.json", "train_metrics.json", "batchrl_train.json", MARKER}
    assert set(os.listdir(v1["uri"])) == records and not os.path.exists(work[v1["data_version"]])
    kept = set(os.listdir(v2["uri"]))  # weights stay, the state and the work dir's links go
    assert "optimizer" not in kept and MARKER in kept and not os.path.exists(work[v2["data_version"]])
    weights = next(n for n in kept if n.endswith(".safetensors"))
    assert os.stat(os.path.join(v2["uri"], weights)).st_nlink == 1
    state = os.path.join(v3["uri"], "optimizer")  # the newest: whole, still linked from its work dir
    assert os.stat(os.path.join(state, os.listdir(state)[0])).st_nlink == 2

    monkeypatch.setenv("DAGSTER_HOME", home)
    monkeypatch.setenv("BATCHRL_STORAGE", root)
    capsys.readouterr()
    assert main(["audit", "policy_checkpoint"]) == 0
    audit = capsys.readouterr().out
    assert f"policy_checkpoint@{v1['data_version']} [expired]" in audit and "EXPIRED optimizer state" in audit
    assert "  EXPIRED " in audit and "keep_last_checkpoints 2" in audit
    assert main(["audit", f"policy_checkpoint/{v1['data_version']}"]) == 0  # as the expiry message names it
    assert capsys.readouterr().out.startswith(f"policy_checkpoint@{v1['data_version']}")
    out = tmp_path / "exported"  # `batchrl export` refuses an expired checkpoint; one without its state exports
    assert main(["export", f"policy_checkpoint/{v1['data_version']}", "--to", str(out / "v1")]) == 2
    assert f"policy_checkpoint {v1['data_version']} has expired" in capsys.readouterr().err
    assert main(["export", f"policy_checkpoint/{v2['data_version']}", "--to", str(out / "v2")]) == 0
    assert weights in os.listdir(out / "v2") and not {MARKER, "optimizer"} & set(os.listdir(out / "v2"))
    capsys.readouterr()
    assert main(["prune", "--keep-last", "1", "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)  # v2: the latest rollouts sampled from it (off-policy reads it again)
    assert dry["expiries"] == [] and dry["kept"] == [{"asset": "policy_checkpoint", "data_version": v2["data_version"],
                                                      "why": dry["kept"][0]["why"]}]
    assert dry["kept"][0]["why"].startswith("read by the latest rollouts")

    resources = local_resources(root)
    _promote(home, v1)  # the expired one: the IO manager refuses it, naming it
    with dg.DagsterInstance.local_temp(home) as instance:
        step, error = _failure(run_assets(resources, instance, ["rollouts"], CARRY))
    assert step == "rollouts" and f"policy_checkpoint {v1['data_version']} has expired" in error
    assert f"batchrl reproduce policy_checkpoint/{v1['data_version']}" in error
    _promote(home, v2)  # its weights are there, its optimizer state is not: the update stops before its job
    with dg.DagsterInstance.local_temp(home) as instance:
        step, error = _failure(run_assets(resources, instance, RL_LOOP, CARRY))
    assert step == "policy_checkpoint" and "carry_optimizer_state takes up the AdamW state" in error
    assert f"policy_checkpoint {v2['data_version']}, but that state has expired" in error
