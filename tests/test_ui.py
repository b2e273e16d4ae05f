"""The real Dagster UI stack: `dagster dev` (webserver + daemon) from the repo root reads workspace.yaml,
shows every asset, and the daemon runs a backfill over two log drops launched through the webserver's
GraphQL API (one run per drop, kept apart by the catalog's concurrency pool)."""
from __future__ import annotations

import os
import time

from helpers_webserver import ASSET_KEYS, dagster_dev  # noqa: F401  (a fixture)
from helpers_webserver import graphql as _graphql



def _listening(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in open(table).read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # 0A = LISTEN
                    found.append(address)
    return found


def test_webserver_listens_on_loopback_only(dagster_dev):
    """Started as the README says (no host given), the UI is reachable from this machine only."""
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 (kernel byte order)
    addresses = _listening(dagster_dev)
    assert addresses and set(addresses) <= loopback, addresses


def test_ui_shows_every_asset_and_sensor_and_automation_is_off(dagster_dev):
    data = _graphql(dagster_dev, "{ assetNodes { assetKey { path } } }")
    assert {node["assetKey"]["path"][-1] for node in data["assetNodes"]} == ASSET_KEYS
    repo = _graphql(dagster_dev, """{ repositoriesOrError { ... on RepositoryConnection { nodes {
        sensors { name description sensorState { status } } schedules { name } jobs { name } } } } }""")
    repo = repo["repositoriesOrError"]["nodes"][0]
    assert {s["name"] for s in repo["sensors"]} == {"new_logs_sensor", "automation_sensor"} and not repo["schedules"]
    assert all(len(s["description"] or "") > 40 for s in repo["sensors"]), repo  # said in the UI
    assert {s["sensorState"]["status"] for s in repo["sensors"]} == {"STOPPED"}  # until switched on
    assert {"retrain", "ingest"} <= {j["name"] for j in repo["jobs"]}


def test_backfill_of_two_log_drops_from_the_webserver(dagster_dev):
    """Two log drops registered in the instance, a backfill launched through the webserver's GraphQL API
    (what the UI's "Materialize" over partitions does): the daemon runs one run per drop, both drops'
    per-drop assets are materialised, and the catalog pool (limit 1) kept the two steps apart."""
    import dagster as dg

    home = dagster_dev.home
    drops = ["prefs_000.jsonl", "prefs_001.jsonl"]
    with dg.DagsterInstance.from_config(home) as instance:
        instance.add_dynamic_partitions("log_drops", drops)
    launched = _graphql(dagster_dev, """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(
        backfillParams: $p) { __typename ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message } } }""",
                        {"p": {"partitionNames": drops, "assetSelection": [
                            {"path": [name]} for name in ("raw_logs", "cleaned_logs", "validated_preferences")]}})
    launched = launched["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    deadline, backfill_runs = time.time() + 300, dg.RunsFilter(tags={"dagster/backfill": launched["backfillId"]})
    with dg.DagsterInstance.from_config(home) as instance:  # the runs' ends (the daemon marks the backfill later)
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
