"""A Ray cluster of two nodes on this machine for tests/test_ray_cluster.py: a head and a second node, each a
`ray start` of its own (own temp dir, raylet, object store), one CPU slot each, every process on 127.0.0.1.

Ray's gRPC servers listen on every interface whatever `--node-ip-address` says, so the tests run in a network
namespace of their own whose only interface is loopback (`unshare --net`, with a PID namespace so that no Ray
daemon outlives the tests): `bring_loopback_up` is the first thing done inside it.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

import psutil

# this interpreter's ray (a venv's), else the one on PATH (a bundle's, bench/bench_ray_overhead.py on the GPU host)
RAY = next((p for p in (os.path.join(os.path.dirname(sys.executable), "ray"), shutil.which("ray")) if p and
            os.path.exists(p)), "ray")
GCS_PORT, DASHBOARD_PORT = 6379, 8265
# node death noticed in ~3 s instead of Ray's default ~15 s (period 3 s x 5 failures)
FAST_FAILURE_DETECTION = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                          "health_check_timeout_ms": 1000}
NAMESPACES = ["--net", "--pid", "--fork", "--mount-proc"]
# unprivileged (a user namespace), or as root where user namespaces are off
NETNS_COMMANDS = (["unshare", "--user", "--map-root-user", *NAMESPACES], ["unshare", *NAMESPACES])


def namespaces_command() -> list[str] | None:
    """The first ``unshare`` command line that works here, or None."""
    for command in NETNS_COMMANDS:
        try:
            if subprocess.run([*command, "true"], capture_output=True, timeout=30).returncode == 0:
                return command
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


def bring_loopback_up() -> None:
    """``ip link set lo up`` without iproute2 (SIOCGIFFLAGS / SIOCSIFFLAGS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14s", b"lo", 0, b"\0" * 14)
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, request))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 0x1, b"\0" * 14))


def only_loopback() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def node_env() -> dict[str, str]:
    """The nodes' environment: this venv's python first on PATH (the job's entry point is `python -m ...`), no
    usage stats, one thread per process (two 1-CPU nodes on a 2-core box)."""
    venv_bin = os.path.dirname(sys.executable)
    return {**os.environ, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}", "RAY_USAGE_STATS_ENABLED": "0",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def start_node(head: bool, num_cpus: int = 1, env: dict[str, str] | None = None) -> str:
    """`ray start` one node (``num_cpus`` CPU slots; ``env``: its processes' environment, ``node_env()``'s by
    default) on 127.0.0.1 with a temp dir of its own (short: socket paths are limited to 107 bytes); that dir,
    which names the node's processes."""
    temp_dir = tempfile.mkdtemp(prefix="rayh-" if head else "rayn-", dir="/tmp")
    args = [RAY, "start", "--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus), "--temp-dir", temp_dir,
            "--disable-usage-stats", "--object-store-memory", str(200 * 2**20)]
    if head:
        args += ["--head", "--port", str(GCS_PORT), "--dashboard-host", "127.0.0.1",
                 "--dashboard-port", str(DASHBOARD_PORT), "--include-dashboard", "true",
                 "--system-config", json.dumps(FAST_FAILURE_DETECTION)]
    else:
        args += ["--address", f"127.0.0.1:{GCS_PORT}"]
    proc = subprocess.run(args, env=env or node_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return temp_dir


def node_processes(temp_dir: str) -> list[psutil.Process]:
    """The processes of the node started with ``temp_dir`` (its raylet, log monitor...) and all they started."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(temp_dir in part for part in proc.info["cmdline"] or []):
            found.append(proc)
            found.extend(proc.children(recursive=True))
    return found


def kill_node(temp_dir: str) -> int:
    """SIGKILL the whole node (as a machine lost): its raylet, workers and their children; how many processes."""
    procs = node_processes(temp_dir)
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return len(procs)


def job_processes(temp_dir: str, module: str) -> list[psutil.Process]:
    return [p for p in node_processes(temp_dir) if any(module in part for part in _cmdline(p))]


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def wait_for_nodes(count: int, timeout: float = 60.0) -> None:
    """Until the cluster has ``count`` alive nodes (``ray list nodes`` through the dashboard)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc = subprocess.run([RAY, "list", "nodes", "--address", f"http://127.0.0.1:{DASHBOARD_PORT}", "--filter",
                               "state=ALIVE", "--format", "json"], env=node_env(), capture_output=True, text=True)
        if proc.returncode == 0 and len(json.loads(proc.stdout or "[]")) == count:
            return
        time.sleep(1)
    raise TimeoutError(f"the cluster did not reach {count} alive nodes")


def listening_addresses() -> set[str]:
    """Local addresses every listening TCP socket of this (network) namespace is bound to."""
    return {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
