"""`batchrl run` (materialise everything), `batchrl audit` (lineage of a checkpoint), `batchrl home`."""
from __future__ import annotations

import argparse
import json
import os
import sys

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


def cmd_run(args: argparse.Namespace) -> int:
    ensure_dagster_home()
    import dagster as dg

    from batchrl.definitions import defs, execute_assets

    with dg.DagsterInstance.get() as instance:
        result = execute_assets(defs, instance, None if args.select == "*" else args.select.split(","))
        # Further on-policy iterations: each samples from the latest policy_checkpoint, with a new seed.
        for iteration in range(1, args.rl_iterations):
            if not result.success:
                break
            print(f"\n=== RL iteration {iteration + 1} of {args.rl_iterations}")
            result = execute_assets(defs, instance, list(RL_LOOP),
                                    {"ops": {"rollouts": {"config": {"seed": iteration}}}})
        if result.success and args.rl_iterations > 1:
            result = execute_assets(defs, instance, ["evaluation"])
        print("\n=== batchrl run:", "SUCCESS" if result.success else "FAILED", "run_id", result.run_id)
        for asset in ("validated_preferences", "policy_checkpoint", "dpo_checkpoint", "evaluation"):
            print(f"{asset:>22}: {_latest_uri(instance, asset)}")
        evaluation = _latest_uri(instance, "evaluation")
        if evaluation:
            print("\nevaluation:", os.path.join(evaluation, "evaluation.json"))
            with open(os.path.join(evaluation, "evaluation.json")) as f:
                for model, metrics in json.load(f).items():
                    shown = {k: round(v, 4) for k, v in metrics.items() if isinstance(v, (int, float))}
                    print(f"  {model}: {shown}")
        print("\naudit:  .venv/bin/batchrl audit policy_checkpoint")
        print("UI:     DAGSTER_HOME=$PWD/.dagster_home .venv/bin/dagster dev   (then open http://127.0.0.1:3000)")
    return 0 if result.success else 1


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
    run.add_argument("--rl-iterations", type=int, default=1,
                     help="rollout→policy_checkpoint iterations (each from the latest checkpoint), then evaluation")
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
