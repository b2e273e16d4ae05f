"""The environment read in one place: every ``BATCHRL_`` variable in ``common/environment_variables.py``'s table, read
through it only (checked with ``ast``), docs/ENVIRONMENT.md equal to the table, values that do not parse refused
naming the variable; and the dagster.yaml ``batchrl`` writes, loaded by Dagster."""
from __future__ import annotations

import ast
import os
import re
import typing

import dagster as dg
import pytest

from batchrl.common.environment_variables import (
    KINDS, PREFIX, VARIABLES, EnvironmentVariableError, is_set, markdown, read, variable,
)
from batchrl.common.package import PACKAGE_DIR
from batchrl.common.run_config_error import RunConfigError

THE_MODULE = os.path.join("common", "environment_variables.py")
THIS_FILE = os.path.relpath(os.path.abspath(__file__), PACKAGE_DIR)
# not batchrl's package code: tests and benchmarks set variables, never read them through batchrl
OUTSIDE_PACKAGE = {"tests", "bench", "docs", "scripts", "sample_data", "profiles"}
SKIPPED_DIRS = {".venv", ".carry", ".git", "__pycache__", ".storage", ".dagster_home", ".pytest_cache",
                "node_modules", "batchrl.egg-info"}
# modules another change owns that still read a variable of the table directly; each must move to ``read`` (then
# its entry goes: the test fails while an entry names a file that no longer reads one)
NOT_YET_MOVED = {os.path.join("runs", "run_log.py"), os.path.join("runs", "step_preload.py")}
# names that appear in the repository but are no setting of batchrl's: each with why
NOT_SETTINGS = {"BATCHRL_ESCAPE_SECRET": "a secret tests/test_sandbox_escape.py plants for sandboxed code to look for"}
NAME = re.compile(r"BATCHRL_[A-Z0-9_]*[A-Z0-9]")
TEXT_SUFFIXES = (".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".json", ".cfg", ".ini")


def _files(suffixes: tuple[str, ...], package_only: bool) -> list[str]:
    """Paths relative to the checkout, hidden and build folders skipped."""
    found = []
    for folder, dirs, files in os.walk(PACKAGE_DIR):
        relative = os.path.relpath(folder, PACKAGE_DIR)
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".")
                         and not (package_only and relative == "." and d in OUTSIDE_PACKAGE))
        found += [os.path.normpath(os.path.join(relative, f)) for f in sorted(files) if f.endswith(suffixes)]
    return found


def _string_constants(trees: dict[str, ast.Module]) -> dict[str, str]:
    """Module-level ``NAME = "..."`` strings of every module (a read through an imported constant resolves too)."""
    constants = {}
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                constants.update({target.id: node.value.value for target in node.targets if isinstance(target, ast.Name)})
    return constants


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``, also inside an expression (``(os.environ if e is None else e)``)."""
    return any((isinstance(n, ast.Attribute) and n.attr == "environ") or (isinstance(n, ast.Name) and n.id == "environ")
               for n in ast.walk(node))


def environment_reads(tree: ast.Module, constants: dict[str, str]) -> list[tuple[int, str]]:
    """(line, name) of each read of a ``BATCHRL_`` variable straight from the process environment: ``os.environ.get``,
    ``os.environ[...]`` read, ``... in os.environ``, ``os.getenv``; the name a literal or a constant's."""
    def named(node: ast.AST | None) -> str | None:
        value = node.value if isinstance(node, ast.Constant) else \
            constants.get(node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else "")
        return value if isinstance(value, str) and value.startswith(PREFIX) else None

    reads = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value):
                key = node.args[0]
            elif (isinstance(func, ast.Attribute) and func.attr == "getenv") or \
                    (isinstance(func, ast.Name) and func.id == "getenv"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            key = node.left
        if named(key):
            reads.append((node.lineno, named(key)))
    return reads


def test_the_detector_finds_each_way_of_reading_the_environment():
    source = ("import os\nENV = 'BATCHRL_ENV'\nos.environ.get('BATCHRL_STORAGE')\nos.environ[ENV]\n"
              "'BATCHRL_X' in os.environ\nos.getenv('BATCHRL_Y', '')\n(os.environ if e is None else e).get(ENV)\n"
              "os.environ['BATCHRL_Z'] = '1'\nos.environ.get('HOME')\nos.environ.pop('BATCHRL_W', None)\n")
    tree = ast.parse(source)
    assert environment_reads(tree, _string_constants({"m": tree})) == [
        (3, "BATCHRL_STORAGE"), (4, "BATCHRL_ENV"), (5, "BATCHRL_X"), (6, "BATCHRL_Y"), (7, "BATCHRL_ENV")]


def test_no_module_but_the_one_reads_a_batchrl_variable_from_the_environment():
    trees = {}
    for path in _files((".py",), package_only=True):
        with open(os.path.join(PACKAGE_DIR, path)) as f:
            trees[path] = ast.parse(f.read(), path)
    constants = _string_constants(trees)
    reading = {path: environment_reads(tree, constants) for path, tree in trees.items() if path != THE_MODULE}
    reading = {path: found for path, found in reading.items() if found}
    assert set(reading) - NOT_YET_MOVED == set(), \
        f"read these through batchrl.common.environment_variables.read: {reading}"
    assert NOT_YET_MOVED <= set(reading), f"moved: take {sorted(NOT_YET_MOVED - set(reading))} off NOT_YET_MOVED"


def test_every_batchrl_name_in_the_repository_is_in_the_table():
    unknown: dict[str, list[str]] = {}
    for path in _files(TEXT_SUFFIXES, package_only=False):
        if path == THIS_FILE:  # its made-up names test the checks
            continue
        with open(os.path.join(PACKAGE_DIR, path), errors="replace") as f:
            for name in set(NAME.findall(f.read())) - set(VARIABLES) - set(NOT_SETTINGS):
                unknown.setdefault(name, []).append(path)
    assert unknown == {}, "add these to common/environment_variables.py's table (or rename them)"
    assert not set(NOT_SETTINGS) & set(VARIABLES)


def test_the_documented_table_is_the_modules():
    with open(os.path.join(PACKAGE_DIR, "docs", "ENVIRONMENT.md")) as f:
        documented = f.read()
    assert documented == markdown(), "regenerate: python -m batchrl.common.environment_variables --write"
    for name in VARIABLES:
        assert f"| `{name}` |" in documented
    with open(os.path.join(PACKAGE_DIR, "README.md")) as f:
        assert "docs/ENVIRONMENT.md" in f.read()


def test_the_tables_choices_and_defaults_are_the_codes():
    from batchrl.resources import TrainerLauncherResource
    from batchrl.resources.environments import RESOURCES_BY_ENV
    from batchrl.resources.ray_launch import RayJobs
    from batchrl.training.sandbox.levels import LEVELS

    assert VARIABLES["BATCHRL_ENV"].choices == tuple(RESOURCES_BY_ENV)
    assert VARIABLES["BATCHRL_SANDBOX"].choices == LEVELS
    backend = TrainerLauncherResource.model_fields["backend"].annotation
    assert VARIABLES["BATCHRL_JOB_BACKEND"].choices == typing.get_args(backend)
    placement = RayJobs.model_fields["placement_strategy"].annotation
    assert VARIABLES["BATCHRL_RAY_PLACEMENT"].choices == typing.get_args(placement)
    for name, field in (("RAY_ADDRESS", "address"), ("RAY_WORLD_SIZE", "world_size"),
                        ("RAY_ROLLOUT_REPLICAS", "rollout_replicas"), ("RAY_GPUS_PER_RANK", "gpus_per_rank"),
                        ("RAY_PLACEMENT", "placement_strategy"), ("RAY_DRIVER_IDLE_S", "resident_driver_idle_s")):
        assert VARIABLES[PREFIX + name].default == RayJobs.model_fields[field].default, name
    for entry in VARIABLES.values():
        assert entry.kind in KINDS and entry.summary and entry.readers and "|" not in entry.summary + entry.unset
        assert bool(entry.choices) == (entry.kind == "choice"), entry.name


@pytest.mark.parametrize("name, value, expected", [
    ("BATCHRL_SERVER", "off", False), ("BATCHRL_SERVER", "Yes", True), ("BATCHRL_SERVER", "  ", True),
    ("BATCHRL_GPU_JOB_SLOTS", "3", 3), ("BATCHRL_GPU_JOB_SLOTS", "", 2), ("BATCHRL_WEIGHT_CACHE_GB", "1.5", 1.5),
    ("BATCHRL_ENV", "gpu", "gpu"), ("BATCHRL_CONFIG_RESOURCES", '[["a.yaml", {}]]', [["a.yaml", {}]]),
    ("BATCHRL_STORAGE", "relative/root", os.path.abspath("relative/root")),
    ("BATCHRL_STORAGE", None, os.path.abspath(".storage")), ("BATCHRL_PROFILE", None, None),
])
def test_read_parses_as_the_table_says(name, value, expected):
    environ = {} if value is None else {name: value}
    assert read(name, environ) == expected
    assert is_set(name, environ) == bool(value and value.strip())


@pytest.mark.parametrize("name, value, rule", [
    ("BATCHRL_SERVER", "maybe", "a flag expected"), ("BATCHRL_GPU_JOB_SLOTS", "two", "a whole number expected"),
    ("BATCHRL_GPU_JOB_SLOTS", "0", "at least 1 expected"), ("BATCHRL_WEIGHT_CACHE_GB", "-1", "at least 0"),
    ("BATCHRL_WEIGHT_CACHE_GB", "nan", "a finite number"), ("BATCHRL_ENV", "prod", "one of local, s3, gpu, ray"),
    ("BATCHRL_CONFIG_RESOURCES", "[", "JSON expected"),
])
def test_a_value_that_does_not_parse_is_refused_naming_the_variable(name, value, rule):
    with pytest.raises(EnvironmentVariableError, match=f"^{re.escape(f'{name}={value!r}: {rule}')}") as refused:
        read(name, {name: value})
    assert isinstance(refused.value, RunConfigError)  # `batchrl run` shows it as one line, exit status 2


def test_a_name_outside_the_table_is_a_programming_error():
    with pytest.raises(KeyError, match="BATCHRL_NOPE is not in batchrl's table"):
        variable("BATCHRL_NOPE")
    with pytest.raises(KeyError):
        read("BATCHRL_NOPE", {"BATCHRL_NOPE": "1"})


def test_the_command_line_names_a_bad_variable(monkeypatch, capsys):
    from batchrl.cli.main import main

    monkeypatch.setenv("BATCHRL_CONCURRENT_STEPS", "0")
    with pytest.raises(SystemExit) as exited:
        main(["audit", "raw_logs"])
    assert exited.value.code == 2
    assert "BATCHRL_CONCURRENT_STEPS='0': at least 1 expected" in capsys.readouterr().err


def test_dagster_resolves_the_tables_env_var_fields(monkeypatch):
    """The tracking fields the table marks ``dg.EnvVar`` are exactly the environment's EnvVar fields, resolved by
    Dagster when it builds the resource."""
    from batchrl.resources.environments import environment_resources

    marked = {e.name: e.sets for e in VARIABLES.values() if e.dagster_env_var}
    for name in marked:
        monkeypatch.setenv(name, f"value of {name}")
    resources = environment_resources("local")
    env_vars = {f"{key}.{field}": value.env_var_name for key, resource in resources.items()
                for field, value in dict(resource).items() if isinstance(value, dg.EnvVar)}
    assert env_vars == {fields: name for name, fields in marked.items()}
    with dg.build_resources({"tracking": resources["tracking"]}) as built:
        assert built.tracking.mlflow_uri == "value of BATCHRL_MLFLOW_URI"


def test_the_dagster_home_batchrl_writes_loads_with_its_settings(tmp_path, monkeypatch):
    from batchrl.cli.instance import INSTANCE_FILE, ensure_dagster_home

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    home = ensure_dagster_home()
    with dg.DagsterInstance.from_config(home) as instance:
        assert instance.get_settings("telemetry") == {"enabled": False}
        assert instance.get_settings("nux") == {"enabled": False}
        # one step of a pool (the catalog writers' batchrl_catalog) at a time
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
    (tmp_path / "home" / INSTANCE_FILE).write_text("telemetry:\n  enabled: true\n")  # a user's own: kept
    ensure_dagster_home()
    assert (tmp_path / "home" / INSTANCE_FILE).read_text() == "telemetry:\n  enabled: true\n"
