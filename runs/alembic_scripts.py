"""One read of Dagster's migration scripts per process. Dagster's SQLite storages compare a database's alembic
revision with the scripts' head each time they open one: the instance's run, event-index and schedule databases,
and every run's event-log shard the first time a process writes to it. Each check builds a new alembic
``ScriptDirectory``, which loads all ~90 scripts again (dev box: ~45 ms each time; 13 reads of the scripts in
`batchrl run` of the data assets, checks and new databases' stamps together, and 4 checks in every step process
before its step starts). The scripts cannot change under a running process, so the checks share one
``ScriptDirectory`` per script set, built before the step server forks.

Only the revision check reads the shared one (``common.dagster_internals.share_revision_check_scripts``: Dagster
has no setting for it); migrations and stamping (``alembic.command``) build their own, as before."""
from __future__ import annotations

from batchrl.common import dagster_internals

# the options from which alembic's ScriptDirectory.from_config finds and reads the scripts
_SCRIPT_OPTIONS = ("script_location", "version_locations", "recursive_version_locations", "sourceless",
                   "file_template", "path_separator", "version_path_separator")


class SharedScriptDirectory:
    """Stands in for ``ScriptDirectory`` where Dagster checks revisions: ``from_config`` returns the process's
    ``ScriptDirectory`` for the config's script set (its revision map, once built, is kept)."""

    shared = True
    _directories: dict = {}  # (script options) -> ScriptDirectory; Dagster checks under its own lock

    @classmethod
    def from_config(cls, config):
        from alembic.script import ScriptDirectory

        option = getattr(config, "get_alembic_option", config.get_main_option)  # alembic < 1.16: the latter
        key = tuple(option(name) for name in _SCRIPT_OPTIONS)
        if key not in cls._directories:
            cls._directories[key] = ScriptDirectory.from_config(config)
        return cls._directories[key]


def share() -> None:
    """Make Dagster's revision checks in this process share one ScriptDirectory per script set (idempotent)."""
    dagster_internals.share_revision_check_scripts(SharedScriptDirectory)


def warm() -> str:
    """``share``, then read Dagster's scripts now (the step server, so that its step processes find them read);
    returns the scripts' head revision. Reads no database."""
    share()
    config = dagster_internals.run_storage_alembic_config()
    return SharedScriptDirectory.from_config(config).as_revision_number("head")
