"""batchrl's command line: `run` materialises the asset graph (one line per asset; Dagster's events in the
instance and a log file), `audit` shows an artifact's lineage or queries the catalog (which checkpoints used a
file, what changed between two), `stale` lists what a code or data change made stale, `reproduce` re-materialises
an artifact's lineage and compares data versions, `prune` expires old checkpoints (retention)."""
from __future__ import annotations

import argparse
import os
import sys

# stdlib only, or light: the thin client's path stays light (the commands import what they need when they run)
from batchrl.cli import lineage_commands, prune_command, run_command, warm_client, warm_server
from batchrl.cli.instance import target_uri
from batchrl.common.environment_variables import EnvironmentVariableError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    try:
        run_command.add_command(sub)
    except EnvironmentVariableError as error:  # BATCHRL_CONCURRENT_STEPS (the message names it)
        parser.error(str(error))
    lineage_commands.add_commands(sub)
    prune_command.add_command(sub)
    warm_server.add_command(sub, run_command=main)  # a served command runs this same `main`
    from batchrl.training.jobs import export  # `batchrl export`: its logic lives there (torch only when it runs)

    export.add_command(sub, target_uri)
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
    try:
        code = warm_client.run_remote(argv)
    except EnvironmentVariableError as error:  # BATCHRL_SERVER that is no flag
        print(f"batchrl: {error}", file=sys.stderr)
        os._exit(2)
    if code is None:
        code = main(argv)
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
