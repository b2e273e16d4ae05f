"""The real Dagster UI stack: `dagster dev` (webserver + daemon) from the repo root reads workspace.yaml,
shows every asset, and the daemon dequeues and runs a job launched through the webserver's GraphQL API."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from batchrl.cli import DAGSTER_YAML

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTED = {"raw_logs", "cleaned_logs", "validated_preferences", "scored_logs", "scored_pairs", "prompts",
            "base_model", "reward_model", "rollouts", "rewards", "advantages", "policy_checkpoint",
            "dpo_pairs", "reference_logprobs", "dpo_checkpoint", "evaluation"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _graphql(port: int, query: str, variables: dict | None = None) -> dict:
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        payload = json.load(resp)
    assert "errors" not in payload, payload
    return payload["data"]


@pytest.fixture(scope="module")
def dagster_dev(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    (home / "dagster.yaml").write_text(DAGSTER_YAML)
    port = _free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home), "BATCHRL_STORAGE": str(tmp_path_factory.mktemp("storage"))}
    dagster = os.path.join(os.path.dirname(sys.executable), "dagster")
    log = open(home / "dagster_dev.log", "w")
    # no -h: the default host is part of what is tested (test_webserver_listens_on_loopback_only)
    proc = subprocess.Popen([dagster, "dev", "-p", str(port)], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"dagster dev did not start: {(home / 'dagster_dev.log').read_text()[-3000:]}")
                time.sleep(1)
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


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


def test_ui_shows_every_asset_sensor_and_schedule(dagster_dev):
    data = _graphql(dagster_dev, "{ assetNodes { assetKey { path } } }")
    assert {node["assetKey"]["path"][-1] for node in data["assetNodes"]} == EXPECTED
    repo = _graphql(dagster_dev, """{ repositoriesOrError { ... on RepositoryConnection { nodes {
        sensors { name } schedules { name } jobs { name } } } } }""")["repositoriesOrError"]["nodes"][0]
    assert {"new_logs_sensor"} == {s["name"] for s in repo["sensors"]}
    assert {s["name"] for s in repo["schedules"]} == {"nightly_retrain"}
    assert {"retrain", "ingest"} <= {j["name"] for j in repo["jobs"]}


def test_daemon_runs_a_job_launched_from_the_webserver(dagster_dev):
    repo = _graphql(dagster_dev, """{ repositoriesOrError { ... on RepositoryConnection { nodes {
        name location { name } } } } }""")["repositoriesOrError"]["nodes"][0]
    launched = _graphql(dagster_dev, """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) {
        __typename ... on LaunchRunSuccess { run { runId status } } ... on PythonError { message } } }""",
                        {"p": {"selector": {"repositoryLocationName": repo["location"]["name"],
                                            "repositoryName": repo["name"], "jobName": "ingest"}}})["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]
    deadline = time.time() + 240
    status = launched["run"]["status"]
    while status not in ("SUCCESS", "FAILURE", "CANCELED") and time.time() < deadline:
        time.sleep(2)
        status = _graphql(dagster_dev, "query($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }",
                          {"id": run_id})["runOrError"]["status"]
    assert status == "SUCCESS"
    checks = _graphql(dagster_dev, """{ assetNodes(assetKeys: [{path: ["validated_preferences"]}]) {
        assetMaterializations(limit: 1) { runId metadataEntries { label } } } }""")["assetNodes"][0]
    materialization = checks["assetMaterializations"][0]
    assert materialization["runId"] == run_id
    assert {"rows_in", "valid", "quarantined", "duplicates"} <= {m["label"] for m in materialization["metadataEntries"]}
