"""The UI in a real browser (Debian's chromium, driven headless by playwright) over a real `dagster dev`, after a
`batchrl run` of the data stages: a log drop's reason counts render on its partition, the runs page shows each
run's target, the runs are recorded as launched from the code location (so the UI re-executes them without a
"different version" warning), and a run re-executed from the webserver writes its output to its log file, not
the `dagster dev` console. What a browser adds nothing to is asked of the webserver's GraphQL API."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import dagster as dg
import pytest
from helpers_webserver import REPO, dagster_dev, graphql  # noqa: F401  (dagster_dev: a fixture)

BATCHRL = os.path.join(os.path.dirname(sys.executable), "batchrl")
SELECTION = ["raw_logs", "cleaned_logs", "validated_preferences", "prompts"]
RUNS = """{ runsOrError { ... on Runs { results { runId status pipelineSnapshotId parentPipelineSnapshotId
    repositoryOrigin { repositoryName repositoryLocationName } assetSelection { path } } } } }"""
JOBS = """{ repositoriesOrError { ... on RepositoryConnection { nodes { name location { name }
    jobs { name pipelineSnapshotId } } } } }"""
REEXECUTE = """mutation($p: ReexecutionParams!) { launchPipelineReexecution(reexecutionParams: $p) {
    __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }"""


@pytest.fixture(scope="module")
def ingested(dagster_dev):  # noqa: F811
    """`batchrl run` of the data stages into the webserver's instance and storage: one run per drop, one more."""
    env = {**os.environ, "DAGSTER_HOME": dagster_dev.home, "BATCHRL_STORAGE": dagster_dev.storage}
    done = subprocess.run([BATCHRL, "run", "--select", ",".join(SELECTION)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return graphql(dagster_dev, RUNS)["runsOrError"]["results"]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: scripts/bootstrap.sh installs it (apt-get install chromium)"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield launched.new_page(viewport={"width": 1400, "height": 900})
        launched.close()


def test_batchrl_runs_are_recorded_as_launched_from_the_code_location(dagster_dev, ingested):  # noqa: F811
    """Each run names the workspace's location and repository, its assets (the Target column), and its parent
    snapshot is the loaded job's: the UI's condition for re-executing it without a "may be a different version"."""
    repo = graphql(dagster_dev, JOBS)["repositoriesOrError"]["nodes"][0]
    loaded = {job["name"]: job["pipelineSnapshotId"] for job in repo["jobs"]}["__ASSET_JOB"]
    assert len(ingested) == 3  # two log drops, then prompts
    for run in ingested:
        assert run["status"] == "SUCCESS"
        assert run["repositoryOrigin"] == {"repositoryName": repo["name"], "repositoryLocationName": repo["location"]["name"]}
        assert (run["parentPipelineSnapshotId"] or run["pipelineSnapshotId"]) == loaded
        assert {key["path"][-1] for key in run["assetSelection"]} in (
            {"raw_logs", "cleaned_logs", "validated_preferences"}, {"prompts"})


def test_a_reexecution_from_the_webserver_writes_its_output_to_its_log_file(dagster_dev, ingested):  # noqa: F811
    drop_run = next(r for r in ingested if len(r["assetSelection"]) == 3)["runId"]
    launched = graphql(dagster_dev, REEXECUTE, {"p": {"parentRunId": drop_run, "strategy": "ALL_STEPS"}})
    launched = launched["launchPipelineReexecution"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]
    with dg.DagsterInstance.from_config(dagster_dev.home) as instance:
        deadline = time.time() + 240
        while not instance.get_run_by_id(run_id).is_finished and time.time() < deadline:
            time.sleep(1)
        assert instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.SUCCESS
    run_log = open(os.path.join(dagster_dev.home, "logs", f"run-{run_id}.log")).read()
    console = open(os.path.join(dagster_dev.home, "dagster_dev.log")).read()
    assert f"{run_id} - " in run_log and "STEP_SUCCESS" in run_log  # the steps' DEBUG events, in the run's file
    assert not [line for line in console.splitlines() if run_id in line and "STEP_" in line], console[-3000:]


def test_the_browser_shows_a_drops_reason_counts_and_each_runs_target(dagster_dev, ingested, browser):  # noqa: F811
    url = f"http://127.0.0.1:{int(dagster_dev)}"
    browser.goto(f"{url}/assets/validated_preferences?view=partitions&partition=prefs_001.jsonl")
    for text in ("reason/invalid_json", "reason/undecodable", "dagster/row_count", "quarantine_sample"):
        browser.get_by_text(text, exact=True).first.wait_for(timeout=30_000)
    # the drop's numbers as the UI shows them beside their keys
    assert "121" in browser.get_by_text("dagster/row_count", exact=True).first.locator("xpath=ancestor::tr").inner_text()
    browser.goto(f"{url}/runs")
    prompts_run = next(r["runId"] for r in ingested if len(r["assetSelection"]) == 1)
    row = browser.locator("[class*=RunsFeedRow_rowGrid]", has_text=prompts_run[:8])  # a row of the runs table
    row.wait_for(timeout=30_000)
    target = row.locator("[class*=VirtualizedTable_cellBox]").nth(2)  # its cells: checkbox, ID, Target, ...
    assert set(target.inner_text().split()) == {"prompts"}  # the Target column names the run's asset
