"""Helpers of test_pipeline_e2e.py: a copy of the package, a stale-check script, a second RL iteration's
rollouts, a sensor tick, the input files of a lineage tree."""
from __future__ import annotations

import json
import os

import dagster as dg
from pipeline_helpers import latest_metadata, local_resources, run_assets


def copy_package(dest) -> str:
    import shutil

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copytree(repo, dest / "batchrl", ignore=shutil.ignore_patterns(
        ".git", ".venv", ".storage", ".dagster_home", ".reproduce", "tests", "bench", "__pycache__", "*.egg-info"))
    return str(dest)


STALE_SCRIPT = """
import json, os, sys
import dagster as dg
import batchrl
from batchrl.definitions import build_definitions
from batchrl.lineage.staleness import code_stale, stale_causes
assert batchrl.__file__.startswith(sys.argv[2]), batchrl.__file__  # the copy, not the checkout
defs = build_definitions()
os.environ["DAGSTER_HOME"] = sys.argv[1]
with dg.DagsterInstance.get() as instance:
    print(json.dumps(sorted(code_stale(stale_causes(defs, instance)))))
"""


def second_iteration_rollouts(instance, root) -> dict:
    """Rollouts sampled from the trained policy_checkpoint (an RL iteration's second step): made by
    test_next_rollouts_sample_from_the_latest_policy_checkpoint when the module runs whole, else here."""
    import duckdb

    with duckdb.connect(os.path.join(root, "catalog.duckdb"), read_only=True) as con:
        rows = con.execute("SELECT uri, data_version, lineage FROM artifacts WHERE asset = 'rollouts'").fetchall()
    for uri, version, lineage in rows:
        if json.loads(lineage)["inputs"]["policy"]["asset"] == "policy_checkpoint":
            return {"uri": uri, "data_version": version}
    assert run_assets(local_resources(root), instance, selection=["rollouts"], run_config={"ops": {
        "rollouts": {"config": {"samples_per_prompt": 2, "max_prompts": 4}}}}).success
    return latest_metadata(instance, "rollouts")


def sensor_tick(landing, cursor):
    from batchrl.assets.automation import new_logs_sensor

    return new_logs_sensor(dg.build_sensor_context(cursor=cursor, resources={"landing": landing}))


def input_files(node: dict):
    yield from node.get("input_files", [])
    for child in node.get("inputs", {}).values():
        yield from input_files(child)
