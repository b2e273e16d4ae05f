"""The commands that read lineage: `batchrl audit` (an artifact's lineage tree; the catalog's queries across
artifacts), `batchrl stale` (what a code or data change made stale) and `batchrl reproduce` (re-materialise an
artifact's lineage and compare data versions)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from batchrl.cli.instance import ensure_dagster_home, open_instance, target_uri


def add_commands(sub) -> None:
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


def _catalog_path(args: argparse.Namespace) -> str:
    from batchrl.common.storage_layout import catalog_path_of, local_storage_root

    return args.catalog or catalog_path_of(local_storage_root())


def cmd_audit(args: argparse.Namespace) -> int:
    if args.used_file or args.diff:
        return _audit_catalog(args)
    from batchrl.lineage.audit import artifact_files, format_tree, lineage_tree, policy_chain

    uri = target_uri(args.uri or args.asset)
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


def cmd_reproduce(args: argparse.Namespace) -> int:
    from batchrl.cli.console import quiet_libraries
    from batchrl.runs.reproduce import ReproduceError, reproduce

    uri = target_uri(args.target)
    if uri is None:
        print(f"no materialisation of {args.target} in {os.environ['DAGSTER_HOME']}", file=sys.stderr)
        return 2
    new_root = os.path.abspath(args.to or os.path.join(".reproduce", time.strftime("%Y%m%d-%H%M%S")))
    print(f"reproducing {uri}\n  into {new_root}")
    quiet_libraries()
    import contextlib

    from batchrl.common.log_file import output_to_log

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
