"""The console of `batchrl run`: one line per finished asset, however many threads read the event log, and a
step's checks under the assets they check."""
from __future__ import annotations

import io
import threading

import dagster as dg

from batchrl.console import RunProgress


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
    code = ("import atexit, sys; from batchrl.cli import console_main; "
            f"atexit.register(lambda: open({str(marker)!r}, 'w').write('yes')); "
            "print('buffered before the command'); console_main(['audit', 'raw_logs'])")
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]  # nothing materialised in this fresh instance
    assert "buffered before the command" in done.stdout
    assert "no materialisation of raw_logs" in done.stderr
    assert marker.read_text() == "yes"
