"""`batchrl run`: the run config (a profile, then ``-c`` files over it), the plan of executions (RL iterations,
then evaluation), checked whole before anything starts, then each execution with one line per asset."""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

from batchrl.cli.disk_room import RETENTION_HINT, IterationRoom
from batchrl.cli.prune_command import add_retention_arguments, prune_after_iteration, run_retention
from batchrl.cli.instance import ensure_dagster_home, latest_uri, open_instance
from batchrl.common.environment_variables import EnvironmentVariableError, read


def add_command(sub) -> None:
    """The ``run`` subcommand; EnvironmentVariableError when BATCHRL_CONCURRENT_STEPS is no number of steps."""
    run = sub.add_parser("run", help="materialise assets (default: all) into the persistent Dagster instance")
    run.add_argument("--select", default="*", help="comma-separated asset names, or * for all")
    run.add_argument("--rl-iterations", type=int, default=None,
                     help="rollout→policy_checkpoint iterations (each from the latest checkpoint), then evaluation "
                          "(default: the profile's, else 1)")
    run.add_argument("--profile", help="a run profile from profiles/ (e.g. 'real') or a profile .yaml path")
    run.add_argument("-c", "--config", action="append",
                     help="run-config YAML: ops: and resources: as in a profile, merged field by field over the "
                          "profile's (a later file over an earlier one); may be repeated")
    run.add_argument("--eval-every", type=_every, default=None, metavar="K",
                     help="with --rl-iterations N: also evaluate after every K-th iteration (held-out accuracy "
                          "against the iteration, in the RL chain's iteration chart), not only after the last")
    run.add_argument("--max-minutes", type=float, default=None,
                     help="start no further RL iteration after this many minutes (then evaluate)")
    run.add_argument("--concurrent-steps", type=_steps, default=default_concurrent_steps(), metavar="N",
                     help="steps that may run at once, each in a process of its own (Dagster's multiprocess "
                     "executor, as from the UI): independent branches, e.g. DPO beside RL, overlap; 1: one at a "
                     "time in this process. Default: BATCHRL_CONCURRENT_STEPS, else the environment's (gpu 3, "
                     "local and s3 1)")
    add_retention_arguments(run, "after each RL iteration (over the profile's retention:)")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="stream Dagster's events and the libraries' output here (default: a log file under "
                          "DAGSTER_HOME/logs; one line per asset here)")
    run.set_defaults(func=cmd_run)


RL_LOOP = ("rollouts", "rewards", "advantages", "policy_checkpoint")
EVALUATION_AFTER = "evaluation after RL iteration"  # the title of an --eval-every evaluation, then the iteration


def _every(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of RL iterations, at least 1")
    return int(text)


def _run_config(args: argparse.Namespace) -> tuple[dict, int]:
    """Run config and default RL iterations: the profile's, then ``-c`` files merged over it; the files'
    ``resources`` go over the profile's the same way, in the code location this command builds. Without a profile,
    the embedded default's recipe (``resources.profiles.EMBEDDED_DEFAULT``) goes under the files. ``ProfileError``
    (a ``RunConfigError``) for a profile or file that cannot be read."""
    from batchrl.resources.profiles import (
        announce_run_file_resources, deep_merge, dpo_self_play, embedded_default, load_profile, load_run_file,
    )

    ops, iterations = {}, 1
    if args.profile:
        os.environ["BATCHRL_PROFILE"] = args.profile  # read when the definitions build their resources
        profile = load_profile(args.profile)
        ops, iterations = profile["ops"], profile["rl_iterations"]
        print(f"=== profile {args.profile} ({read('BATCHRL_ENV')}): {profile['description']}")
    files = [(path, load_run_file(path)) for path in args.config or []]
    for _, loaded in files:
        ops = deep_merge(ops, loaded["ops"])
    if not args.profile:  # the tiny default's recipe (README command 1), under the files
        ops = deep_merge(embedded_default(ops), ops)
    announce_run_file_resources([(path, loaded["resources"]) for path, loaded in files])
    if dpo_self_play(ops):  # the DPO path with its rewards input (read when the definitions build)
        os.environ["BATCHRL_DPO_SELF_PLAY"] = "1"
    return ({"ops": ops} if ops else {}), (args.rl_iterations or iterations)


def _with_seed(run_config: dict, seed: int) -> dict:
    from batchrl.resources.profiles import deep_merge

    return deep_merge(run_config, {"ops": {"rollouts": {"config": {"seed": seed}}}})


def _plan(defs, args, run_config: dict, iterations: int,
          eval_every: int | None = None) -> list[tuple[str, list[str] | None, dict]]:
    """The executions of one `batchrl run`: (title, selection, run config) each, validated up front. Evaluation runs
    after the last RL iteration, and with ``eval_every`` K after every K-th one too."""
    selection = None if args.select == "*" else args.select.split(",")
    if iterations <= 1:
        return [("", selection, _config_for(run_config, selection))]
    # every asset a run can materialise (not promoted_policy: the RL loop's back edge, which no op computes)
    every = selection or sorted(key.to_user_string() for key in defs.resolve_asset_graph().executable_asset_keys)
    plan = [("", [name for name in every if name != "evaluation"], None)]  # evaluated after the last (and each K-th)
    evaluated = "evaluation" in every
    # iteration i samples with seed base + i: the config's rollouts seed (0 by default) starts the numbering, so a
    # replicate run with another seed shares no iteration's samples with the first
    base = int(run_config.get("ops", {}).get("rollouts", {}).get("config", {}).get("seed", 0))
    for i in range(1, iterations):
        if evaluated and eval_every and i % eval_every == 0:  # after iteration i (not the last)
            plan.append((f"{EVALUATION_AFTER} {i}", ["evaluation"], run_config))
        plan.append((f"RL iteration {i + 1} of {iterations}", list(RL_LOOP), _with_seed(run_config, base + i)))
    plan += [("evaluation", ["evaluation"], run_config)] if evaluated else []
    return [(title, sel, _config_for(cfg if cfg is not None else run_config, sel)) for title, sel, cfg in plan]


def announced_next(plan: list[tuple[str, list[str] | None, dict]], position: int) -> dict[str, str]:
    """The tags of execution ``position``: when an RL iteration follows it (after an --eval-every evaluation or not),
    that iteration's rollouts seed (what a policy update with ``rl_recipe.sample_ahead`` samples ahead; a run without
    the tag has no next iteration known)."""
    from batchrl.assets.rollout_prefetch import NEXT_ROLLOUTS_SEED_TAG

    following = next((entry for entry in plan[position + 1:] if not entry[0].startswith(EVALUATION_AFTER)), None)
    if following is None or not following[0].startswith("RL iteration"):
        return {}
    seed = following[2].get("ops", {}).get("rollouts", {}).get("config", {}).get("seed", 0)
    return {NEXT_ROLLOUTS_SEED_TAG: str(int(seed))}


def evaluation_skipped(title: str, evaluated_since: bool, budget_spent: bool) -> bool:
    """Whether the execution ``title`` is an evaluation to skip: the policy was evaluated and no RL iteration ran
    since (``evaluated_since``), or it is an --eval-every one and --max-minutes skipped the iterations before it (the
    last evaluation still runs)."""
    if not title.startswith("evaluation"):
        return False
    return evaluated_since or (budget_spent and title.startswith(EVALUATION_AFTER))


def _runs_jobs(defs, jobs: list) -> bool:
    """Some asset of ``jobs`` launches jobs (needs the ``trainer`` resource)."""
    graph = defs.resolve_asset_graph()
    return any("trainer" in graph.get(key).assets_def.required_resource_keys
               for job in jobs for key in job.asset_layer.executable_asset_keys)


# a GPU's stages leave it partly idle, so the GPU environment overlaps independent steps (their jobs share the GPU
# through gpu_job_slots); on CPU they would divide the same cores for too little gain to pay a process per step
# (both measured in bench/RESULTS.md, ninth session)
CONCURRENT_STEPS_BY_ENV = {"local": 1, "s3": 1, "gpu": 3}


def _steps(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of steps, at least 1")
    return int(text)


def default_concurrent_steps() -> int:
    """``batchrl run --concurrent-steps``' default: BATCHRL_CONCURRENT_STEPS, else BATCHRL_ENV's."""
    explicit = read("BATCHRL_CONCURRENT_STEPS")
    if explicit is not None:
        return explicit
    try:
        return CONCURRENT_STEPS_BY_ENV.get(read("BATCHRL_ENV"), 1)
    except EnvironmentVariableError:  # an unknown environment is the definitions' error, not every command's parser's
        return 1


def cmd_run(args: argparse.Namespace) -> int:
    """``batchrl run``; the environment it sets for its own runs is restored when it returns (a caller in the
    same process, e.g. a test, then starts other programs with its own environment)."""
    from batchrl.common.log_file import OUTPUT_ROUTED_ENV
    from batchrl.resources.profiles import CONFIG_RESOURCES_ENV

    saved = {name: os.environ.get(name) for name in (OUTPUT_ROUTED_ENV, CONFIG_RESOURCES_ENV)}
    try:
        return _run(args)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _refused(error: Exception) -> int:
    """A run config refused before anything ran: each of its lines (one per problem) on stderr; exit status 2."""
    for line in str(error).splitlines():
        print(f"batchrl run: {line}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    from batchrl.common.run_config_error import RunConfigError

    home = ensure_dagster_home()
    try:
        run_config, iterations = _run_config(args)
        retention = run_retention(args)
    except RunConfigError as error:  # a profile or -c file that cannot be read
        return _refused(error)
    from batchrl.cli.console import RunProgress, print_run_summary, quiet_libraries, run_log_path
    from batchrl.common.log_file import OUTPUT_ROUTED_ENV, output_to_log

    quiet_libraries()
    log_path = run_log_path(home)
    os.environ[OUTPUT_ROUTED_ENV] = "1"  # this command's runs write where it says (its log file, or here with -v)
    if args.concurrent_steps > 1:  # first thing: the step server's imports overlap this process's
        from batchrl.runs import step_server

        step_server.start(None if args.verbose else log_path)
    import contextlib
    import uuid

    import dagster as dg

    from batchrl.resources.landing import check_landing_inputs
    from batchrl.runs.execute import execute_assets, selected_job
    from batchrl.runs.log_drops import drops_to_ingest
    from batchrl.runs.retention import RETAINED_ASSETS
    from batchrl.runs.run_config import config_file_tags, validate_plan

    try:  # the code location builds its resources on import: the profile's and -c files' overrides (ProfileError)
        from batchrl.definitions import build_definitions

        defs = build_definitions()
    except RunConfigError as error:
        return _refused(error)
    plan = _plan(defs, args, run_config, iterations, args.eval_every)
    jobs: dict[tuple, dg.JobDefinition] = {}

    def job_of(selection: list[str] | None) -> dg.JobDefinition:  # one subset each: a long RL run repeats one
        key = tuple(selection or ())
        if key not in jobs:
            jobs[key] = selected_job(defs, selection)
        return jobs[key]

    try:  # every distinct execution's config, before the first asset runs
        validate_plan(defs, run_config, [(job_of(sel), config) for sel, config in _distinct_executions(plan)],
                      _config_sources(args))
        check_landing_inputs(defs, list(jobs.values()))  # the selected assets' landed inputs (LandingInputMissing)
    except (RunConfigError, dg.DagsterInvalidSubsetError) as error:
        return _refused(error)
    if _runs_jobs(defs, list(jobs.values())):  # every selection of the plan was validated: its job is there
        # its imports overlap the data-only first steps
        defs.resources["trainer"].prestart_worker(concurrent=args.concurrent_steps > 1,
                                                  named=_named_workers(defs.resources["rl_recipe"]))
    # in this process: every step of a one-at-a-time run, and each RL iteration (a chain: ``execute.is_chain``)
    in_process = args.concurrent_steps <= 1 or iterations > 1
    if in_process and any(sel is None or TORCH_IN_PROCESS & set(sel) for _, sel, _ in plan):
        _import_in_background(["torch", "batchrl.training.rl.advantages", "batchrl.training.rewards.registry"])
    tags = config_file_tags(args.config or [])
    started = time.monotonic()
    done: list[dict] = []
    with open_instance() as instance:
        with contextlib.ExitStack() as stack:
            out = sys.stdout if args.verbose else stack.enter_context(output_to_log(log_path))
            drops = len(drops_to_ingest(defs, instance))  # each new log drop's run gives three lines
            counts = [_step_count(job_of(sel), drops) for _, sel, _ in plan]
            steps = sum(counts)
            out.write(f"batchrl run: {steps} asset steps; details in {'this console' if args.verbose else log_path}\n")
            budget_spent = evaluated_since = False  # evaluated_since: no RL iteration ran since the last evaluation
            root, cache = (getattr(defs.resources.get("storage"), field, "") for field in ("root", "cache_dir"))
            room = IterationRoom([root, cache, home], cache, read("BATCHRL_MIN_FREE_GB"), frozenset(RL_LOOP))
            for position, (title, selection, config) in enumerate(plan):
                stop = room.stop(title)
                if stop is not None:  # said once; the RL iterations left are skipped, the evaluation still runs
                    out.write(stop)
                    continue
                if title.startswith("RL iteration") and args.max_minutes and (
                        budget_spent or time.monotonic() - started > 60 * args.max_minutes):
                    if not budget_spent:  # said once; the RL iterations left are skipped, the evaluation still runs
                        out.write(f"=== time budget of {args.max_minutes} min reached: no further RL iteration\n")
                    budget_spent = True
                    continue
                if evaluation_skipped(title, evaluated_since, budget_spent or room.short is not None):
                    continue
                evaluated_since = title.startswith("evaluation")
                if title:
                    out.write(f"=== {title}\n")
                run_id = str(uuid.uuid4())
                assets = {k.to_user_string() for k in job_of(selection).asset_layer.executable_asset_keys}
                with RunProgress(instance, run_id, assets, out) as progress:
                    progress.total = counts[position]
                    result = execute_assets(defs, instance, selection, config, run_id=run_id,
                                            tags={**tags, **announced_next(plan, position)},
                                            on_run=progress.follow, concurrent_steps=args.concurrent_steps)
                done += progress.done
                room.record(progress.done)
                if not result.success:
                    break
                if retention is not None and assets & set(RETAINED_ASSETS):  # before the next iteration's room check
                    out.write(prune_after_iteration(defs, instance, retention, args.keep))
        latest = functools.lru_cache(maxsize=None)(lambda asset: latest_uri(instance, asset))  # asked twice each
        print_run_summary(done, result.success, time.monotonic() - started, None if args.verbose else log_path, latest,
                          dagster_home=home)
    if room.short is not None:  # what was asked for did not all run: not a success for a schedule or a script
        print(f"batchrl run: stopped before all RL iterations: {room.short} (free space: {RETENTION_HINT}; or a "
              "smaller model)", file=sys.stderr)
    return 0 if result.success and room.short is None else 1


# assets whose model-free work (rule rewards, advantages) runs in this process with torch (on the GPU host too): the
# import, started with the run, overlaps the steps before it (rollouts waits on the job worker) instead of delaying
# the first RL iteration's advantages step
TORCH_IN_PROCESS = {"rewards", "advantages"}


def _named_workers(recipe) -> tuple[str, ...]:
    """The job worker's named workers the run will use: the rollouts worker of an off-policy RL recipe's iterations."""
    from batchrl.resources.rollout import PREFETCH_WORKER

    return (PREFETCH_WORKER,) if recipe.off_policy_steps else ()


def _import_in_background(modules: list[str]) -> None:
    """Import ``modules`` in a daemon thread; a step that imports one meanwhile waits for that module only."""
    import importlib
    import threading

    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError:  # the step that needs it reports it
                return

    threading.Thread(target=load, name="batchrl-imports", daemon=True).start()


def _config_sources(args: argparse.Namespace) -> str:
    """Where the run config came from, as its errors name it: the profile, then the ``-c`` files."""
    return ", ".join(([f"profile {args.profile}"] if args.profile else []) + (args.config or []))


def _distinct_executions(plan: list[tuple[str, list[str] | None, dict]]) -> list[tuple[list[str] | None, dict]]:
    """The plan's (selection, run config) pairs that validate differently: RL iterations differ in their rollouts
    seed alone (a whole number, ``_with_seed``), so one of them stands for all (validating each of 1,000 took ~10 s
    before the first step, and held back the job worker's start)."""
    distinct: dict[str, tuple[list[str] | None, dict]] = {}
    for title, selection, config in plan:
        shape = _with_seed(config, 0) if title.startswith("RL iteration") else config
        distinct.setdefault(json.dumps([selection, shape], sort_keys=True, default=str), (selection, config))
    return list(distinct.values())


def _step_count(job, drops: int) -> int:
    """Asset lines a run of ``job`` prints: the per-drop assets once per log drop to ingest, the others once."""
    from batchrl.assets.drops import PER_DROP_ASSETS

    keys = {k.to_user_string() for k in job.asset_layer.executable_asset_keys}
    per_drop = keys & set(PER_DROP_ASSETS)
    return len(keys) - len(per_drop) + len(per_drop) * drops


def _config_for(run_config: dict, selection: list[str] | None) -> dict:
    """Only the ops of the selected assets: Dagster refuses config for ops outside the run."""
    if not selection or "ops" not in run_config:
        return run_config
    from batchrl.assets.drops import DROP_OP, PER_DROP_ASSETS

    wanted = set(selection) | ({DROP_OP} if set(PER_DROP_ASSETS) & set(selection) else set())
    return {**run_config, "ops": {k: v for k, v in run_config["ops"].items() if k in wanted}}
