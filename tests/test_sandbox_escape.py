"""The escape suite: model-style code tries to get out of the sandbox at every level this machine has; every attempt
fails, its observation says why, and the host and this test run are unharmed.

Levels: each available one of ``sandbox.LEVELS`` with every wall it has here, and the two boundaries with their
second walls switched off (``-bare``: no Landlock, no seccomp), which shows the namespaces hold on their own (a
kernel without Landlock, a host without libseccomp). Runners: ``session`` (the python tool's persistent interpreter)
and ``once`` (``run_python``, the code reward's). The fork bomb runs only where seccomp refuses new processes (a
root-owned sandbox is not held by RLIMIT_NPROC: a bare run would bomb the shared box until the wall clock).
"""
import os
import signal
import socket
import subprocess
import tempfile
import threading

import pytest

from batchrl.training import sandbox
from batchrl.training.sandbox import levels, seccomp_filter
from batchrl.training.sandbox.session import PythonSandbox

LIMITS = sandbox.SandboxLimits(timeout_s=1.5, memory_mb=256, max_output_bytes=4096)
DENIED = ("PermissionError", "Permission denied", "Operation not permitted", "FileNotFoundError", "No such file",
          "ProcessLookupError", "Read-only file system", "sandbox:")
SECRETS = ("STORAGE-SECRET", "DAGSTER-SECRET", "ENV-SECRET", "SSH-SECRET")

# attempt -> (code, substrings of which the observation must contain one: why it failed)
ATTEMPTS = {
    "read_storage_root": ("print(open({storage!r} + '/artifact.txt').read())", DENIED),
    "list_storage_root": ("import os; print(os.listdir({storage!r}))", DENIED + ("\n[]\n",)),  # [] the tmpfs
    "read_dagster_home": ("print(open({dagster!r} + '/runs.db').read())", DENIED),
    "read_env_secret": ("import os; print(os.environ['BATCHRL_ESCAPE_SECRET'])", ("KeyError",)),
    "read_parent_environ": ("print(open('/proc/{parent}/environ', 'rb').read())", DENIED),
    "read_ssh_key": ("print(open({home!r} + '/.ssh/id_ed25519').read())", DENIED),
    "write_outside_scratch": ("open({outside!r} + '/pwned.txt', 'w').write('escaped')", DENIED),
    "write_into_storage_root": ("open({storage!r} + '/pwned.txt', 'w').write('escaped')", DENIED),
    "socket_outside": ("import socket; socket.create_connection(('192.0.2.1', 80), timeout=1)",
                       ("Operation not permitted", "unreachable", "sandbox:", "Permission denied")),
    "socket_loopback": ("import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'x')",
                        ("Operation not permitted", "Connection refused", "sandbox:", "Permission denied",
                         "unreachable")),
    "signal_other_process": ("import os, signal; os.kill({victim}, signal.SIGKILL)", DENIED),
    "ptrace_other_process": ("import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
                             "r = libc.ptrace(16, {victim}, 0, 0)\n"
                             "raise SystemExit(f'ptrace {{r}} errno {{ctypes.get_errno()}}') if r else None",
                             ("ptrace -1 errno", "sandbox:")),
    "mount_over_a_path": ("import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
                          "r = libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)\n"
                          "raise SystemExit(f'mount {{r}} errno {{ctypes.get_errno()}}')",
                          ("mount -1 errno", "sandbox:")),  # no capability left, even in its own namespaces
    "exec_a_shell": ("import os; os.execv('/bin/sh', ['sh', '-c', 'echo escaped > {outside}/pwned.txt'])",
                     DENIED + ("Directory nonexistent",)),  # bare bwrap: the shell runs, the host path is not there
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", DENIED),
    "allocate_10_gb": ("x = bytearray(10 * 2**30)", ("MemoryError",)),
    "endless_output": ("while True:\n    print('x' * 1000)", ("[output_limit]",)),
    "sleep_past_the_wall": ("import time; time.sleep(30)", ("[timeout]",)),
}


def _variants():
    out = [level for level in sandbox.LEVELS if sandbox.available(level)]
    return out + [f"{level}-bare" for level in sandbox.BOUNDARIES if level in out]


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """Secrets where a trainer keeps them (outside /tmp, which a sandbox hides anyway), a victim process, a listening
    socket that counts connections."""
    base = tempfile.mkdtemp(prefix="batchrl-escape-", dir="/var/tmp")
    paths = {name: os.path.join(base, name) for name in ("storage", "dagster", "home", "outside")}
    for path in paths.values():
        os.makedirs(path)
    os.makedirs(os.path.join(paths["home"], ".ssh"))
    for rel, secret in (("storage/artifact.txt", "STORAGE-SECRET"), ("dagster/runs.db", "DAGSTER-SECRET"),
                        ("home/.ssh/id_ed25519", "SSH-SECRET")):
        with open(os.path.join(base, rel), "w") as f:
            f.write(secret)
    victim = subprocess.Popen(["sleep", "300"])
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    received, done = [], threading.Event()

    def accept():
        while not done.is_set():
            try:
                received.append(server.accept()[0].recv(64))
            except OSError:
                pass

    listener = threading.Thread(target=accept, daemon=True)
    listener.start()
    yield {**paths, "base": base, "victim": victim, "port": server.getsockname()[1], "received": received}
    done.set()
    listener.join()
    server.close()
    victim.kill()
    victim.wait()
    subprocess.run(["rm", "-rf", base], check=False)


def _observation(result: sandbox.SandboxResult) -> str:
    tag = "[timeout]" if result.timed_out else "[output_limit]" if result.output_truncated else ""
    return f"{tag} exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"


def _run(runner: str, level: str, code: str) -> sandbox.SandboxResult:
    if runner == "once":
        return sandbox.run_python(code, limits=LIMITS, isolation=level)
    box = PythonSandbox(level, LIMITS)
    try:
        box.run("warm = 1", "<cell 1>")  # the attempt runs in a live interpreter, as a trajectory's second call
        return box.run(code, "<cell 2>")
    finally:
        box.close()
        assert box.proc is None and box.scratch is None


@pytest.mark.parametrize("runner", ["session", "once"])
@pytest.mark.parametrize("variant", _variants())
@pytest.mark.parametrize("attempt", sorted(ATTEMPTS))
def test_escape_attempt_fails_and_says_why(attempt, variant, runner, host, monkeypatch):
    level, bare = variant.removesuffix("-bare"), variant.endswith("-bare")
    if bare:
        monkeypatch.setattr(levels, "landlock_abi", lambda: 0)
        monkeypatch.setattr(seccomp_filter, "unavailable_reason", lambda: "switched off by the escape suite")
    if attempt == "fork_bomb" and (bare or seccomp_filter.unavailable_reason()):
        pytest.skip("no seccomp filter: a root-owned fork bomb is held only by the wall clock")
    monkeypatch.setenv("BATCHRL_STORAGE", host["storage"])
    monkeypatch.setenv("DAGSTER_HOME", host["dagster"])
    monkeypatch.setenv("HOME", host["home"])
    monkeypatch.setenv("BATCHRL_ESCAPE_SECRET", "ENV-SECRET")
    code, reasons = ATTEMPTS[attempt]
    paths = {key: host[key] for key in ("storage", "dagster", "home", "outside")}
    code = code.format(parent=os.getpid(), victim=host["victim"].pid, port=host["port"], **paths)
    seen = _observation(_run(runner, level, code))
    assert any(reason in seen for reason in reasons), seen
    assert not any(secret in seen for secret in SECRETS), seen
    # the host is unharmed: no file written outside, the secrets intact, the victim alive and not traced, no
    # connection reached the loopback server, and this process is still here to check it
    assert os.listdir(host["outside"]) == [] and not os.path.exists(os.path.join(host["storage"], "pwned.txt"))
    with open(os.path.join(host["storage"], "artifact.txt")) as f:
        assert f.read() == "STORAGE-SECRET"
    assert host["victim"].poll() is None
    with open(f"/proc/{host['victim'].pid}/status") as f:
        assert "TracerPid:\t0" in f.read()
    assert host["received"] == []


def test_the_levels_metadata_names_every_piece():
    pieces = sandbox.describe(sandbox.isolation_level(), LIMITS)
    assert pieces["level"] in sandbox.LEVELS and pieces["boundary"] == sandbox.is_boundary(pieces["level"])
    for key in ("namespaces", "landlock", "seccomp", "rlimits", "scratch", "environment"):
        assert pieces[key], key


def test_a_weak_level_is_refused_in_one_line_unless_allowed():
    line = sandbox.weak_level_refusal("rlimits", False, "agent")
    assert "rlimits" in line and "not a boundary" in line and "allow_weak_sandbox" in line and "\n" not in line
    assert sandbox.weak_level_refusal("rlimits", True, "agent") is None
    assert all(sandbox.weak_level_refusal(level, False, "agent") is None for level in sandbox.BOUNDARIES)


def test_a_configured_bwrap_with_a_wrong_sha256_is_refused(tmp_path, monkeypatch):
    binary = tmp_path / "bwrap"
    binary.write_bytes(b"#!/bin/sh\n")
    binary.chmod(0o755)
    (tmp_path / "bwrap.sha256").write_text("0" * 64 + "  bwrap\n")
    monkeypatch.setenv("BATCHRL_BWRAP", str(binary))
    found, why = levels.bwrap_binary()
    assert found is None and "differs" in why


def test_a_configured_bwrap_copy_is_found_checked_and_used_without_one_on_path(tmp_path, monkeypatch):
    """The GPU bundle's way (bench/sandbox_bundle.py): Debian's binary copied with its sha256, named by
    BATCHRL_BWRAP."""
    import hashlib
    import shutil

    copy = tmp_path / "bwrap"
    shutil.copy2(shutil.which("bwrap") or pytest.skip("no bwrap here to copy"), copy)
    (tmp_path / "bwrap.sha256").write_text(hashlib.sha256(copy.read_bytes()).hexdigest() + "  bwrap\n")
    monkeypatch.setenv("BATCHRL_BWRAP", str(copy))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    found, why = levels.bwrap_binary()
    assert found == str(copy) and "checked" in why
    result = sandbox.run_python("print('inside')", limits=LIMITS, isolation="bwrap")
    assert (result.returncode, result.stdout) == (0, "inside\n")
