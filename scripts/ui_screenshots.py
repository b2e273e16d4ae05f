"""Screenshots of the Dagster UI pages that docs/UI.md shows, from a running `dagster dev`, with the system's
chromium (Debian package) driven headless by playwright; each page is taken once the text it is about has
rendered. Used after the README's main job and a 3-iteration RL run into the same storage root and DAGSTER_HOME:

    .venv/bin/batchrl run && .venv/bin/batchrl run --rl-iterations 3
    DAGSTER_HOME=$PWD/.dagster_home .venv/bin/dagster dev -p 3000 &
    .venv/bin/python scripts/ui_screenshots.py --port 3000 --out docs/ui
"""
from __future__ import annotations

import argparse
import os
import shutil
from typing import NamedTuple


class Page(NamedTuple):
    file: str
    path: str  # on the webserver
    text: str  # shows that the page has rendered what it is about
    to_top: bool = False  # scroll that text to the top of the window
    row_link: str | None = None  # a link in that text's table row to click (a chart opens from its Markdown entry)
    button: str | None = None  # a button to press, e.g. the Metadata section's Plots


DROP = "/assets/validated_preferences?view=partitions&partition=prefs_001.jsonl"
PAGES = [
    Page("drop_reason_counts.png", DROP, "reason/invalid_json"),
    Page("drop_quarantine_sample.png", DROP, "quarantine_sample", to_top=True),
    Page("drop_reject_rate_check.png", "/assets/validated_preferences?view=checks&checkDetail=reject_rate_below_threshold",
         "top_reasons"),
    Page("runs.png", "/runs", "Target"),
    Page("timeline.png", "/overview/activity/timeline", "batchrl.definitions"),
    Page("automation.png", "/automation", "new_logs_sensor"),
    # the latest policy update's per-step curves; the RL iterations' numbers across materialisations (Plots: one
    # chart per key against the materialisation time, iteration a chart of its own); the chain against its
    # iteration (each promotion's chart); the evaluation's overlay
    Page("policy_curves.png", "/assets/policy_checkpoint?view=events", "curves", row_link="[Show Markdown]"),
    Page("rewards_plots.png", "/assets/rewards", "Metadata", to_top=True, button="Plots"),
    Page("advantages_plots.png", "/assets/advantages", "Metadata", to_top=True, button="Plots"),
    Page("rl_chain_chart.png", "/assets/promoted_policy?view=events", "iterations_chart", row_link="[Show Markdown]"),
    Page("evaluation_overlay.png", "/assets/evaluation?view=events", "comparison_chart", row_link="[Show Markdown]"),
]


def shrink(path: str) -> None:
    """The screenshot in 256 colours (a UI page has few): a third of the bytes in the docs."""
    from PIL import Image

    with Image.open(path) as image:
        image.convert("RGB").quantize(colors=256).save(path, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=3000)
    parser.add_argument("--out", default="docs/ui")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=900)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    os.makedirs(args.out, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": args.width, "height": args.height})
        for shot in PAGES:
            page.goto(f"http://127.0.0.1:{args.port}{shot.path}")
            shown = page.get_by_text(shot.text, exact=True).first
            shown.wait_for(timeout=60_000)
            page.wait_for_load_state("networkidle")
            if shot.button:
                page.get_by_role("button", name=shot.button).click()
                page.locator("canvas").first.wait_for(timeout=30_000)  # the plots are canvases
                page.wait_for_timeout(1000)  # their drawing animation
            if shot.to_top:
                shown.evaluate("element => element.scrollIntoView({block: 'start'})")
            if shot.row_link:
                shown.locator("xpath=ancestor::tr").get_by_text(shot.row_link).first.click()
                page.get_by_role("dialog").locator("img[src^='data:image/png']").first.wait_for(timeout=30_000)
                page.wait_for_timeout(1000)  # the dialog's fade-in
            path = os.path.join(args.out, shot.file)
            page.screenshot(path=path)
            shrink(path)
            print(path, os.path.getsize(path), "bytes")
        browser.close()


if __name__ == "__main__":
    main()
