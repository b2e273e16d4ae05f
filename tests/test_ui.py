"""The real Dagster UI services as a deployment runs them apart: `dagster-webserver` from the repo root reads
workspace.yaml and shows every asset, and `dagster-daemon run` on the same instance runs a backfill over two log
drops launched through the webserver's GraphQL API (one run per drop, kept apart by the catalog's concurrency pool).
`dagster dev` (both in one command, as the README starts the UI) is served in test_ui_browser, `dg dev` in
test_dg_cli."""
from __future__ import annotations

import time

import pytest
from helpers_webserver import ASSET_KEYS, daemon, serve
from helpers_webserver import graphql as _graphql


@pytest.fixture(scope="module")
def webserver(tmp_path_factory):
    yield from serve(tmp_path_factory, command=("dagster-webserver",))


def test_ui_shows_every_asset_and_sensor_and_automation_is_off(webserver):
    data = _graphql(webserver, "{ assetNodes { assetKey { path } } }")
    assert {node["assetKey"]["path"][-1] for node in data["assetNodes"]} == ASSET_KEYS
    repo = _graphql(webserver, """{ repositoriesOrError { ... on RepositoryConnection { nodes {
        sensors { name description sensorState { status } } schedules { name } jobs { name } } } } }""")
    repo = repo["repositoriesOrError"]["nodes"][0]
    assert {s["name"] for s in repo["sensors"]} == {"new_logs_sensor", "automation_sensor"} and not repo["schedules"]
    assert all(len(s["description"] or "") > 40 for s in repo["sensors"]), repo  # said in the UI
    assert {s["sensorState"]["status"] for s in repo["sensors"]} == {"STOPPED"}  # until switched on
    assert {"retrain", "ingest"} <= {j["name"] for j in repo["jobs"]}


def test_backfill_of_two_log_drops_from_the_webserver(webserver):
    """Two log drops registered in the instance, a backfill launched through the webserver's GraphQL API
    (what the UI's "Materialize" over partitions does): the daemon runs one run per drop, both drops'
    per-drop assets are materialised, and the catalog pool (limit 1) kept the two steps apart."""
    import dagster as dg

    home = webserver.home
    drops = ["prefs_000.jsonl", "prefs_001.jsonl"]
    with dg.DagsterInstance.from_config(home) as instance:
        instance.add_dynamic_partitions("log_drops", drops)
    launched = _graphql(webserver, """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(
        backfillParams: $p) { __typename ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message } } }""",
                        {"p": {"partitionNames": drops, "assetSelection": [
                            {"path": [name]} for name in ("raw_logs", "cleaned_logs", "validated_preferences")]}})
    launched = launched["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    deadline, backfill_runs = time.time() + 300, dg.RunsFilter(tags={"dagster/backfill": launched["backfillId"]})
    # the runs' ends (the daemon marks the backfill later)
    with daemon(webserver), dg.DagsterInstance.from_config(home) as instance:
        while time.time() < deadline:
            runs = instance.get_runs(backfill_runs)
            if len(runs) == 2 and all(run.is_finished for run in runs):
                break
            time.sleep(2)
        assert [run.status for run in runs] == [dg.DagsterRunStatus.SUCCESS] * 2
        assert len(instance.get_runs()) == 2  # the automation sensor is off: it asked for none of the drops
        assert instance.get_materialized_partitions(dg.AssetKey("validated_preferences")) == set(drops)
        steps = []
        for run in runs:
            times = {e.dagster_event.event_type_value: e.timestamp for e in instance.all_logs(run.run_id)
                     if e.dagster_event and e.dagster_event.step_key == "log_drop"
                     and e.dagster_event.event_type_value in ("STEP_START", "STEP_SUCCESS")}
            steps.append((times["STEP_START"], times["STEP_SUCCESS"]))
    (a_start, a_end), (b_start, b_end) = sorted(steps)
    assert a_end <= b_start  # never two drops writing the catalog at once
