"""`batchrl serve`: a warm server whose forks run later `batchrl` commands of the same environment, with the
output, exit status and runs of a command in a fresh process."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers_batchrl_run import BATCHRL, run_selection

from batchrl.cli import warm_client
from batchrl.common.package import code_fingerprint


def test_a_served_run_gives_what_a_fresh_process_gives(tmp_path):
    fresh, served = run_selection(tmp_path, "fresh", 1), run_selection(tmp_path, "served", 1, served=True)
    concurrent = run_selection(tmp_path, "served-concurrent", 3, served=True)
    assert "`batchrl run --select" not in fresh["server_log"]
    for run in (served, concurrent):
        assert re.search(r"`batchrl run --select \S+ --concurrent-steps \d` in process (\d+)", run["server_log"])
        assert re.search(r"process \d+ \(`batchrl run .*`\) exited 0", run["server_log"])
        assert "SUCCESS: 10 assets materialised" in run["console"]
        assert run["versions"] == fresh["versions"] and len(fresh["versions"]) == 10
    # the concurrent run's step server is a fork of the command: it re-ran only the step preload
    assert "; forked from the warm server" in concurrent["log"]
    assert "forked from the warm server" not in served["log"] + fresh["log"]
    assert len({s["pid"] for s in concurrent["steps"].values()}) >= 3  # still a process per step


@pytest.fixture
def server(tmp_path):
    """A server for a fresh home and storage: (its environment, its log)."""
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "BATCHRL_STORAGE": str(tmp_path / "storage")}
    subprocess.run([BATCHRL, "serve", "--detach", "--idle", "120"], env=env, check=True, timeout=300)
    yield env, tmp_path / "home" / "logs" / "server.log"
    subprocess.run([BATCHRL, "serve", "--stop"], env=env, timeout=60)


def _logged(log, pattern: str, timeout: float = 30) -> bool:
    """The server logs a child's exit when it reaps it, which may be just after the client got the status."""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, log.read_text()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _served(log) -> int:
    return len(re.findall(r"` in process \d+", log.read_text()))


def test_exit_status_errors_and_other_environments(server, tmp_path):
    env, log = server
    bad = tmp_path / "bad.yaml"
    bad.write_text("ops:\n  no_such_asset: {config: {}}\n")
    done = subprocess.run([BATCHRL, "run", "-c", str(bad)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no_such_asset" in done.stderr, done.stdout + done.stderr
    assert _served(log) == 1
    assert _logged(log, r"exited 2")
    # audit with nothing materialised: its own error and status, through the server as well
    fresh = subprocess.run([BATCHRL, "audit", "raw_logs"], env={**env, "BATCHRL_SERVER": "off"}, capture_output=True,
                           text=True, timeout=120)
    served = subprocess.run([BATCHRL, "audit", "raw_logs"], env=env, capture_output=True, text=True, timeout=120)
    assert (served.returncode, served.stdout, served.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert _served(log) == 2  # BATCHRL_SERVER=off ran in its own process
    other = subprocess.run([BATCHRL, "stale"], env={**env, "BATCHRL_PROFILE": "real"}, capture_output=True,
                           text=True, timeout=120)
    assert _served(log) == 2, other.stderr  # another environment: not this server's command
    with socket.socket(socket.AF_UNIX) as broken:  # a request that is not one: ignored, the server goes on
        broken.connect(warm_client.socket_path(env, os.getcwd()))
        broken.sendall(b"not json\n")
        assert broken.recv(10) == b""
    assert warm_client.ping(env, os.getcwd())["served"] == 2
    stop = subprocess.run([BATCHRL, "serve", "--stop"], env=env, capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0 and warm_client.ping(env, os.getcwd()) is None
    assert not os.path.exists(warm_client.socket_path(env, os.getcwd()))
    again = subprocess.run([BATCHRL, "serve", "--stop"], env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "no server" in again.stdout


def test_ctrl_c_reaches_the_served_command(server):
    """The client forwards SIGINT to its fork: the run stops, the client exits with the fork's status."""
    env, log = server
    client = subprocess.Popen([BATCHRL, "run"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = client.stdout.readline()  # "batchrl run: N asset steps; ...": the run has started
    assert first.startswith("batchrl run:"), first
    client.send_signal(signal.SIGINT)
    rest = client.communicate(timeout=120)[0]
    assert client.returncode != 0, rest
    assert _logged(log, r"\(`batchrl run`\) exited [1-9]")
    assert "KeyboardInterrupt" in rest or "interrupt" in rest.lower()


def test_the_server_exits_when_idle_and_code_edits_get_another(tmp_path, monkeypatch):
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home")}
    # it exits on its own (a server that stayed would end in TimeoutExpired), saying why
    done = subprocess.run([sys.executable, "-m", "batchrl.cli", "serve", "--idle", "0.5"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "without a command, exiting" in done.stdout, done.stdout + done.stderr
    # the key: batchrl's files (an edited checkout is not served by a server of the old code) and the environment
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("x = 1\n")
    before = code_fingerprint(str(package))
    (package / "a.py").write_text("x = 22\n")
    assert code_fingerprint(str(package)) != before
    key = warm_client.server_key(env, str(tmp_path))
    assert warm_client.server_key({**env, "TERM": "other"}, str(tmp_path)) == key  # not read at import
    assert warm_client.server_key({**env, "BATCHRL_ENV": "gpu"}, str(tmp_path)) != key
    assert warm_client.server_key(env, str(package)) != key
    # and the installed packages: a package added to (or upgraded in) a site-packages folder
    site_packages = tmp_path / "site-packages"
    site_packages.mkdir()
    os.utime(site_packages, ns=(0, 0))  # an old folder: the install below changes its mtime, however coarse the clock
    monkeypatch.setattr("site.getsitepackages", lambda: [str(site_packages)])
    key = warm_client.server_key(env, str(tmp_path))
    assert warm_client.server_key(env, str(tmp_path)) == key
    (site_packages / "newpkg-1.0.dist-info").mkdir()
    assert warm_client.server_key(env, str(tmp_path)) != key
