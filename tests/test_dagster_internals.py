"""What batchrl takes from Dagster's private API (``common/dagster_internals.py``) still exists and still does what
its callers rely on, each on a tiny case: the test to run after a Dagster bump."""
from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
import textwrap
import uuid

import dagster as dg
import pytest

from batchrl.common import dagster_internals

# a code location of two steps that could run at once after a first, in a module a step process can import
TINY_LOCATION = """
import dagster as dg

@dg.asset(code_version="1")
def first():
    return 1

@dg.asset
def left(first):
    return first + 1

@dg.asset
def right(first):
    return first + 2

defs = dg.Definitions(assets=[first, left, right], executor=dg.in_process_executor)
"""
JOB = "__ASSET_JOB"  # the implicit asset job's name


def private_imports() -> list[tuple[str, str | None]]:
    """(module, name) of every ``dagster._`` import in the isolating module (name None: ``import module``)."""
    with open(dagster_internals.__file__, "rb") as f:
        tree = ast.parse(f.read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dagster._"):
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.startswith("dagster._")]
    return found


@pytest.fixture
def tiny_location(tmp_path, monkeypatch):
    (tmp_path / "home").mkdir()
    (tmp_path / "tiny_location.py").write_text(TINY_LOCATION)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("tiny_location")
    sys.modules.pop("tiny_location", None)


def test_every_private_name_used_exists():
    imports = private_imports()
    assert len(imports) >= 15  # the parse found the imports inside the functions
    missing = [f"{module}.{name}" for module, name in imports
               if name is not None and not hasattr(importlib.import_module(module), name)]
    assert not missing, f"gone from this Dagster: {missing}"
    for module in (*dagster_internals.RUN_MODULES, *dagster_internals.STORAGE_MODULES):
        importlib.import_module(module)


def test_the_parameters_passed_to_dagster_are_still_taken():
    from dagster._core.execution.context_creation_job import PlanOrchestrationContextManager
    from dagster._core.execution.execute_in_process import merge_run_tags

    taken = {
        dg.DagsterInstance.create_run_for_job: {"job_def", "execution_plan", "run_id", "run_config", "tags",
                                                "asset_selection", "remote_job_origin", "job_code_origin"},
        dg.JobDefinition.as_ephemeral_job: {"resource_defs", "input_values", "asset_selection"},
        merge_run_tags: {"job_def", "partition_key", "tags", "asset_selection", "instance", "run_config"},
        PlanOrchestrationContextManager.__init__: {"context_event_generator", "job", "execution_plan", "dagster_run",
                                                   "instance", "run_config", "executor_defs", "output_capture",
                                                   "raise_on_error"},
        dg.ExecuteInProcessResult.__init__: {"job_def", "event_list", "dagster_run", "output_capture"},
    }
    for function, names in taken.items():
        assert names <= set(inspect.signature(function).parameters), function.__qualname__


def test_a_run_created_beforehand_runs_in_process_with_the_code_locations_origins(tiny_location, tmp_path):
    job = tiny_location.defs.resolve_implicit_global_asset_job_def()
    reconstructable = dagster_internals.module_job("tiny_location", "defs", JOB)
    assert reconstructable.get_definition().name == JOB
    assert reconstructable.get_python_origin().repository_origin.code_pointer.module == "tiny_location"
    keys = {dg.AssetKey("first"), dg.AssetKey("left")}
    beforehand, second = str(uuid.uuid4()), str(uuid.uuid4())
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        def create_run(tags, plan):
            return instance.create_run_for_job(
                job_def=job, execution_plan=plan, run_id=beforehand, run_config={}, tags={**tags, "mine": "1"},
                asset_selection=frozenset(keys), job_code_origin=reconstructable.get_python_origin(),
                remote_job_origin=dagster_internals.remote_job_origin("tiny_location", JOB, str(tmp_path),
                                                                      sys.executable))

        result = dagster_internals.execute_in_process_in_run(job, keys, instance, {}, None, None, create_run)
        assert result.success and result.run_id == beforehand
        assert {e.asset_key for e in result.get_asset_materialization_events()} == keys
        run = instance.get_run_by_id(beforehand)
        assert run.is_success and run.tags["mine"] == "1" and run.asset_selection == keys
        origin = run.remote_job_origin
        assert (origin.location_name, origin.repository_origin.repository_name, origin.job_name) == \
            ("tiny_location", dagster_internals.REPOSITORY, JOB)
        # what the UI's Overview timeline groups runs by
        by_repository = dg.RunsFilter(tags={".dagster/repository": f"{dagster_internals.REPOSITORY}@tiny_location"})
        assert [r.run_id for r in instance.get_runs(by_repository)] == [beforehand]
        # the run's snapshot is a subset of the location's own job: the UI finds the job it came from
        assert instance.get_job_snapshot(run.job_snapshot_id).lineage_snapshot.parent_snapshot_id == \
            job.get_job_snapshot_id()

        created = instance.create_run_for_job(job_def=job, run_id=second, asset_selection=frozenset(keys),
                                              job_code_origin=reconstructable.get_python_origin())
        done = dagster_internals.execute_created_run(reconstructable.get_subset(asset_selection=frozenset(keys)),
                                                     created, instance)
        assert done.success and done.run_id == second and instance.get_run_by_id(second).is_success


def test_steps_by_level_and_staleness(tiny_location, tmp_path):
    job = tiny_location.defs.resolve_implicit_global_asset_job_def()
    assert [sorted(level) for level in dagster_internals.steps_by_level(job)] == [["first"], ["left", "right"]]
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        assert dg.materialize([tiny_location.first, tiny_location.left], instance=instance).success
        assert dagster_internals.stale_causes(tiny_location.defs, instance) == {}
        changed = dg.Definitions(assets=[dg.asset(code_version="2", name="first")(lambda: 1), tiny_location.left])
        causes = dagster_internals.stale_causes(changed, instance)
        first = dg.AssetKey("first")
        assert set(causes) == {first}  # never-materialised right is left out
        assert [(c["category"], c["key"]) for c in causes[first]] == [("CODE", first)]
        assert "code version" in causes[first][0]["reason"]


def test_takes_any_config():
    @dg.asset
    def plain():
        return 1

    @dg.asset(config_schema={"size": int})
    def configured():
        return 1

    assert dagster_internals.takes_any_config(plain.op)
    assert not dagster_internals.takes_any_config(configured.op)


def test_the_revision_checks_read_the_shared_scripts(tmp_path):
    """In a fresh process (the share is for the process's lifetime): Dagster's revision check asks the shared
    class, and reads the same head as the scripts' own."""
    script = textwrap.dedent("""
        import sys
        import dagster as dg
        from alembic.script import ScriptDirectory
        from batchrl.common import dagster_internals

        asked = []

        class Counting:
            shared = True

            @classmethod
            def from_config(cls, config):
                asked.append(config)
                return ScriptDirectory.from_config(config)

        dagster_internals.share_revision_check_scripts(Counting)
        head = ScriptDirectory.from_config(dagster_internals.run_storage_alembic_config()).as_revision_number("head")
        with dg.DagsterInstance.local_temp(sys.argv[1]) as instance:
            asked.clear()
            revision = dagster_internals.run_storage_revision(instance)
        assert asked and revision == (head, head), (len(asked), revision, head)
    """)
    (tmp_path / "home").mkdir()
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "home")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_dagsters_tail_reads_until_closed(tmp_path):
    path = tmp_path / "messages"
    path.write_text('{"method": "opened"}\n{"method": "closed"}\n')
    assert list(dagster_internals.dagster_tail_file(str(path), lambda: True)) == \
        ['{"method": "opened"}\n', '{"method": "closed"}\n']
