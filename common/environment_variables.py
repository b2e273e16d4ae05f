"""Every environment variable batchrl defines, in one table (``VARIABLES``), and the one reader of them (``read``).

A variable is read where its value is needed (the Dagster process when the code location builds its resources, a
job process, the command line), always through ``read``: a value that does not parse fails naming the variable
(``EnvironmentVariableError``, a ``RunConfigError``: `batchrl run` shows it as one line, exit 2); unset or blank
gives the table's default. Resource fields that Dagster resolves itself are ``dg.EnvVar`` in the resource
(``resources/environments.py``; the UI then shows the variable, not its value). docs/ENVIRONMENT.md is this table
(``markdown``; tests/test_environment_variables.py keeps them equal and checks that no other module reads a
``BATCHRL_`` variable). Standard library only: the thin ``batchrl`` client imports it.
"""
from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Mapping

from batchrl.common.run_config_error import RunConfigError

PREFIX = "BATCHRL_"
DAGSTER, JOB, CLI = "Dagster", "job", "CLI"  # who reads it: the code location's process, a job process, the CLI
KINDS = ("text", "path", "flag", "int", "float", "choice", "json")
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class EnvironmentVariableError(RunConfigError):
    """A ``BATCHRL_`` variable whose value does not parse as its table entry says."""


# a namedtuple, not a dataclass: the thin client imports this module, and dataclasses costs it inspect and ast
_FIELDS = ("name", "kind", "default", "readers", "summary", "choices", "minimum", "unset", "sets", "dagster_env_var",
           "internal")


class Variable(collections.namedtuple("Variable", _FIELDS, defaults=((), None, "", "", False, False))):
    """A row of the table. ``kind``: one of KINDS; ``default``: what ``read`` gives when unset or blank;
    ``readers``: DAGSTER, JOB, CLI; ``summary``: what it does, one line; ``choices``: kind choice's values;
    ``minimum``: kinds int and float, the least value allowed; ``unset``: what unset means where ``default`` alone
    does not say it; ``sets``: the resource fields it gives its value to, comma-separated; ``dagster_env_var``:
    those fields are ``dg.EnvVar(name)`` (Dagster resolves it, the UI shows the name); ``internal``: batchrl sets it
    for its own child processes, no setting for users."""
    __slots__ = ()


def _v(name: str, kind: str, default: object, readers: tuple[str, ...], summary: str, **more: object) -> Variable:
    return Variable(PREFIX + name, kind, default, readers, summary, **more)


_TABLE = (
    # choosing the environment and where things are
    _v("ENV", "choice", "local", (DAGSTER, JOB, CLI), "the resources' environment (docs/CONFIGURATION.md)",
       choices=("local", "s3", "gpu", "ray")),
    _v("STORAGE", "path", ".storage", (DAGSTER, JOB, CLI), "the local storage root (catalog, caches; the artifacts "
       "too but in s3 and ray)", sets="storage.root, catalog.path"),
    _v("PROFILE", "text", None, (DAGSTER, CLI), "a run profile (a name in profiles/ or a .yaml path) whose resource "
       "overrides the code location takes and whose job it adds", unset="no profile (`batchrl run --profile` sets it)"),
    _v("DPO_SELF_PLAY", "flag", None, (DAGSTER,), "whether dpo_pairs takes the policy's scored samples (a rewards "
       "input)", unset="as the profile's dpo_pairs source says (`batchrl run` sets it)"),
    _v("LANDING", "text", None, (DAGSTER,), "a folder or s3:// prefix where the team's logs land (layout: "
       "resources/landing.py)", unset="the shipped sample data", sets="landing.*"),
    _v("S3_ROOT", "text", "s3://batchrl/artifacts", (DAGSTER,), "the artifacts' root in s3 and ray",
       sets="storage.root"),
    _v("S3_ENDPOINT", "text", None, (DAGSTER,), "an S3-compatible endpoint URL (MinIO ...)", unset="AWS's",
       sets="storage.storage_options"),
    # tracking
    _v("MLFLOW_URI", "text", None, (DAGSTER,), "MLflow tracking server or sqlite:/// store of the training assets",
       unset="no MLflow tracking", sets="tracking.mlflow_uri", dagster_env_var=True),
    _v("MLFLOW_EXPERIMENT", "text", "batchrl", (DAGSTER,), "the MLflow experiment and W&B project",
       sets="tracking.experiment", dagster_env_var=True),
    _v("WANDB_DIR", "text", None, (DAGSTER,), "a folder for W&B offline runs", unset="no W&B",
       sets="tracking.wandb_dir", dagster_env_var=True),
    # the gpu environment's jobs
    _v("ROLLOUT_ENGINE", "choice", None, (DAGSTER,), "the gpu environment's rollout engine",
       choices=("transformers", "static", "vllm"), unset="static (vllm: resident in the job worker)",
       sets="rollout_engine.kind"),
    _v("NUM_GPUS", "int", 1, (DAGSTER, JOB), "GPUs of a training job in the gpu environment (> 1: data-parallel "
       "under torchrun; the launcher sets it for its jobs)", minimum=0, sets="trainer.num_gpus"),
    _v("JOB_BACKEND", "choice", "worker", (DAGSTER,), "how the gpu environment runs one-process jobs",
       choices=("subprocess", "worker", "k8s", "ray"), sets="trainer.backend"),
    _v("GPU_JOB_SLOTS", "int", 2, (DAGSTER,), "GPU jobs that may run at once in the gpu environment", minimum=1,
       sets="trainer.gpu_job_slots"),
    # the ray environment
    _v("RAY_ADDRESS", "text", "http://127.0.0.1:8265", (DAGSTER,), "the Ray cluster's job submission address",
       sets="trainer.ray.address"),
    _v("RAY_WORLD_SIZE", "int", 2, (DAGSTER,), "ranks of a training job on Ray", minimum=1,
       sets="trainer.ray.world_size"),
    _v("RAY_GPUS_PER_RANK", "float", 0.0, (DAGSTER,), "GPUs of each Ray rank (0: a CPU slot and gloo)", minimum=0,
       sets="trainer.ray.gpus_per_rank"),
    _v("RAY_CPUS_PER_RANK", "float", 1.0, (DAGSTER,), "CPU slots of each Ray rank (Ray sets its threads to them)",
       minimum=0, sets="trainer.ray.cpus_per_rank"),
    _v("RAY_PLACEMENT", "choice", "PACK", (DAGSTER,), "the Ray placement group's strategy",
       choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"), sets="trainer.ray.placement_strategy"),
    _v("RAY_ROLLOUT_REPLICAS", "int", 1, (DAGSTER,), "rollout replicas on Ray", minimum=1,
       sets="trainer.ray.rollout_replicas"),
    _v("RAY_RESIDENT_IDLE_S", "float", 600.0, (DAGSTER,), "idle seconds before a node's resident job worker exits "
       "(0: a fresh process per Ray job)", minimum=0, sets="trainer.ray.resident_worker_idle_s"),
    _v("RAY_DRIVER_IDLE_S", "float", 0.0, (DAGSTER,), "> 0: one driver resident on the Ray cluster takes the steps' "
       "jobs and exits after this many idle seconds (0: a Ray job per step through dagster-ray)", minimum=0,
       sets="trainer.ray.resident_driver_idle_s"),
    _v("RAY_PLACEMENT_TIMEOUT_S", "float", 300.0, (JOB,), "seconds the Ray driver waits for its placement group",
       minimum=0),
    _v("RAY_INPUT_CACHE_ENTRIES", "int", 8, (JOB,), "published artifacts (models, tables) a Ray node keeps for later "
       "jobs, the least recently used dropped first", minimum=1),
    _v("RAY_INPUT_CACHE_DIR", "path", None, (JOB,), "where a Ray node keeps published artifacts for later jobs "
       "(and in .node/ the samples an update drew ahead for the next rollouts job there)",
       unset="<temp dir>/batchrl-ray-inputs"),
    # inside the job processes
    _v("WEIGHT_CACHE_GB", "float", None, (JOB,), "decimal GB of model weights the job worker keeps (0: off)",
       minimum=0, unset="4 GB on a CUDA host, at most 10% of the GPU; off on CPU"),
    _v("RESIDENT_ENGINE_GB", "float", None, (JOB,), "decimal GB a rollout engine kept between RL iterations may "
       "hold (0: never kept)", minimum=0, unset="a quarter of the GPU; on CPU the weight cache's limit"),
    _v("RESIDENT_TRAINER_GB", "float", None, (JOB,), "decimal GB a policy trainer kept between RL iterations may "
       "hold (0: never kept)", minimum=0, unset="a tenth of the GPU; on CPU the weight cache's limit"),
    _v("RESIDENT_TRAINER_REBUILD", "flag", False, (JOB,), "a kept trainer gets a new engine even where its engine "
       "could be renewed (the CPU tests' way through the bf16 path)"),
    _v("CUDNN_ATTENTION", "flag", False, (JOB,), "let masked attention use cuDNN (it plans every new batch shape)"),
    _v("PROFILE_JOBS", "path", None, (JOB,), "a folder: each job profiled with torch.profiler, a summary there "
       "(training/timing/profiling.py)", unset="no profiling"),
    _v("PROFILE_TRACE", "flag", False, (JOB,), "with PROFILE_JOBS, keep each job's Chrome trace too"),
    _v("CPROFILE_DIR", "path", None, (JOB,), "a folder: each job in the worker under cProfile, dumped there",
       unset="no cProfile"),
    _v("SANDBOX", "choice", None, (JOB,), "the sandbox level of tools and code rewards (it must work here)",
       choices=("bwrap", "namespaces", "rlimits"), unset="the strongest level that works here"),
    _v("BWRAP", "path", None, (JOB,), "the bubblewrap binary (a <binary>.sha256 beside it is checked)",
       unset="bwrap on PATH"),
    # the command line
    _v("CONCURRENT_STEPS", "int", None, (CLI,), "`batchrl run --concurrent-steps`' default", minimum=1,
       unset="the environment's: gpu 3, else 1"),
    _v("MIN_FREE_GB", "float", 0.5, (CLI,), "room `batchrl run` keeps free on the storage root's and the cache's "
       "file systems: no further RL iteration starts where less than this plus what the last one published is free",
       minimum=0),
    _v("SERVER", "flag", True, (CLI,), "whether `batchrl` runs its command in a warm `batchrl serve` (off: never)"),
    # set by batchrl for its own child processes
    _v("OUTPUT_ROUTED", "flag", False, (DAGSTER,), "`batchrl run` already sends its runs' output where it wants: "
       "the run log leaves it alone", internal=True),
    _v("CONFIG_RESOURCES", "json", [], (DAGSTER,), "`batchrl run -c` files' resource overrides for the code "
       "location the command's processes build", internal=True),
    _v("STEP_SERVER_STARTED", "float", None, (DAGSTER,), "when the step server started (its preload reports how "
       "long it took)", internal=True),
    _v("DIST_ENV_PID", "text", None, (JOB,), "pid:port of the process that set the rendezvous variables itself",
       internal=True),
    _v("RAY_STORAGE_OPTIONS", "json", {}, (JOB,), "the storage options of a Ray job's files (the Ray driver)",
       internal=True),
    _v("OUTPUT_RECORD", "path", None, (JOB,), "where a job writes its output folder and content hash (a Ray rank "
       "keeps that output on its node for the later jobs there that read it once published)", internal=True),
)
VARIABLES: dict[str, Variable] = {variable.name: variable for variable in _TABLE}


def variable(name: str) -> Variable:
    """The table's entry; KeyError naming the table for a name it lacks (add it there first)."""
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not in batchrl's table of environment variables "
                       "(common/environment_variables.py)") from None


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` has a value (not unset, not blank)."""
    variable(name)
    return bool((os.environ if environ is None else environ).get(name, "").strip())


def read(name: str, environ: Mapping[str, str] | None = None) -> object:
    """``name``'s value in ``environ`` (default this process's), parsed as the table says; the table's default
    when unset or blank. ``EnvironmentVariableError`` names the variable, the value and what it takes."""
    entry = variable(name)
    text = (os.environ if environ is None else environ).get(name, "")
    if not text.strip():  # a path's default is relative to the working dir, as a value given would be
        return _parsed(entry, entry.default) if entry.kind == "path" and entry.default else entry.default
    try:
        return _parsed(entry, text.strip())
    except ValueError as error:
        raise EnvironmentVariableError(f"{name}={text!r}: {error}") from None


def _parsed(entry: Variable, text: str) -> object:
    if entry.kind == "text":
        return text
    if entry.kind == "path":
        return os.path.abspath(os.path.expanduser(text))
    if entry.kind == "flag":
        if text.lower() in TRUE_WORDS + FALSE_WORDS:
            return text.lower() in TRUE_WORDS
        raise ValueError(f"a flag expected ({'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)})")
    if entry.kind == "choice":
        if text in entry.choices:
            return text
        raise ValueError(f"one of {', '.join(entry.choices)} expected")
    if entry.kind == "json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"JSON expected ({error})") from None
    number = _number(entry.kind, text)
    if entry.minimum is not None and number < entry.minimum:
        raise ValueError(f"at least {entry.minimum:g} expected")
    return number


def _number(kind: str, text: str) -> int | float:
    try:
        number = int(text) if kind == "int" else float(text)
    except ValueError:
        raise ValueError(f"{'a whole number' if kind == 'int' else 'a number'} expected") from None
    if not math.isfinite(number):
        raise ValueError("a finite number expected")
    return number


def _default_shown(entry: Variable) -> str:
    if entry.unset:
        return entry.unset if entry.default is None else f"`{entry.default}`: {entry.unset}"
    if entry.default is None:
        return "unset"
    if entry.kind == "flag":
        return "on" if entry.default else "off"
    return f"`{json.dumps(entry.default) if entry.kind == 'json' else entry.default}`"


def _kind_shown(entry: Variable) -> str:
    if entry.kind == "choice":
        return " \\| ".join(entry.choices)
    return f"{entry.kind} >= {entry.minimum:g}" if entry.minimum is not None else entry.kind


def _sets_shown(entry: Variable) -> str:
    fields = ", ".join(f"`{field.strip()}`" for field in entry.sets.split(",") if field.strip())
    return f"{fields} (dg.EnvVar)" if entry.dagster_env_var else fields


def markdown() -> str:
    """docs/ENVIRONMENT.md: the settings, then the variables batchrl sets for its own processes."""
    head = ("| Variable | Takes | Unset | Read by | Sets | What it does |\n"
            "|---|---|---|---|---|---|\n")

    def rows(internal: bool) -> str:
        return "".join(f"| `{e.name}` | {_kind_shown(e)} | {_default_shown(e)} | {', '.join(e.readers)} | "
                       f"{_sets_shown(e)} | {e.summary} |\n"
                       for e in _TABLE if e.internal == internal)

    return (f"# Environment variables\n\n"
            f"<!-- generated from common/environment_variables.py by `python -m batchrl.common.environment_variables "
            f"--write`; tests/test_environment_variables.py fails when the two differ -->\n\n"
            f"Every variable batchrl reads, read through `common/environment_variables.py` only. Unset or blank: "
            f"the default. A value that does not parse fails naming the variable. Flags take "
            f"{'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}. Read by: **Dagster**, the process that builds the "
            f"code location (`dagster dev`, `batchrl run` and its step processes: set it before they start); "
            f"**job**, a job process (the job worker gets every `BATCHRL_` variable of the step with each "
            f"request); **CLI**, the `batchrl` command. Sets: the resource field it fills; `dg.EnvVar` fields "
            f"Dagster resolves itself (the UI shows the variable, not its value).\n\n"
            f"## Settings\n\n{head}{rows(False)}\n"
            f"## Set by batchrl for its own processes\n\nNot settings: listed so that every `BATCHRL_` name has "
            f"its line.\n\n{head}{rows(True)}")


DOC_PATH = os.path.join("docs", "ENVIRONMENT.md")


def write_doc(package_dir: str) -> str:
    """Write docs/ENVIRONMENT.md under ``package_dir``; returns its path."""
    path = os.path.join(package_dir, DOC_PATH)
    with open(path, "w") as f:
        f.write(markdown())
    return path


if __name__ == "__main__":  # python -m batchrl.common.environment_variables --write
    import sys

    from batchrl.common.package import PACKAGE_DIR

    if sys.argv[1:] == ["--write"]:
        print(write_doc(PACKAGE_DIR))
    else:
        sys.stdout.write(markdown())
