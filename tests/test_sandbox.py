"""Code-execution reward and its sandbox: passing code scores, escape attempts score 0 and leave nothing."""
import glob
import json
import os
import socket
import tempfile
import threading
import time

import pytest

from batchrl.training import sandbox
from batchrl.training.rewards.code_tests import code_pass_fraction, extract_code
from batchrl.training.rewards.registry import REWARD_FUNCTIONS, compute_rewards

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
GOOD = "Here is the function:\n```python\ndef add(a, b):\n    return a + b\n```\n"
FAST = sandbox.SandboxLimits(timeout_s=2.0, memory_mb=256)
ESCAPE = sandbox.SandboxLimits(timeout_s=1.0, memory_mb=256)  # the loops only need to outlive it

# bwrap and namespaces are the boundaries (training/sandbox/levels.py; bubblewrap is installed by scripts/bootstrap.sh
# when run as root, as CI does); rlimits is not one (tool rollouts refuse it without allow_weak_sandbox) and must
# hold the same line on these cases all the same.
LEVELS = ["bwrap", "namespaces", "rlimits"]


@pytest.fixture(params=LEVELS)
def level(request, monkeypatch):
    if not sandbox.available(request.param):
        pytest.fail(f"sandbox level {request.param} unavailable: install bubblewrap (apt-get install bubblewrap)"
                    if request.param == "bwrap" else f"{request.param} unavailable on this machine")
    monkeypatch.setenv("BATCHRL_SANDBOX", request.param)
    return request.param


def _record_scratch_dirs(monkeypatch) -> list[str]:
    """The scratch directories the sandbox makes in this process from now on (this test's own: another xdist
    worker's sandboxes, e.g. the agent tests', make theirs in the same temp folder at the same time)."""
    made, make = [], tempfile.mkdtemp

    def recording(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", recording)
    return made


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
    except (OSError, StopIteration):
        return 0


def _ours(pid: int) -> bool:
    """A process this test process started, or an orphan (what escapes by outliving its parent becomes), not one
    of another xdist worker's sandboxes (e.g. the agent tests'): those descend from a sibling of this process,
    reached through the parent that started both before reaching this one."""
    while pid > 1:
        pid = _parent(pid)
        if pid == os.getpid():
            return True
        if pid == os.getppid():
            return False
    return True


def _sandboxed_processes() -> set[int]:
    """PIDs of sandboxed interpreters (their command line is the sandbox's) still alive, this test's own."""
    pids = set()
    for entry in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(entry, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[1:5] == [b"-I", b"-S", b"-B", b"boot.py"]:
            pids.add(int(entry.split("/")[2]))
    return {pid for pid in pids if _ours(pid)}


def test_extract_code_prefers_the_last_python_block():
    text = "```\nplain\n```\nthen\n```python\nfirst\n```\n```py\nsecond\n```"
    assert extract_code(text) == "second\n"
    assert extract_code("```\nonly plain\n```") == "only plain\n"
    assert extract_code("def f(): pass") == "def f(): pass"


def test_pass_fraction_asserts_and_stdio(level):
    assert code_pass_fraction(extract_code(GOOD), ADD_TESTS, FAST) == 1.0
    off_by_one = "def add(a, b):\n    return a + b + (a == 2)"
    assert code_pass_fraction(off_by_one, ADD_TESTS, FAST) == pytest.approx(2 / 3)
    doubler = "n = int(input())\nprint(n * 2)"
    io = {"inputs": ["2\n", "5\n", "7\n"], "outputs": ["4\n", "10", "15\n"]}
    assert code_pass_fraction(doubler, io, FAST) == pytest.approx(2 / 3)
    assert code_pass_fraction(doubler, json.dumps(io), FAST) == pytest.approx(2 / 3)
    assert code_pass_fraction("", ADD_TESTS, FAST) == 0.0
    assert code_pass_fraction(GOOD, [], FAST) == 0.0


def test_early_exit_does_not_pass(level):
    for cheat in ("import sys\nsys.exit(0)", "import os\nos._exit(0)"):
        assert code_pass_fraction(cheat, ADD_TESTS, FAST) == 0.0


ESCAPES = {
    "read_outside": "def add(a, b):\n    return a + b\nprint(open('{secret}').read())\n",
    "list_outside": "import os\ndef add(a, b):\n    return a + b\nos.listdir('{secret_dir}')\n",
    "write_outside": "def add(a, b):\n    return a + b\nopen('{marker}', 'w').write('escaped')\n",
    "open_socket": ("import socket\ndef add(a, b):\n    return a + b\n"
                    "socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'escaped')\n"),
    "infinite_loop": "def add(a, b):\n    return a + b\nwhile True:\n    pass\n",
    "sleep_in_child_then_loop": ("import os, time\ndef add(a, b):\n    return a + b\n"
                                 "if os.fork() == 0:\n    time.sleep(30)\n    open('{marker}', 'w').write('late')\n"
                                 "while True:\n    pass\n"),
    "memory_bomb": "def add(a, b):\n    return a + b\nx = bytearray(4 * 1024 ** 3)\n",
}


@pytest.mark.parametrize("attempt", sorted(ESCAPES))
def test_escape_attempts_score_zero_and_leave_nothing(level, attempt, tmp_path, monkeypatch):
    monkeypatch.setattr("batchrl.training.rewards.code_tests.LIMITS", ESCAPE)
    secret_dir = tmp_path / "host"
    secret_dir.mkdir()
    (secret_dir / "secret.txt").write_text("host secret")
    marker = tmp_path / "escaped.txt"
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    connections, done = [], threading.Event()

    def accept():
        while not done.is_set():
            try:
                connections.append(server.accept()[0].recv(64))
            except OSError:
                pass

    listener = threading.Thread(target=accept)
    listener.start()
    scratch_dirs = _record_scratch_dirs(monkeypatch)
    code = ESCAPES[attempt].format(secret=secret_dir / "secret.txt", secret_dir=secret_dir, marker=marker,
                                   port=server.getsockname()[1])
    runs, run_python = [], sandbox.run_python
    monkeypatch.setattr(sandbox, "run_python", lambda *a, **k: runs.append(run_python(*a, **k)) or runs[-1])
    response = f"```python\n{code}```"
    score = REWARD_FUNCTIONS["code_exec"]("write add", response, {"tests": ADD_TESTS})
    done.set()
    listener.join()
    server.close()
    assert score == 0.0
    assert len(runs) == len(ADD_TESTS)  # a sandbox per test case
    if attempt == "infinite_loop":  # code that never ends is killed at the timeout, in each case
        assert all(run.timed_out and run.returncode is None for run in runs), runs
    assert connections == [], "the sandboxed code reached a host socket"
    assert not marker.exists()
    assert len(scratch_dirs) == len(ADD_TESTS)  # one scratch directory per sandbox
    assert not [d for d in scratch_dirs if os.path.exists(d)], "a scratch directory was left behind"
    deadline = time.monotonic() + 5  # a SIGKILLed process on a loaded box may take a moment to be gone
    while _sandboxed_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _sandboxed_processes(), "a sandboxed process outlived its run"


def test_stdout_leak_of_secret_is_impossible(level, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    result = sandbox.run_python(f"print(open({str(secret)!r}).read())", limits=FAST)
    assert "host secret" not in result.stdout and result.returncode != 0


def test_code_reward_through_compute_rewards():
    rows = [{"prompt": "add", "response": GOOD, "tests": ADD_TESTS},
            {"prompt": "add", "response": "```python\ndef add(a, b):\n    return a * b\n```", "tests": ADD_TESTS},
            {"prompt": "chat", "response": "hello", "tests": None}]
    from batchrl.training.rewards.registry import RewardConfig

    out = compute_rewards(rows, RewardConfig(rule="code_exec"))
    assert out["reward"].tolist() == pytest.approx([1.0, 1 / 3, 0.0])


def test_isolation_level_prefers_bwrap_and_honours_override(monkeypatch):
    monkeypatch.delenv("BATCHRL_SANDBOX", raising=False)
    assert sandbox.isolation_level() == "bwrap"  # the strongest level wins when it works
    monkeypatch.setenv("BATCHRL_SANDBOX", "nonsense")
    with pytest.raises(RuntimeError, match="BATCHRL_SANDBOX"):
        sandbox.isolation_level()


def test_an_output_flood_is_killed_at_the_cap_not_read_until_the_timeout(level):
    limits = sandbox.SandboxLimits(timeout_s=5.0, max_output_bytes=4096)
    flood = sandbox.run_python("import sys\nwhile True:\n    sys.stderr.write('e' * 100)\n    print('x' * 100)",
                               limits=limits, isolation=level)
    assert flood.output_truncated and not flood.timed_out and flood.returncode == -9
    assert len(flood.stdout) <= 4096 and len(flood.stderr) <= 4096 and flood.wall_s < 2.0
    quiet = sandbox.run_python("print('x' * 4000)", limits=limits, isolation=level)
    assert not quiet.output_truncated and quiet.returncode == 0 and len(quiet.stdout) == 4001
