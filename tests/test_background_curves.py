"""The per-step chart drawn while the job runs (assets/background_curves.py): drawn from steps.jsonl as it grows,
a half-written line waited out, the drawing reused when it shows the final series, drawn again when not."""
from __future__ import annotations

import json
import os
import time

import batchrl.assets.background_curves as background
from batchrl.assets.curves import curve_metadata, read_steps, step_series


def _wait_for(predicate, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "the background drawing never came"
        time.sleep(0.05)


def test_chart_drawn_while_the_job_runs_is_the_one_published(tmp_path, monkeypatch):
    drawn = []

    def counting(series):
        drawn.append(sorted(series))
        return curve_metadata(series)

    monkeypatch.setattr(background, "curve_metadata", counting)
    steps = tmp_path / "steps.jsonl"
    with background.BackgroundCurves(str(tmp_path)) as curves:
        with open(steps, "w") as f:
            f.write(json.dumps({"step": 1, "loss": 1.0, "kl": 0.1}) + "\n" + '{"step": 2, "lo')  # a half line
            f.flush()
            time.sleep(3 * background.POLL_S)
            f.write('ss": 0.5, "kl": 0.2}\n')
        _wait_for(lambda: curves._drawn is not None and '"loss": [[1, 2]' in curves._drawn[0])
    final = step_series(read_steps(str(tmp_path)))
    before = len(drawn)
    metadata = curves.metadata(final)
    assert len(drawn) == before, "the chart of the final steps was drawn again after the job"
    assert metadata["curves"].value == curve_metadata(final)["curves"].value  # the same chart and table
    # series the background never saw (a job's list-valued results added): drawn now
    other = step_series(read_steps(str(tmp_path)), {"margins": [0.1, 0.2, 0.3]})
    assert "margins" in curves.metadata(other)["curves"].value
    assert len(drawn) == before + 1


def test_no_steps_file_draws_after_the_job(tmp_path):
    with background.BackgroundCurves(str(tmp_path)) as curves:
        time.sleep(2 * background.POLL_S)
    assert curves._drawn is None
    series = step_series([], {"loss": [1.0, 0.5]})
    assert "per-step curves" in curves.metadata(series)["curves"].value
    assert not os.path.exists(tmp_path / "steps.jsonl")
