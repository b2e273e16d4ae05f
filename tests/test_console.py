"""The console of `batchrl run`: one line per finished asset, however many threads read the event log, and a
step's checks under the assets they check."""
from __future__ import annotations

import io
import threading

import dagster as dg

from batchrl.cli.console import RunProgress


@dg.asset(check_specs=[dg.AssetCheckSpec("positive", asset="numbers")])
def numbers():
    yield dg.Output([1, 2, 3])
    yield dg.AssetCheckResult(passed=True)  # evaluated inside the step, before the step ends


@dg.asset
def total(numbers: list[int]) -> int:
    return sum(numbers)


def test_concurrent_polls_write_each_asset_once(tmp_path):
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        result = dg.materialize([numbers, total], instance=instance)
        assert result.success
        out = io.StringIO()
        progress = RunProgress(instance, result.run_id, {"numbers", "total"}, out)
        start = threading.Barrier(8)

        def poll():
            start.wait()
            progress.poll()

        threads = [threading.Thread(target=poll) for _ in range(8)]  # the follower thread and follow() at once
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        lines = out.getvalue().splitlines()
        assert [line.split()[3] for line in lines if line.startswith("[")] == ["numbers", "total"], lines
        assert lines[0].startswith("[ 1/2] ok ") and lines[2].startswith("[ 2/2] ok ")
        assert lines[1].strip() == "check positive: passed"  # under the asset it checks, once


def test_the_command_exits_promptly_with_its_status_output_and_exit_handlers(tmp_path):
    """``batchrl`` (console_main) skips the interpreter's module teardown, not what an exit must do: the
    command's exit status, buffered stdout flushed, stderr, atexit handlers run."""
    import os
    import subprocess
    import sys

    marker = tmp_path / "atexit-ran"
    code = ("import atexit, sys; from batchrl.cli.main import console_main; "
            f"atexit.register(lambda: open({str(marker)!r}, 'w').write('yes')); "
            "print('buffered before the command'); console_main(['audit', 'raw_logs'])")
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]  # nothing materialised in this fresh instance
    assert "buffered before the command" in done.stdout
    assert "no materialisation of raw_logs" in done.stderr
    assert marker.read_text() == "yes"


def test_a_failure_line_keeps_the_field_names_of_a_long_error(tmp_path):
    """Issue 29.7: the one-line failure was cut at 160 characters, before ``missing fields [...]``."""
    from batchrl.cli.console import asset_line
    from batchrl.ingest.config import IngestError

    drop = "/".join(["s3://team-bucket/landing/preferences"] + [f"drop-2026-12-0{i}" for i in range(1, 6)])
    error = f"IngestError: {IngestError(f'{drop}/bad.csv', 1, 'columns do not match the contract', ['chosen'], ['answer'])}"
    line = asset_line(3, 20, "validated_preferences", 0.4, False, {}, error)
    assert "bad.csv:1" in line and "missing fields ['chosen']" in line and "extra fields ['answer']" in line, line
    assert len(line) <= 230, line


@dg.asset(check_specs=[dg.AssetCheckSpec("positive", asset="signed", blocking=True)])
def signed():
    yield dg.Output([1, -2, 3], metadata={"data_version": "0123456789abcdef"})
    yield dg.AssetCheckResult(passed=False)  # blocking: the step fails after the asset was published


@dg.asset
def signed_total(signed: list[int]) -> int:
    return sum(signed)


def test_a_failed_blocking_check_says_what_was_published_and_what_it_blocked(tmp_path):
    """Issue 29.7: the console said "0 assets materialised" although the checked asset was published."""
    from batchrl.cli.console import print_run_summary

    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        result = dg.materialize([signed, signed_total], instance=instance, raise_on_error=False)
        assert not result.success
        out = io.StringIO()
        progress = RunProgress(instance, result.run_id, {"signed", "signed_total"}, out)
        progress.poll()
        print_run_summary(progress.done, False, 1.0, None, lambda asset: None, out=out)
    text = out.getvalue()
    assert "0 assets materialised" not in text and "1 assets materialised" in text, text
    assert "0123456789abcdef" in text and "blocking check positive FAILED: downstream not run" in text, text
    assert "signed was published, but its blocking check positive failed" in text, text


def test_the_footer_names_the_dagster_home_and_the_batchrl_in_use(tmp_path, monkeypatch):
    """Issue 29.7: the hints always said DAGSTER_HOME=$PWD/.dagster_home and .venv/bin/batchrl."""
    import os
    import sys

    from batchrl.cli.console import print_run_summary

    home = tmp_path / "elsewhere" / "dagster home"

    def footer(argv0: str, path: str) -> str:
        monkeypatch.setattr(sys, "argv", [argv0, "run"])
        monkeypatch.setenv("PATH", path)
        out = io.StringIO()
        built = [{"asset": "policy_checkpoint", "ok": True, "seconds": 1.0, "metadata": {}}]  # what the hint audits
        print_run_summary(built, True, 1.0, None, lambda asset: None, out=out, dagster_home=str(home))
        return out.getvalue()

    program = tmp_path / "tools" / "batchrl"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    shown = footer(str(program), os.defpath)
    assert "$PWD/.dagster_home" not in shown and ".venv/bin/batchrl" not in shown, shown
    assert f"DAGSTER_HOME='{home}'" in shown and f"{program} audit policy_checkpoint" in shown, shown
    # found on PATH: by name
    assert "audit:  batchrl audit" in footer(str(program), f"{program.parent}{os.pathsep}{os.defpath}")
    assert " -m batchrl.cli audit" in footer("-m", os.defpath)  # python -m batchrl.cli


def test_the_evaluation_table_fits_100_columns_with_every_model():
    from batchrl.cli.evaluation_report import evaluation_table

    models = ["base_model", "policy_checkpoint", "dpo_checkpoint", "offline_policy_checkpoint", "kto_checkpoint"]
    metrics = {"arith_accuracy": 0.123456, "preference_accuracy/prefs_001.jsonl": 0.5, "logratio_margin": -1.234e-05,
               "a_metric_name_much_longer_than_any_column_could_ever_hold_in_a_terminal_of_a_hundred": 1.0}
    lines = evaluation_table({m: dict(metrics) for m in models})
    assert max(len(line) for line in lines) <= 100
    assert lines[0].split() == ["metric", "base", "policy", "dpo", "offline", "kto"]
    assert any(line.startswith("arith_accuracy ") and "0.1235" in line for line in lines)
    assert any("…" in line for line in lines)


def test_an_asset_line_wraps_at_100_columns_keeping_every_headline_value():
    """README command 1's lines (issue 50): the ingest counts and a blocked check's note continue on indented lines
    instead of running past a terminal of 100 columns; nothing is cut."""
    from batchrl.cli.console import asset_line

    counts = {"rows_in": 140, "valid": 122, "quarantined": 0, "duplicates": 18, "data_version": "4f183fa215e63215"}
    line = asset_line(7, 23, "feedback_logs", 0.1, True, counts, blocked=["reject_rate_below_threshold"])
    rows = line.split("\n")
    assert len(rows) >= 2 and max(len(row) for row in rows) <= 100, line
    assert all(row.startswith(" " * 8) for row in rows[1:]), line
    assert "rows_in=140 valid=122 quarantined=0 duplicates=18" in " ".join(line.split())
    assert "blocking check reject_rate_below_threshold FAILED" in line
    short = asset_line(2, 23, "prompts", 0.1, True, {"rows": 250, "data_version": "3297668604c0de84"})
    assert "\n" not in short and short.endswith("rows=250")


@dg.asset
def scored() -> int:
    return 3


@dg.asset_check(asset=scored, blocking=True)
def scored_is_even(scored: int) -> dg.AssetCheckResult:  # a check of its own step, as promotion's gate is
    return dg.AssetCheckResult(passed=scored % 2 == 0)


def test_a_failed_check_step_is_not_counted_as_an_asset(tmp_path):
    """Issue 50: a blocking check in a step of its own failed, and the console wrote ``[ 2/1] FAIL`` for its step."""
    from batchrl.cli.console import print_run_summary

    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        result = dg.materialize([scored, scored_is_even], instance=instance, raise_on_error=False)
        assert not result.success
        out = io.StringIO()
        progress = RunProgress(instance, result.run_id, {"scored"}, out)
        progress.poll()
        print_run_summary(progress.done, False, 1.0, None, lambda asset: None, out=out)
    lines = out.getvalue().splitlines()
    counted = [line for line in lines if line.startswith("[")]
    assert len(counted) == 1 and counted[0].startswith("[ 1/1] ok ") and " scored " in counted[0], lines
    assert "check scored_is_even: FAILED" in [line.strip() for line in lines], lines
    assert any(line.startswith("FAILED: 1 assets materialised, step ") and "scored_is_even failed" in line
               for line in lines), lines
