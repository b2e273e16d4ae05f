"""A real `dagster dev` (webserver + daemon; or the webserver and the daemon apart) from the repo root on a fresh
DAGSTER_HOME and storage root, and the webserver's GraphQL API: shared by the UI tests (test_ui, test_ui_browser,
test_dg_cli)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from batchrl.cli.instance import write_instance_settings
from batchrl.common.log_file import OUTPUT_ROUTED_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every asset of the code location (the UI and `dg list defs` show these)
ASSET_KEYS = {"raw_logs", "cleaned_logs", "validated_preferences", "preference_window", "scored_logs", "scored_pairs",
              "prompts", "base_model", "reward_model", "rollouts", "rewards", "advantages", "policy_checkpoint",
              "dpo_pairs", "reference_logprobs", "dpo_checkpoint", "evaluation", "promoted_policy",
              "offline_policy_checkpoint", "feedback_logs", "kto_checkpoint"}


class Port(int):
    """The webserver's port, with the DAGSTER_HOME and storage root it runs on."""

    def __new__(cls, port: int, home: str, storage: str):
        value = super().__new__(cls, port)
        value.home = home
        value.storage = storage
        return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def graphql(port: int, query: str, variables: dict | None = None) -> dict:
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        payload = json.load(resp)
    assert "errors" not in payload, payload
    return payload["data"]


def serve(tmp_path_factory, meanwhile=None, command=("dagster", "dev")):
    """``dagster dev`` (or ``command``: ``("dg", "dev")``, ``("dagster-webserver",)``) on a fresh DAGSTER_HOME and
    storage root, yielding its Port once it answers; stopped after. ``meanwhile(port)`` runs while the webserver
    loads its code location (~20 s of a loaded box's time that a `batchrl run` into the same instance can use
    instead of waiting for it)."""
    home = tmp_path_factory.mktemp("home")
    write_instance_settings(str(home))
    port = Port(free_port(), str(home), str(tmp_path_factory.mktemp("storage")))
    import dagster as dg

    with dg.DagsterInstance.from_config(str(home)) as instance:  # the instance's databases created once, before
        instance.get_runs(limit=1)  # two processes (webserver, meanwhile's) race to create them
    log = open(home / "dagster_dev.log", "w")
    # no -h: the default host is part of what is tested (test_webserver_listens_on_loopback_only)
    proc = _start((*command, "-p", str(port)), port, log)
    try:
        if meanwhile is not None:
            meanwhile(port)
        deadline = time.time() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    log_tail = (home / "dagster_dev.log").read_text()[-3000:]
                    raise RuntimeError(f"{' '.join(command)} did not start: {log_tail}")
                time.sleep(1)
        yield port
    finally:
        stop_server(proc)
        log.close()


def _start(command: tuple[str, ...], port: Port, log) -> subprocess.Popen:
    """``command`` (a console script of this venv) from the repo root as a user's shell starts it, on the instance
    and storage root of ``port``, in a process group of its own. A user's shell, not this test process: an
    in-process `batchrl run` of an earlier test set BATCHRL_OUTPUT_ROUTED, which would keep the server's runs from
    writing their own log files."""
    env = {**{k: v for k, v in os.environ.items() if k != OUTPUT_ROUTED_ENV},
           "DAGSTER_HOME": port.home, "BATCHRL_STORAGE": port.storage}
    executable = os.path.join(os.path.dirname(sys.executable), command[0])
    return subprocess.Popen([executable, *command[1:]], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


@contextlib.contextmanager
def daemon(port: Port):
    """`dagster-daemon run` on the instance of a webserver served alone (``serve(command=("dagster-webserver",))``):
    the two services a deployment runs apart. Started after the test queued its work, so that the daemon's first
    iterations take it (the backfill daemon looks every 30 s)."""
    with open(os.path.join(port.home, "dagster_daemon.log"), "w") as log:
        proc = _start(("dagster-daemon", "run"), port, log)
        try:
            yield proc
        finally:
            stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server alone, which stops its own webserver, daemon and code servers (signalled as a group,
    it restarted a code server that then outlived it); then its group swept of anything left. A server that
    inherited SIGINT ignored also ignores SIGTERM: conftest's pytest_configure."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def listening(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in open(table).read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # 0A = LISTEN
                    found.append(address)
    return found
