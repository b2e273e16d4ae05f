"""`batchrl run` (materialise everything, optionally with a profile), `batchrl audit` (lineage of a checkpoint)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

DAGSTER_YAML = "telemetry:\n  enabled: false\nnux:\n  enabled: false\n"


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


def _latest_uri(instance, asset: str) -> str | None:
    import dagster as dg

    event = instance.get_latest_materialization_event(dg.AssetKey(asset))
    if event is None or event.asset_materialization is None:
        return None
    return event.asset_materialization.metadata["uri"].value


RL_LOOP = ("rollouts", "rewards", "advantages", "policy_checkpoint")


def _run_config(args: argparse.Namespace) -> tuple[dict, int]:
    """Run config and default RL iterations: the profile's, then ``-c`` files merged over it."""
    from batchrl.profiles import deep_merge, load_profile

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
    return ({"ops": ops} if ops else {}), (args.rl_iterations or iterations)


def _with_seed(run_config: dict, seed: int) -> dict:
    from batchrl.profiles import deep_merge

    return deep_merge(run_config, {"ops": {"rollouts": {"config": {"seed": seed}}}})


def cmd_run(args: argparse.Namespace) -> int:
    ensure_dagster_home()
    run_config, iterations = _run_config(args)
    import dagster as dg

    from batchrl.definitions import build_definitions, execute_assets

    defs = build_definitions()
    started = time.monotonic()
    with dg.DagsterInstance.get() as instance:
        selection = None if args.select == "*" else args.select.split(",")
        if iterations > 1:  # evaluate once, after the last iteration
            every = selection or [key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()]
            selection = [name for name in every if name != "evaluation"]
        result = execute_assets(defs, instance, selection, _config_for(run_config, selection))
        # Further on-policy iterations: each samples from the latest policy of this base model's chain.
        for iteration in range(1, iterations):
            if not result.success:
                break
            if args.max_minutes and time.monotonic() - started > 60 * args.max_minutes:
                print(f"\n=== time budget of {args.max_minutes} min reached after {iteration} RL iteration(s)")
                break
            print(f"\n=== RL iteration {iteration + 1} of {iterations}")
            result = execute_assets(defs, instance, list(RL_LOOP),
                                    _config_for(_with_seed(run_config, iteration), list(RL_LOOP)))
        if result.success and iterations > 1:
            result = execute_assets(defs, instance, ["evaluation"], _config_for(run_config, ["evaluation"]))
        print("\n=== batchrl run:", "SUCCESS" if result.success else "FAILED", "run_id", result.run_id,
              f"({time.monotonic() - started:.0f} s)")
        _print_summary(instance)
    return 0 if result.success else 1


def _config_for(run_config: dict, selection: list[str] | None) -> dict:
    """Only the ops of the selected assets: Dagster refuses config for ops outside the run."""
    if not selection or "ops" not in run_config:
        return run_config
    return {**run_config, "ops": {k: v for k, v in run_config["ops"].items() if k in selection}}


def _print_summary(instance) -> None:
    for asset in ("validated_preferences", "policy_checkpoint", "dpo_checkpoint", "evaluation"):
        print(f"{asset:>22}: {_latest_uri(instance, asset)}")
    evaluation = _latest_uri(instance, "evaluation")
    if evaluation:
        print("\nevaluation:", os.path.join(evaluation, "evaluation.json"))
        with open(os.path.join(evaluation, "evaluation.json")) as f:
            for model, metrics in json.load(f).items():
                shown = {k: round(v, 4) for k, v in metrics.items() if isinstance(v, (int, float))}
                print(f"  {model}: {shown}")
                for example in metrics.get("examples", [])[:3]:
                    print(f"    [{example.get('category', '')}] {example['prompt'][:60]!r} -> "
                          f"{example['response'][:80]!r} (gold {example['answer']})")
    print("\naudit:  .venv/bin/batchrl audit policy_checkpoint")
    print("UI:     DAGSTER_HOME=$PWD/.dagster_home .venv/bin/dagster dev   (then open http://127.0.0.1:3000)")


def cmd_audit(args: argparse.Namespace) -> int:
    from batchrl.audit import artifact_files, format_tree, lineage_tree

    uri = args.uri
    if uri is None:
        ensure_dagster_home()
        import dagster as dg

        with dg.DagsterInstance.get() as instance:
            uri = _latest_uri(instance, args.asset)
        if uri is None:
            print(f"no materialisation of {args.asset} in {os.environ['DAGSTER_HOME']}", file=sys.stderr)
            return 2
    tree = lineage_tree(uri)
    if args.json:
        print(json.dumps(tree, indent=2, sort_keys=True))
    else:
        print(format_tree(tree))
        print("source files:", *artifact_files(tree), sep="\n  ")
    return 0


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
    run.set_defaults(func=cmd_run)
    audit = sub.add_parser("audit", help="print the lineage of the latest materialisation of an asset")
    audit.add_argument("asset", nargs="?", default="policy_checkpoint")
    audit.add_argument("--uri", help="audit this artifact folder instead of the latest materialisation")
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(func=cmd_audit)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
