"""Dagster's storages read their migration scripts once per process (``batchrl.runs.alembic_scripts``), with the same
revision checks' results."""
from __future__ import annotations

import json
import os
import subprocess
import sys

# opens a fresh instance and runs two materialisations (two event-log shards): how many times Dagster's revision
# checks had alembic build a ScriptDirectory (creating a database also stamps it, through alembic's own command,
# which builds its own), and the run storage's (revision, head) as the check reports them
SCRIPT = """
import json, sys, traceback
import alembic.script
import dagster as dg
from batchrl.common.dagster_internals import run_storage_revision

builds = []
original = alembic.script.ScriptDirectory.from_config.__func__
alembic.script.ScriptDirectory.from_config = classmethod(
    lambda cls, config: builds.append(any(f.name == "check_alembic_revision" for f in traceback.extract_stack()))
    or original(cls, config))
if sys.argv[1] == "shared":
    from batchrl.runs import alembic_scripts
    alembic_scripts.share()

@dg.asset
def number():
    return 1

with dg.DagsterInstance.get() as instance:
    for _ in range(2):
        assert dg.materialize([number], instance=instance).success
    checked = run_storage_revision(instance)
print(json.dumps({"builds": sum(builds), "run_storage": list(checked)}))
"""


def _open_and_run(tmp_path, mode: str) -> dict:
    home = tmp_path / mode
    home.mkdir()
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DAGSTER_HOME": str(home)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_migration_scripts_are_read_once_per_process_with_the_same_revisions(tmp_path):
    shared, default = _open_and_run(tmp_path, "shared"), _open_and_run(tmp_path, "default")
    # Dagster's own way reads them for every database it opens: the instance's three and each run's shard
    assert default["builds"] >= 5
    assert shared["builds"] == 1
    assert shared["run_storage"] == default["run_storage"]
    revision, head = shared["run_storage"]
    assert revision == head and head
