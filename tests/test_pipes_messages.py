"""A job's last Pipes message is read even when it is written as the session closes (resources/pipes_messages.py)."""
from __future__ import annotations

import dagster as dg

from batchrl.common.dagster_internals import dagster_tail_file
from batchrl.resources.pipes_messages import tail_until_closed


def _closing_as_the_last_message_lands(path):
    """A ``closed`` flag whose first reading finds the job's last message just written and the session closed
    (what happens when the reader's empty read and its flag check straddle both)."""
    calls = []

    def closed() -> bool:
        if not calls:
            with open(path, "a", encoding="utf-8") as f:
                f.write('{"method": "report_asset_materialization"}\n')
        calls.append(1)
        return True
    return closed


def test_dagster_tail_loses_a_message_written_between_its_read_and_its_check(tmp_path):
    path = tmp_path / "messages"
    path.write_text('{"method": "opened"}\n')
    lines = list(dagster_tail_file(str(path), _closing_as_the_last_message_lands(path)))
    assert lines == ['{"method": "opened"}\n']  # the report is lost: why batchrl has its own reader


def test_the_draining_tail_reads_every_message_written_before_the_close(tmp_path):
    path = tmp_path / "messages"
    path.write_text('{"method": "opened"}\n')
    lines = list(tail_until_closed(str(path), _closing_as_the_last_message_lands(path)))
    assert lines == ['{"method": "opened"}\n', '{"method": "report_asset_materialization"}\n']


def test_a_job_through_the_draining_reader_reports_its_metadata(tmp_path):
    """End to end through Dagster: a Pipes subprocess with the reader gives the step the job's metadata."""
    script = tmp_path / "job.py"
    script.write_text("from dagster_pipes import open_dagster_pipes\n"
                      "with open_dagster_pipes() as pipes:\n"
                      "    pipes.report_asset_materialization(metadata={'engine_reused': True, 'samples': 3})\n")
    from batchrl.resources.pipes_messages import DrainingTempFileMessageReader

    @dg.asset
    def job_output(context):
        import sys

        client = dg.PipesSubprocessClient(message_reader=DrainingTempFileMessageReader())
        return client.run(context=context, command=[sys.executable, str(script)]).get_materialize_result()

    with dg.instance_for_test() as instance:
        assert dg.materialize([job_output], instance=instance).success
        event = instance.get_latest_materialization_event(dg.AssetKey("job_output"))
        metadata = event.asset_materialization.metadata
        assert metadata["engine_reused"].value is True and metadata["samples"].value == 3


def _line_written_in_two_parts(path):
    """A ``closed`` flag that, while the reader tails, has the job write one message in two parts (as a long report
    leaves in several ``write`` calls), then closes the session after the second part."""
    calls = []

    def closed() -> bool:
        calls.append(1)
        with open(path, "a", encoding="utf-8") as f:
            if len(calls) == 2:
                f.write('{"method": "report_asset_materialization", "params": {"metadata": {"loss_curve"')
            elif len(calls) == 4:
                f.write(': [1.0, 0.5]}}}\n')
        return len(calls) >= 5
    return closed


def test_a_message_caught_half_written_is_read_whole(tmp_path):
    import json

    path = tmp_path / "messages"
    path.write_text('{"method": "opened"}\n')
    lines = list(tail_until_closed(str(path), _line_written_in_two_parts(path)))
    assert [json.loads(line)["method"] for line in lines] == ["opened", "report_asset_materialization"]
    # Dagster's tail hands its reader the cut line, which does not parse: its reader thread dies there
    again = tmp_path / "again"
    again.write_text('{"method": "opened"}\n')
    cut = list(dagster_tail_file(str(again), _line_written_in_two_parts(again)))
    assert len(cut) == 3 and not cut[1].endswith("\n")


def test_a_job_that_ends_without_its_report_fails_the_step(tmp_path):
    """A job whose materialisation report never reached the step (lost, or never sent) fails it with the job and
    work dir named: publishing would give an asset without the job's numbers."""
    import sys

    from batchrl.resources import TrainerLauncherResource

    script = tmp_path / "silent_job.py"
    script.write_text("from dagster_pipes import open_dagster_pipes\n"
                      "with open_dagster_pipes() as pipes:\n"
                      "    pipes.log.info('trained, but no report')\n")

    class SilentJobLauncher(TrainerLauncherResource):
        def command(self, job: str, config_path: str) -> list[str]:
            return [sys.executable, str(script)]

    @dg.asset
    def trained(context):
        return SilentJobLauncher().run_job(context, "train_policy", {}, str(tmp_path))

    with dg.instance_for_test() as instance:
        result = dg.materialize([trained], instance=instance, raise_on_error=False)
        assert not result.success
        failure = result.get_step_failure_events()[0].step_failure_data.error
        assert "'train_policy' ended without its materialisation report" in str(failure) and str(tmp_path) in str(failure)
