"""The UI in a real browser (Debian's chromium, driven headless by playwright) over a real `dagster dev`, after a
`batchrl run` of the data stages: a log drop's reason counts render on its partition, a training asset's per-step
chart and the evaluation's overlay chart load as images in the materialisation view, the runs page shows each
run's target, the runs are recorded as launched from the code location (so the UI re-executes them without a
"different version" warning), and a run re-executed from the webserver writes its output to its log file, not
the `dagster dev` console. What a browser adds nothing to is asked of the webserver's GraphQL API."""
from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import time

import dagster as dg
import pytest
from helpers_webserver import REPO, graphql, listening, serve

from batchrl.assets.charts import grouped_bars, png_size
from batchrl.assets.curves import curve_metadata, step_series
from batchrl.assets.evaluation import overlay_panels

BATCHRL = os.path.join(os.path.dirname(sys.executable), "batchrl")
DROP_ASSETS = {"raw_logs", "cleaned_logs", "validated_preferences"}
SELECTION = sorted(DROP_ASSETS | {"prompts"})
# The charts as the assets draw them (assets/curves.py, the evaluation's overlay), reported as materialisations:
# training the cheapest asset (KTO, 4 steps of a 1-layer model) and its base model for real cost this module ~70 s
# (82 -> 176 s on the loaded dev box) and a real evaluation needs every trained model. That the assets publish
# these charts is tested where they run (test_kto, test_evaluation_metadata, the whole-graph tests); here, that
# the browser draws them.
KTO_STEPS = [{"step": s, "loss": 0.7 / s, "kl": 0.01 * s, "rewards/desirable": 0.1 * s, "rewards/undesirable": -0.1 * s,
              "grad_norm": 1.0 / s, "lr": 5e-4} for s in range(1, 9)]
EVALUATED = {model: {"arith_accuracy": 0.1 * i, "preference_accuracy": 0.3 + 0.1 * i, "rm_mean_score": i - 1.0}
             for i, model in enumerate(("base_model", "dpo_checkpoint", "policy_checkpoint"))}
CHARTS = {"kto_checkpoint": curve_metadata(step_series(KTO_STEPS)),
          "evaluation": {"comparison_chart": dg.MetadataValue.md(
              grouped_bars(overlay_panels(EVALUATED)).markdown("models side by side"))}}
RUNS = """{ runsOrError { ... on Runs { results { runId status pipelineSnapshotId parentPipelineSnapshotId
    repositoryOrigin { repositoryName repositoryLocationName } assetSelection { path } } } } }"""
JOBS = """{ repositoriesOrError { ... on RepositoryConnection { nodes { name location { name }
    jobs { name pipelineSnapshotId } } } } }"""
REEXECUTE = """mutation($p: ReexecutionParams!) { launchPipelineReexecution(reexecutionParams: $p) {
    __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }"""


def _ingest(port) -> None:
    """`batchrl run` of the data stages into the webserver's instance and storage (one run per drop, one more),
    while the webserver starts; then the charts reported to the same instance."""
    env = {**os.environ, "DAGSTER_HOME": port.home, "BATCHRL_STORAGE": port.storage}
    done = subprocess.run([BATCHRL, "run", "--select", ",".join(SELECTION)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with dg.DagsterInstance.from_config(port.home) as instance:
        for asset, metadata in CHARTS.items():
            instance.report_runless_asset_event(dg.AssetMaterialization(asset, metadata=metadata))


@pytest.fixture(scope="module")
def dagster_dev(tmp_path_factory):
    yield from serve(tmp_path_factory, meanwhile=_ingest)


@pytest.fixture(scope="module")
def ingested(dagster_dev):
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


def test_webserver_listens_on_loopback_only(dagster_dev):
    """Started as the README says (`dagster dev`, no host given), the UI is reachable from this machine only."""
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 (kernel byte order)
    addresses = listening(dagster_dev)
    assert addresses and set(addresses) <= loopback, addresses


def test_batchrl_runs_are_recorded_as_launched_from_the_code_location(dagster_dev, ingested):
    """Each run names the workspace's location and repository, its assets (the Target column), and its parent
    snapshot is the loaded job's: the UI's condition for re-executing it without a "may be a different version"."""
    repo = graphql(dagster_dev, JOBS)["repositoriesOrError"]["nodes"][0]
    loaded = {job["name"]: job["pipelineSnapshotId"] for job in repo["jobs"]}["__ASSET_JOB"]
    assert len(ingested) == 3  # two log drops, then prompts
    for run in ingested:
        assert run["status"] == "SUCCESS"
        assert run["repositoryOrigin"] == {"repositoryName": repo["name"], "repositoryLocationName": repo["location"]["name"]}
        assert (run["parentPipelineSnapshotId"] or run["pipelineSnapshotId"]) == loaded
        assert {key["path"][-1] for key in run["assetSelection"]} in (DROP_ASSETS, {"prompts"})


def test_a_reexecution_from_the_webserver_writes_its_output_to_its_log_file(dagster_dev, ingested):
    drop_run = next(r for r in ingested if len(r["assetSelection"]) == len(DROP_ASSETS))["runId"]
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


def test_the_browser_shows_a_drops_reason_counts_and_each_runs_target(dagster_dev, ingested, browser):
    url = f"http://127.0.0.1:{int(dagster_dev)}"
    browser.goto(f"{url}/assets/validated_preferences?view=partitions&partition=prefs_001.jsonl")
    for text in ("reason/invalid_json", "reason/undecodable", "dagster/row_count", "quarantine_sample"):
        browser.get_by_text(text, exact=True).first.wait_for(timeout=30_000)
    # the drop's numbers as the UI shows them beside their keys
    assert "121" in browser.get_by_text("dagster/row_count", exact=True).first.locator("xpath=ancestor::tr").inner_text()
    browser.goto(f"{url}/runs")
    drop_run = next(r["runId"] for r in ingested if len(r["assetSelection"]) == len(DROP_ASSETS))
    row = browser.locator("[class*=RunsFeedRow_rowGrid]", has_text=drop_run[:8])  # a row of the runs table
    row.wait_for(timeout=30_000)
    target = row.locator("[class*=VirtualizedTable_cellBox]").nth(2)  # its cells: checkbox, ID, Target, ...
    # the Target column: a tag per asset of the run (shown as they fit, the rest as "N more": their names are the
    # tags' titles) beside the run's log drop
    names = target.locator("[class*=MiddleTruncate_container]").evaluate_all("tags => tags.map(t => t.title)")
    assert set(names) == DROP_ASSETS, names
    assert target.inner_text().startswith("partition: prefs_00"), target.inner_text()


def _shown_chart_size(browser, url: str, asset: str, key: str) -> tuple[int, int]:
    """The natural size of the PNG that ``asset``'s materialisation view shows once ``key``'s Markdown is opened;
    decode() rejects (and fails the test) when the browser cannot draw it."""
    browser.goto(f"{url}/assets/{asset}?view=events")
    entry = browser.get_by_text(key, exact=True).first
    entry.wait_for(timeout=30_000)
    entry.locator("xpath=ancestor::tr").get_by_text("[Show Markdown]").first.click()
    image = browser.get_by_role("dialog").locator("img[src^='data:image/png']").first
    image.wait_for(timeout=30_000)
    return tuple(image.evaluate("img => img.decode().then(() => [img.naturalWidth, img.naturalHeight])"))


@pytest.mark.parametrize("asset, key", [("kto_checkpoint", "curves"), ("evaluation", "comparison_chart")])
def test_the_browser_draws_a_training_assets_curves_and_the_evaluation_overlay(dagster_dev, browser, asset, key):
    png = base64.b64decode(CHARTS[asset][key].value.split("base64,", 1)[1].split(")", 1)[0])
    width, height = png_size(png)
    assert width >= 300 and height >= 100  # a chart of panels, not an icon
    assert _shown_chart_size(browser, f"http://127.0.0.1:{int(dagster_dev)}", asset, key) == (width, height)
