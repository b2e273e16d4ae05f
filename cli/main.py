"""batchrl's command line: `run` materialises the asset graph (one line per asset; Dagster's events in the
instance and a log file), `audit` shows an artifact's lineage or queries the catalog (which checkpoints used a
file, what changed between two), `stale` lists what a code or data change made stale, `reproduce` re-materialises
an artifact's lineage and compares data versions."""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

from batchrl.cli import warm_client, warm_server  # stdlib only: the thin client's path stays light

# concurrency pools: one step of the `batchrl_catalog` pool at a time (two log drops never write the
# catalog at once; docs/PARTITIONS.md)
DAGSTER_YAML = "telemetry:\n  enabled: false\nnux:\n  enabled: false\nconcurrency:\n  pools:\n    default_limit: 1\n"


def ensure_dagster_home() -> str:
    """A persistent DAGSTER_HOME (default ./.dagster_home) so runs and lineage survive restarts."""
    home = os.path.abspath(os.environ.get("DAGSTER_HOME") or ".dagster_home")
    os.makedirs(home, exist_ok=True)
    config = os.path.join(home, "dagster.yaml")
    if not os.path.exists(config):
        with open(config, "w") as f:
            f.write(DAGSTER_YAML)
    os.environ["DAGSTER_HOME"] = home
    return home


def open_instance():
    """The persistent instance; its storages' revision checks read Dagster's scripts once (``alembic_scripts``)."""
    import dagster as dg

    from batchrl.runs import alembic_scripts

    alembic_scripts.share()
    return dg.DagsterInstance.get()


def _latest_uri(instance, asset: str) -> str | None:
    """Where the latest materialisation of ``asset`` lies under this environment's storage root: a root copied
    with its Dagster home answers with its own copy, not the folder the event recorded."""
    import dagster as dg

    from batchrl.definitions import environment_resources
    from batchrl.resources.artifacts import latest_ref

    ref = latest_ref(instance, dg.AssetKey(asset))
    return environment_resources()["storage"].locate(ref).uri if ref else None


RL_LOOP = ("rollouts", "rewards", "advantages", "policy_checkpoint")


def _run_config(args: argparse.Namespace) -> tuple[dict, int]:
    """Run config and default RL iterations: the profile's, then ``-c`` files merged over it."""
    from batchrl.resources.profiles import deep_merge, dpo_self_play, load_profile

    ops, iterations = {}, 1
    if args.profile:
        os.environ["BATCHRL_PROFILE"] = args.profile  # read when the definitions build their resources
        profile = load_profile(args.profile)
        ops, iterations = profile["ops"], profile["rl_iterations"]
        print(f"=== profile {args.profile} ({os.environ.get('BATCHRL_ENV', 'local')}): {profile['description']}")
    for path in args.config or []:
        import yaml

        with open(path) as f:
            extra = yaml.safe_load(f) or {}
        ops = deep_merge(ops, extra.get("ops", extra))
    if dpo_self_play(ops):  # the DPO path with its rewards input (read when the definitions build)
        os.environ["BATCHRL_DPO_SELF_PLAY"] = "1"
    return ({"ops": ops} if ops else {}), (args.rl_iterations or iterations)


def _with_seed(run_config: dict, seed: int) -> dict:
    from batchrl.resources.profiles import deep_merge

    return deep_merge(run_config, {"ops": {"rollouts": {"config": {"seed": seed}}}})


def _plan(defs, args, run_config: dict, iterations: int) -> list[tuple[str, list[str] | None, dict]]:
    """The executions of one `batchrl run`: (title, selection, run config) each, validated up front."""
    selection = None if args.select == "*" else args.select.split(",")
    if iterations <= 1:
        return [("", selection, _config_for(run_config, selection))]
    # every asset a run can materialise (not promoted_policy: the RL loop's back edge, which no op computes)
    every = selection or sorted(key.to_user_string() for key in defs.resolve_asset_graph().executable_asset_keys)
    plan = [("", [name for name in every if name != "evaluation"], None)]  # evaluate once, after the last
    plan += [(f"RL iteration {i + 1} of {iterations}", list(RL_LOOP), _with_seed(run_config, i))
             for i in range(1, iterations)]
    plan += [("evaluation", ["evaluation"], run_config)] if "evaluation" in every else []
    return [(title, sel, _config_for(cfg if cfg is not None else run_config, sel)) for title, sel, cfg in plan]


def _runs_jobs(defs, selections: list[list[str] | None]) -> bool:
    """Some selected asset launches jobs (needs the ``trainer`` resource)."""
    from batchrl.definitions import selected_job

    graph = defs.resolve_asset_graph()
    return any("trainer" in graph.get(key).assets_def.required_resource_keys
               for selection in selections for key in selected_job(defs, selection).asset_layer.executable_asset_keys)


# a GPU's stages leave it partly idle, so the GPU environment overlaps independent steps (their jobs share the GPU
# through gpu_job_slots: whole graph 107 -> 94 s warm, 162-168 -> 130 s cold on one H200, bench/RESULTS.md); on CPU
# they divide the same cores (README job 140 -> 132 s on 2 cores: too little for a process per step)
CONCURRENT_STEPS_BY_ENV = {"local": 1, "s3": 1, "gpu": 3}


def _steps(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of steps, at least 1")
    return int(text)


def default_concurrent_steps() -> int:
    """``batchrl run --concurrent-steps``' default: BATCHRL_CONCURRENT_STEPS, else BATCHRL_ENV's."""
    explicit = os.environ.get("BATCHRL_CONCURRENT_STEPS")
    # an unknown environment is the definitions' error to report, not every command's parser's
    return _steps(explicit) if explicit else CONCURRENT_STEPS_BY_ENV.get(os.environ.get("BATCHRL_ENV", "local"), 1)


def cmd_run(args: argparse.Namespace) -> int:
    home = ensure_dagster_home()
    run_config, iterations = _run_config(args)
    from batchrl.cli.console import RunProgress, output_to_log, print_run_summary, quiet_libraries, run_log_path

    quiet_libraries()
    log_path = run_log_path(home)
    if args.concurrent_steps > 1:  # first thing: the step server's imports overlap this process's
        from batchrl.runs import step_server

        step_server.start(None if args.verbose else log_path)
    import contextlib
    import uuid

    import dagster as dg

    from batchrl.definitions import build_definitions, drops_to_ingest, execute_assets, selected_job
    from batchrl.runs.run_config import RunConfigError, config_file_tags, validate_plan

    defs = build_definitions()
    plan = _plan(defs, args, run_config, iterations)
    try:  # every execution's config, before the first asset runs
        validate_plan(defs, run_config, [(selected_job(defs, sel), config) for _, sel, config in plan],
                      ", ".join(args.config or []))
    except (RunConfigError, dg.DagsterInvalidSubsetError) as error:
        print(f"batchrl run: {error}", file=sys.stderr)
        return 2
    if _runs_jobs(defs, [selection for _, selection, _ in plan]):
        # its imports overlap the data-only first steps
        defs.resources["trainer"].prestart_worker(concurrent=args.concurrent_steps > 1)
    tags = config_file_tags(args.config or [])
    started = time.monotonic()
    done: list[dict] = []
    with open_instance() as instance:
        with contextlib.ExitStack() as stack:
            out = sys.stdout if args.verbose else stack.enter_context(output_to_log(log_path))
            drops = len(drops_to_ingest(defs, instance))  # each new log drop's run gives three lines
            counts = [_step_count(defs, sel, drops) for _, sel, _ in plan]
            steps = sum(counts)
            out.write(f"batchrl run: {steps} asset steps; details in {'this console' if args.verbose else log_path}\n")
            for title, selection, config in plan:
                if title.startswith("RL iteration") and args.max_minutes and \
                        time.monotonic() - started > 60 * args.max_minutes:
                    out.write(f"=== time budget of {args.max_minutes} min reached: no further RL iteration\n")
                    continue
                if title:
                    out.write(f"=== {title}\n")
                run_id = str(uuid.uuid4())
                assets = {k.to_user_string() for k in selected_job(defs, selection).asset_layer.executable_asset_keys}
                with RunProgress(instance, run_id, assets, out) as progress:
                    progress.total = counts[plan.index((title, selection, config))]
                    result = execute_assets(defs, instance, selection, config, run_id=run_id, tags=tags,
                                            on_run=progress.follow, concurrent_steps=args.concurrent_steps)
                done += progress.done
                if not result.success:
                    break
        latest = functools.lru_cache(maxsize=None)(lambda asset: _latest_uri(instance, asset))  # asked twice each
        print_run_summary(done, result.success, time.monotonic() - started, None if args.verbose else log_path, latest,
                          dagster_home=home)
    return 0 if result.success else 1


def _step_count(defs, selection: list[str] | None, drops: int) -> int:
    """Asset lines a run prints: the per-drop assets once per log drop to ingest, the others once."""
    from batchrl.assets.drops import PER_DROP_ASSETS
    from batchrl.definitions import selected_job

    keys = {k.to_user_string() for k in selected_job(defs, selection).asset_layer.executable_asset_keys}
    per_drop = keys & set(PER_DROP_ASSETS)
    return len(keys) - len(per_drop) + len(per_drop) * drops


def _config_for(run_config: dict, selection: list[str] | None) -> dict:
    """Only the ops of the selected assets: Dagster refuses config for ops outside the run."""
    if not selection or "ops" not in run_config:
        return run_config
    from batchrl.assets.drops import DROP_OP, PER_DROP_ASSETS

    wanted = set(selection) | ({DROP_OP} if set(PER_DROP_ASSETS) & set(selection) else set())
    return {**run_config, "ops": {k: v for k, v in run_config["ops"].items() if k in wanted}}


def _catalog_path(args: argparse.Namespace) -> str:
    from batchrl.lineage.code_versions import catalog_path_of, local_storage_root

    return args.catalog or catalog_path_of(local_storage_root())


def cmd_audit(args: argparse.Namespace) -> int:
    if args.used_file or args.diff:
        return _audit_catalog(args)
    from batchrl.lineage.audit import artifact_files, format_tree, lineage_tree, policy_chain

    uri = _target_uri(args.uri or args.asset)
    if uri is None:
        print(f"no materialisation of {args.asset} in {os.environ['DAGSTER_HOME']}", file=sys.stderr)
        return 2
    tree = lineage_tree(uri)
    if args.json:
        print(json.dumps(tree, indent=2, sort_keys=True))
    else:
        print(format_tree(tree))
        print("source files:", *artifact_files(tree), sep="\n  ")
        chain = policy_chain(tree)
        if len(chain) > 1:
            print("checkpoint chain (newest first):", " <- ".join(chain))
    return 0


def _audit_catalog(args: argparse.Namespace) -> int:
    """The catalog queries: checkpoints that used a file; what changed between two artifacts."""
    from batchrl.lineage.catalog_queries import CHECKPOINT_ASSETS, artifacts_using_file, diff_artifacts, format_diff

    catalog = _catalog_path(args)
    try:
        if args.used_file:
            rows = artifacts_using_file(catalog, args.used_file, None if args.all else CHECKPOINT_ASSETS)
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                print(f"{len(rows)} {'artifacts' if args.all else 'checkpoints'} used {args.used_file}:")
                for row in rows:
                    print(f"  {row['asset']:<22} {row['data_version']}  {row['created_at'][:19]}  {row['uri']}")
            return 0
        report = diff_artifacts(catalog, *args.diff)
        print(json.dumps(report, indent=2, default=str) if args.json else format_diff(report))
        return 0
    except (LookupError, FileNotFoundError) as error:
        print(f"batchrl audit: {error}", file=sys.stderr)
        return 2


def cmd_stale(args: argparse.Namespace) -> int:
    """Assets whose code version or upstream data changed since their last materialisation (as the UI says)."""
    ensure_dagster_home()
    from batchrl.definitions import build_definitions
    from batchrl.lineage.staleness import stale_causes

    with open_instance() as instance:
        causes = stale_causes(build_definitions(), instance)
    if args.json:
        print(json.dumps(causes, indent=2, sort_keys=True))
        return 0
    if not causes:
        print("every materialised asset is up to date with its code and its inputs")
    for asset, found in causes.items():
        own = [c for c in found if c["key"] == asset] or found
        print(f"{asset}: " + "; ".join(f"{c['key']} {c['reason']}" if c["key"] != asset else c["reason"] for c in own[:3]))
    return 0


def _target_uri(target: str) -> str | None:
    """An artifact folder, or the latest materialisation of an asset named ``target``."""
    if "/" in target or os.path.isdir(target):
        return os.path.abspath(target) if "://" not in target else target
    ensure_dagster_home()
    with open_instance() as instance:
        return _latest_uri(instance, target)


def cmd_reproduce(args: argparse.Namespace) -> int:
    from batchrl.cli.console import quiet_libraries
    from batchrl.runs.reproduce import ReproduceError, reproduce

    uri = _target_uri(args.target)
    if uri is None:
        print(f"no materialisation of {args.target} in {os.environ['DAGSTER_HOME']}", file=sys.stderr)
        return 2
    new_root = os.path.abspath(args.to or os.path.join(".reproduce", time.strftime("%Y%m%d-%H%M%S")))
    print(f"reproducing {uri}\n  into {new_root}")
    quiet_libraries()
    import contextlib

    from batchrl.cli.console import output_to_log

    log_path = os.path.join(new_root, "reproduce.log")
    try:
        with contextlib.ExitStack() as stack:
            out = sys.stdout if args.verbose else stack.enter_context(output_to_log(log_path))
            report = reproduce(uri, new_root, log=lambda line: out.write(line + "\n"))
    except ReproduceError as error:
        print(f"batchrl reproduce: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    equal = sum(row["equal"] for row in report["assets"])
    print(f"\n{equal} of {len(report['assets'])} data versions equal" + ("" if args.verbose else f" (log: {log_path})"))
    first = report["first_difference"]
    if first:
        print(f"first difference: {first['asset']} recorded {first['recorded']}, reproduced {first['reproduced']}")
        print(*(f"  {line}" for line in first["lineage_differences"]), sep="\n")
    return 0 if report["equal"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="materialise assets (default: all) into the persistent Dagster instance")
    run.add_argument("--select", default="*", help="comma-separated asset names, or * for all")
    run.add_argument("--rl-iterations", type=int, default=None,
                     help="rollout→policy_checkpoint iterations (each from the latest checkpoint), then evaluation "
                          "(default: the profile's, else 1)")
    run.add_argument("--profile", help="a run profile from profiles/ (e.g. 'real') or a profile .yaml path")
    run.add_argument("-c", "--config", action="append",
                     help="run-config YAML ({ops: ...}) merged over the profile's; may be repeated")
    run.add_argument("--max-minutes", type=float, default=None,
                     help="start no further RL iteration after this many minutes (then evaluate)")
    try:
        concurrent_default = default_concurrent_steps()
    except argparse.ArgumentTypeError as error:
        parser.error(f"BATCHRL_CONCURRENT_STEPS: {error}")
    run.add_argument("--concurrent-steps", type=_steps, default=concurrent_default, metavar="N",
                     help="steps that may run at once, each in a process of its own (Dagster's multiprocess "
                     "executor, as from the UI): independent branches, e.g. DPO beside RL, overlap; 1: one at a "
                     "time in this process. Default: BATCHRL_CONCURRENT_STEPS, else the environment's (gpu 3, "
                     "local and s3 1)")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="stream Dagster's events and the libraries' output here (default: a log file under "
                          "DAGSTER_HOME/logs; one line per asset here)")
    run.set_defaults(func=cmd_run)
    audit = sub.add_parser("audit", help="print the lineage of the latest materialisation of an asset; "
                                         "--used-file / --diff query the catalog")
    audit.add_argument("asset", nargs="?", default="policy_checkpoint")
    audit.add_argument("--uri", help="audit this artifact folder instead of the latest materialisation")
    audit.add_argument("--json", action="store_true")
    audit.add_argument("--used-file", metavar="FILE",
                       help="list the checkpoints whose lineage includes FILE (a path, file name or sha256 prefix)")
    audit.add_argument("--all", action="store_true", help="with --used-file: every artifact, not only checkpoints")
    audit.add_argument("--diff", nargs=2, metavar=("A", "B"),
                       help="what changed from artifact A to B (data version, asset/version or folder): files, "
                            "code versions, configs, packages")
    audit.add_argument("--catalog", help="the DuckDB catalog (default: <storage root>/catalog.duckdb)")
    audit.set_defaults(func=cmd_audit)
    stale = sub.add_parser("stale", help="list the assets that are stale (code version or upstream data changed) "
                                         "and why")
    stale.add_argument("--json", action="store_true")
    stale.set_defaults(func=cmd_stale)
    repro = sub.add_parser("reproduce", help="re-materialise an artifact and its whole lineage into a fresh storage "
                                            "root and compare every data version with the recorded one")
    repro.add_argument("target", nargs="?", default="policy_checkpoint",
                       help="an asset name (its latest materialisation) or an artifact folder")
    repro.add_argument("--to", help="the fresh storage root (default ./.reproduce/<time>)")
    repro.add_argument("--json", action="store_true", help="print the per-asset report as JSON")
    repro.add_argument("-v", "--verbose", action="store_true", help="stream Dagster's and the libraries' output")
    repro.set_defaults(func=cmd_reproduce)
    warm_server.add_command(sub)
    from batchrl.training import export  # `batchrl export`: its logic lives there (torch only when it runs)

    export.add_command(sub, _target_uri)
    args = parser.parse_args(argv)
    return args.func(args)


def console_main(argv: list[str] | None = None) -> None:
    """The ``batchrl`` command: in a fork of this environment's warm server when one answers
    (``warm_client``), else ``main`` here, then a prompt exit. A process that has loaded torch, transformers
    and Dagster spends ~0.5-1 s after its work tearing those modules down; the exit handlers still run
    (log handlers, temporary files, child processes) and the output is flushed, then the process ends
    without the teardown. An exception takes the normal way out (traceback, exit status 1)."""
    import atexit

    argv = sys.argv[1:] if argv is None else argv
    code = warm_client.run_remote(argv)
    if code is None:
        code = main(argv)
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    console_main()
