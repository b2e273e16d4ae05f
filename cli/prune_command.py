"""`batchrl prune`: expire old checkpoints and carried optimizer states by a retention policy (``runs.retention``
plans, ``runs.expire`` frees), and the same prune after each RL iteration of `batchrl run` where a profile's or
``-c`` file's ``retention:`` or the command's flags set a policy."""
from __future__ import annotations

import argparse
import json
import sys

from batchrl.cli.instance import ensure_dagster_home, open_instance

KEEP_ALL = "all"  # a flag's way past a profile's number: keep every version


def _at_least_one(text: str) -> int | str:
    if text == KEEP_ALL:
        return KEEP_ALL
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number, at least 1, or {KEEP_ALL}")
    return int(text)


def add_retention_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """The retention flags of `batchrl prune` and `batchrl run` (``what``: when the policy applies)."""
    parser.add_argument("--keep-last", "--keep-last-checkpoints", dest="keep_last_checkpoints", type=_at_least_one,
                        metavar="N", help=f"{what}: per trained asset, the N newest versions keep their files; older "
                        "ones expire (data files and trainer work dir deleted, lineage.json and EXPIRED.json stay); "
                        f"{KEEP_ALL}: none expires, whatever the profile says")
    parser.add_argument("--optimizer-states", "--keep-optimizer-states", dest="keep_optimizer_states",
                        type=_at_least_one, metavar="K", help=f"{what}: the carried AdamW moments stay on the K newest "
                        f"checkpoints that have them (carry_optimizer_state), removed from older ones; {KEEP_ALL}: "
                        "kept on every one")
    parser.add_argument("--keep-every", dest="keep_every", type=_at_least_one, metavar="M",
                        help=f"{what}: besides the newest, keep every M-th version of each trained asset whole (RL "
                        f"iterations M, 2M, ...: points for an accuracy curve); {KEEP_ALL}: no such points")
    parser.add_argument("--keep", action="append", default=[], metavar="DATA_VERSION",
                        help="never expire this artifact version (repeatable); latest, promoted and in-use ones are "
                             "kept anyway")


def add_command(sub) -> None:
    prune = sub.add_parser("prune", help="expire old checkpoints and carried optimizer states (retention): their data "
                                         "files and work dirs are deleted, lineage and audit stay")
    add_retention_arguments(prune, "expire now")
    prune.add_argument("--dry-run", action="store_true", help="say what would expire and the space it frees; delete "
                                                             "nothing")
    prune.add_argument("--json", action="store_true", help="print the report as JSON")
    prune.set_defaults(func=cmd_prune)


def policy_of(args: argparse.Namespace, written: dict | None = None):
    """The retention policy: ``written`` (a profile's and ``-c`` files' ``retention:`` merged) with the flags over
    it; None when it keeps everything."""
    from batchrl.resources.retention import RetentionPolicy

    flags = {name: getattr(args, name, None) for name in RetentionPolicy.model_fields}
    given = {k: None if v == KEEP_ALL else v for k, v in flags.items() if v is not None}
    policy = RetentionPolicy(**{**(written or {}), **given})
    return policy if policy.active else None


def prune(storage, catalog, instance, policy, pins: list[str], dry_run: bool, by: str) -> dict:
    """Plan and apply (or, ``dry_run``, measure) ``policy``'s expiries: the report. ValueError for an unknown pin."""
    from batchrl.runs.expire import expire, measure
    from batchrl.runs.retention import plan

    planned = plan(storage, catalog, instance, policy, pins)
    freed = [measure(storage, e) if dry_run else expire(storage, catalog, e, by) for e in planned.expiries]
    return {
        "policy": policy.model_dump(), "dry_run": dry_run, "bytes_freed": sum(f.bytes_freed for f in freed),
        "expiries": [{"asset": f.expiry.version.asset, "data_version": f.expiry.version.data_version,
                      "part": f.expiry.part, "reason": f.expiry.reason, "removed": list(f.removed),
                      "bytes_freed": f.bytes_freed, "still_linked_bytes": f.still_linked_bytes,
                      "work_dir": f.work_dir} for f in freed],
        "kept": [{"asset": asset, "data_version": version, "why": why}
                 for (asset, version), why in sorted(planned.kept.items())]}


def _what(entry: dict) -> str:
    part = "" if entry["part"] == "all" else " optimizer state"
    return f"{entry['asset']} {entry['data_version']}{part}"


def report_lines(report: dict) -> list[str]:
    from batchrl.common.expired import size_text  # here: the command line's own imports stay light

    verb = "would expire" if report["dry_run"] else "expired"
    lines = []
    for entry in report["expiries"]:
        line = f"{verb} {_what(entry)}: {size_text(entry['bytes_freed'])} freed ({entry['reason']})"
        if entry["work_dir"] is None:
            line += "; its trainer work dir was not recorded (published before retention): left alone"
        if entry["still_linked_bytes"]:
            line += f"; {size_text(entry['still_linked_bytes'])} stay linked from elsewhere"
        lines.append(line)
    lines += [f"kept {entry['asset']} {entry['data_version']}: {entry['why']}" for entry in report["kept"]]
    total = size_text(report["bytes_freed"])
    lines.append(f"{len(report['expiries'])} expiries, {total} {'would be ' if report['dry_run'] else ''}freed")
    return lines


def loop_line(report: dict) -> str:
    """The line `batchrl run` says after an RL iteration's prune."""
    from batchrl.common.expired import size_text

    policy = ", ".join(f"{k} {v}" for k, v in report["policy"].items() if v is not None)
    done = ", ".join(_what(entry) for entry in report["expiries"]) or "nothing to expire"
    return f"=== retention ({policy}): {done}; {size_text(report['bytes_freed'])} freed\n"


def run_retention(args: argparse.Namespace):
    """`batchrl run`'s policy: the profile's ``retention:``, each ``-c`` file's over it, the flags over those; None
    keeps everything. ProfileError (a RunConfigError) for a block the policy refuses."""
    from batchrl.resources.profiles import deep_merge, load_profile, load_run_file

    written = load_profile(args.profile)["retention"] if args.profile else {}
    for path in args.config or []:
        written = deep_merge(written, load_run_file(path)["retention"])
    return policy_of(args, written)


def prune_after_iteration(defs, instance, policy, pins: list[str]) -> str:
    """Prune with the run's storage and catalog after an RL iteration: the line to say (a pin that names no version
    prunes nothing, said)."""
    try:
        report = prune(defs.resources["storage"], defs.resources["catalog"], instance, policy, pins, False,
                       by="batchrl run")
    except ValueError as error:
        return f"=== retention: nothing expired: {error}\n"
    return loop_line(report)


def cmd_prune(args: argparse.Namespace) -> int:
    policy = policy_of(args)
    if policy is None:
        print("batchrl prune: say what to keep: --keep-last N and/or --optimizer-states K", file=sys.stderr)
        return 2
    ensure_dagster_home()
    from batchrl.resources.environments import environment_resources

    resources = environment_resources()
    with open_instance() as instance:
        try:
            report = prune(resources["storage"], resources["catalog"], instance, policy, args.keep, args.dry_run,
                           by="batchrl prune")
        except ValueError as error:
            print(f"batchrl prune: {error}", file=sys.stderr)
            return 2
    print(json.dumps(report, indent=2, default=str) if args.json else "\n".join(report_lines(report)))
    return 0
