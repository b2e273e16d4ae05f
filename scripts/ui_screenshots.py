"""Screenshots of the Dagster UI pages that docs/UI.md shows, from a running `dagster dev`, with the system's
chromium (Debian package) driven headless by playwright; each page is taken once the text it is about has
rendered. Used after the README's main job:

    .venv/bin/python scripts/ui_screenshots.py --port 3000 --out docs/ui
"""
from __future__ import annotations

import argparse
import os
import shutil

DROP = "/assets/validated_preferences?view=partitions&partition=prefs_001.jsonl"
# (file, path on the webserver, text that shows the page has rendered what it is about, scroll that text to the top,
# text of a link in that text's row to click first: the chart of a training asset opens from its "curves" entry)
PAGES = [
    ("drop_reason_counts.png", DROP, "reason/invalid_json", False, None),
    ("drop_quarantine_sample.png", DROP, "quarantine_sample", True, None),
    ("drop_reject_rate_check.png", "/assets/validated_preferences?view=checks&checkDetail=reject_rate_below_threshold",
     "top_reasons", False, None),
    ("runs.png", "/runs", "Target", False, None),
    ("timeline.png", "/overview/activity/timeline", "batchrl.definitions", False, None),
    ("automation.png", "/automation", "new_logs_sensor", False, None),
    ("policy_curves.png", "/assets/policy_checkpoint?view=events", "curves", False, "[Show Markdown]"),
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
        for name, path, text, to_top, click in PAGES:
            page.goto(f"http://127.0.0.1:{args.port}{path}")
            shown = page.get_by_text(text, exact=True).first
            shown.wait_for(timeout=60_000)
            page.wait_for_load_state("networkidle")
            if to_top:
                shown.evaluate("element => element.scrollIntoView({block: 'start'})")
            if click:
                shown.locator("xpath=ancestor::tr").get_by_text(click).first.click()
                page.locator("img[src^='data:image/png']").first.wait_for(timeout=30_000)
            page.screenshot(path=os.path.join(args.out, name))
            shrink(os.path.join(args.out, name))
            print(os.path.join(args.out, name))
        browser.close()


if __name__ == "__main__":
    main()
