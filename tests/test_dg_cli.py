"""Dagster's `dg` CLI on batchrl's layout (dg.toml): `dg check defs`, `dg list defs`, `dg launch --assets` and
`dg dev`, each for real from the repo root on a fresh DAGSTER_HOME and storage root; and `dagster dev` still reads
workspace.yaml beside it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest
from helpers_webserver import ASSET_KEYS, REPO, graphql, serve

from batchrl.cli.instance import write_instance_settings
from batchrl.common.log_file import OUTPUT_ROUTED_ENV

DG = os.path.join(os.path.dirname(sys.executable), "dg")


@pytest.fixture
def fresh_home(tmp_path):
    """A DAGSTER_HOME (with batchrl's dagster.yaml) and a storage root, both empty."""
    (tmp_path / "home").mkdir()
    write_instance_settings(str(tmp_path / "home"))
    return {"DAGSTER_HOME": str(tmp_path / "home"), "BATCHRL_STORAGE": str(tmp_path / "storage")}


def _dg(*args: str, env: dict) -> subprocess.CompletedProcess:
    """``dg <args>`` from the repo root as a user's shell runs it (no BATCHRL_OUTPUT_ROUTED of an earlier test)."""
    shell_env = {**{k: v for k, v in os.environ.items() if k != OUTPUT_ROUTED_ENV}, **env}
    done = subprocess.run([DG, *args], cwd=REPO, env=shell_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"dg {' '.join(args)}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def test_dg_check_defs(fresh_home):
    assert "All definitions loaded successfully" in _dg("check", "defs", env=fresh_home).stdout


def test_dg_list_defs_shows_every_asset_check_job_and_sensor(fresh_home):
    defs = json.loads(_dg("list", "defs", "--json", env=fresh_home).stdout)
    assert {a["asset_key"] for a in defs["assets"]} == ASSET_KEYS
    assert {"nothing_lost", "reject_rate_below_threshold"} <= {c["name"] for c in defs["asset_checks"]}
    assert {"retrain", "ingest"} <= {j["name"] for j in defs["jobs"]}
    assert sorted(s["name"] for s in defs["sensors"]) == ["automation_sensor", "new_logs_sensor"]
    assert not defs.get("schedules")  # the nightly retrain is an automation condition


def test_dg_launch_materialises_an_asset_into_the_instance(fresh_home):
    """`dg launch --assets scored_logs` (the shipped scored logs: seconds) runs in the instance of DAGSTER_HOME and
    writes its artifact into the storage root, as `batchrl run --select scored_logs` would."""
    import dagster as dg

    _dg("launch", "--assets", "scored_logs", env=fresh_home)
    with dg.DagsterInstance.from_config(fresh_home["DAGSTER_HOME"]) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("scored_logs"))
        runs = instance.get_runs()
    assert event is not None and [r.status for r in runs] == [dg.DagsterRunStatus.SUCCESS]
    assert os.listdir(os.path.join(fresh_home["BATCHRL_STORAGE"], "scored_logs"))


def test_dagster_dev_still_reads_workspace_yaml():
    """`dagster dev` reads a pyproject [tool.dg]/[tool.dagster] block in place of workspace.yaml: dg's config
    lives in dg.toml so that workspace.yaml stays what `dagster dev` loads (test_ui_browser serves it), and both
    name the same module and location."""
    import yaml

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        tools = tomllib.load(f).get("tool", {})
    assert "dg" not in tools and "dagster" not in tools
    with open(os.path.join(REPO, "dg.toml"), "rb") as f:
        dg_project = tomllib.load(f)["project"]
    with open(os.path.join(REPO, "workspace.yaml")) as f:
        (entry,) = yaml.safe_load(f)["load_from"]
    module = entry["python_module"]["module_name"]
    assert dg_project["code_location_target_module"] == module == dg_project["code_location_name"]


@pytest.fixture(scope="module")
def dg_dev(tmp_path_factory):
    yield from serve(tmp_path_factory, command=("dg", "dev"))


def test_dg_dev_serves_the_ui(dg_dev):
    nodes = graphql(dg_dev, "{ assetNodes { assetKey { path } } }")["assetNodes"]
    assert {node["assetKey"]["path"][-1] for node in nodes} == ASSET_KEYS
    locations = graphql(dg_dev, """{ workspaceOrError { ... on Workspace { locationEntries { name } } } }""")
    assert [e["name"] for e in locations["workspaceOrError"]["locationEntries"]] == ["batchrl.definitions"]
