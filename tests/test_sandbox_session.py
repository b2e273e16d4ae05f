"""The python tool's persistent interpreter: the same observations as the replay it replaces on the tool task, one
interpreter per trajectory (reused between its calls, gone with it), and no model code at a weak level without the
explicit opt-in."""
import glob
import json
import os
import time

import pytest
from helpers_agent import _expression

from batchrl.common.run_config_error import RunConfigError
from batchrl.training import sandbox
from batchrl.training.agent.config import AgentConfig
from batchrl.training.agent.tools import PersistentSession, ReplaySession, ToolBox, find_tool_call

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = sandbox.SandboxLimits(timeout_s=1.0, memory_mb=256, max_output_bytes=2048)
# what a model writes on the tool task, right and wrong: state across cells, an echoed expression, errors, exits,
# stdin at its end, then a cell that needs the state after each
CELLS = ["x = {expr}\n", "y = x * 1\n", "print(y)\n", "y\n", "print(z)\n", "def f(:\n", "import sys; sys.exit(2)\n",
         "raise SystemExit('bye')\n", "input()\n", "print(x + 1, y == x)\n"]
FAULTS = ["while True:\n    pass\n", "while True:\n    print('x' * 500)\n", "print(x - 1)\n"]  # a hang, a flood, after


def _tool_prompts(count: int) -> list[str]:
    with open(os.path.join(ROOT, "sample_data", "tools", "train.jsonl")) as f:
        return [json.loads(line)["prompt"] for line, _ in zip(f, range(count))]


def _observations(session, cells: list[str]) -> list[tuple]:
    try:
        return [(r.output, r.exit_code, r.status) for r in map(session.run, cells)]
    finally:
        session.close()


@pytest.mark.parametrize("index", range(3))
def test_persistent_and_replay_give_the_same_observations_on_the_tool_task(index):
    level = sandbox.isolation_level()
    prompt = _tool_prompts(3)[index]
    cells = [cell.format(expr=_expression(prompt)) for cell in CELLS] + (FAULTS if index == 0 else [])
    persistent = _observations(PersistentSession(LIMITS, level), cells)
    replay = _observations(ReplaySession(LIMITS, level), cells)
    assert persistent == replay
    statuses = [status for _, _, status in persistent]
    assert statuses[:4] == ["ok"] * 4 and statuses[4:9] == ["error"] * 5 and statuses[9] == "ok"
    if index == 0:
        assert statuses[10:] == ["timeout", "output_limit", "ok"]


def test_one_interpreter_per_trajectory_reused_between_calls_and_gone_with_it():
    box = ToolBox(AgentConfig(tool_timeout_s=2.0))
    state = box.new_state()
    call = find_tool_call("```python\nimport os\nprint(os.getpid())\n```", "python_block")
    assert box.run(call, state).status == "ok"
    session = state["python"].box
    pid, scratch = session.proc.pid, session.scratch
    box.run(call, state)
    assert session.proc.pid == pid  # the same interpreter: no new sandbox, no replay
    box.close_state(state)
    assert session.proc is None and not os.path.exists(scratch) and not os.path.exists(f"/proc/{pid}/cmdline")
    assert box.sandbox["level"] == sandbox.isolation_level() and "seccomp" in box.sandbox


def test_tool_rollouts_refuse_a_weak_sandbox_unless_allowed(monkeypatch):
    from batchrl.assets.run_rules import check_run_config

    monkeypatch.setattr(sandbox, "isolation_level", lambda: "rlimits")
    with pytest.raises(RuntimeError, match="not a boundary") as refused:
        ToolBox(AgentConfig())
    assert "\n" not in str(refused.value) and "allow_weak_sandbox" in str(refused.value)
    assert ToolBox(AgentConfig(allow_weak_sandbox=True)).level == "rlimits"
    run_config = {"ops": {"rollouts": {"config": {"agent": {"max_turns": 2}}}}}
    with pytest.raises(RunConfigError, match=r"ops.rollouts.config.agent: the sandbox here is 'rlimits'"):
        check_run_config(run_config, ["rollouts"])
    run_config["ops"]["rollouts"]["config"]["agent"]["allow_weak_sandbox"] = True
    check_run_config(run_config, ["rollouts"])
    check_run_config({"ops": {"evaluation": {"config": {}}}}, ["evaluation"])  # no tools: nothing to refuse


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(entry, "rb") as f:
                if text.encode() in f.read():
                    found.append(int(entry.split("/")[2]))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("level", [lv for lv in sandbox.BOUNDARIES if sandbox.available(lv)])
def test_a_hung_cell_takes_its_whole_sandbox_down(level):
    """The interpreter of a cell killed at the wall clock is gone with it (not at its CPU limit, a minute later), and
    so is every process of its sandbox, the namespace's init included, though the cell left the process group."""
    from batchrl.training.sandbox.session import PythonSandbox

    box = PythonSandbox(level, sandbox.SandboxLimits(timeout_s=1.0, cpu_s=60.0))
    assert box.run("x = 1", "<cell 1>").returncode == 0
    scratch = box.scratch
    assert _processes_mentioning(scratch), "the interpreter is not running between calls"
    result = box.run("import os\nos.setsid()\nwhile True:\n    pass", "<cell 2>")
    assert result.timed_out and box.proc is None
    deadline = time.monotonic() + 3  # SIGKILLed processes of a namespace take a moment to be gone on a loaded box
    while _processes_mentioning(scratch) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_mentioning(scratch) == []
    box.close()
