"""Multi-turn, tool-using rollouts (issue 35): the agent loop over the tiny model with forced tokens (the loop,
tokenizer, chat template, sandbox and log-probs are real; a 2.5M-parameter model cannot write code, so its tokens are
a script's), the loss mask, the sandbox's state per rollout, the limits, the Parquet round trip into a training batch."""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from helpers_agent import ForcedEngine, three_cells

from batchrl.schemas.trajectory import TrajectoryContractError, check_trajectories
from batchrl.training.agent import AgentConfig, AgentRollouts
from batchrl.training.agent.render import observation_text
from batchrl.training.agent.tools import ToolBox, find_tool_call
from batchrl.training.models.tiny import build_tiny_model

QUESTION = "What is 4821 * 937? Answer with a number."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("agent") / "model"
    build_tiny_model([QUESTION + " 4517277"] * 4, str(path), hidden_size=32, intermediate_size=64, num_layers=1)
    return str(path)


def rollouts(tiny, script, prompts=(QUESTION,), n=1, **agent):
    engine = ForcedEngine(tiny, script=script, max_new_tokens=160)
    loop = AgentRollouts(engine, AgentConfig(**{"tool_timeout_s": 2.0, **agent}))
    return loop.generate(list(prompts), n=n, seed=0), engine.tokenizer


def test_three_tool_turns_with_state_then_the_answer(tiny):
    (sample,), _ = rollouts(tiny, three_cells)
    roles = [t["role"] for t in sample["turns"]]
    assert roles == ["assistant", "user"] * 3 + ["assistant"]
    assert sample["tool_calls"] == 3 and sample["num_turns"] == 4 and sample["finish_reason"] == "stop"
    observations = [t for t in sample["turns"] if t["role"] == "user"]
    # y = x * 1 and print(y) need the earlier cells' x and y: state kept across the turns of one rollout
    assert [t["status"] for t in observations] == ["ok"] * 3 and [t["exit_code"] for t in observations] == [0] * 3
    assert observations[-1]["content"] == str(4821 * 937)
    assert sample["response"] == f"The answer is {4821 * 937}."
    assert [t["tool_input"] for t in sample["turns"][::2][:3]] == ["x = 4821 * 937\n", "y = x * 1\n", "print(y)\n"]
    check_trajectories([sample])


def test_loss_mask_covers_exactly_the_model_tokens(tiny):
    (sample,), tokenizer = rollouts(tiny, three_cells)
    ids, mask = sample["response_ids"], sample["loss_mask"]
    assert len(mask) == len(ids) == len(sample["rollout_logprobs"]) and 0 < sum(mask) < len(ids)
    runs, start = [], 0  # maximal runs of equal mask values, in order
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], tokenizer.decode(ids[start:i], skip_special_tokens=False)))
            start = i
    turns = sample["turns"]
    assert [m for m, _ in runs] == [1, 0] * 3 + [1]
    for (trained, text), turn in zip(runs, turns):
        if trained:  # the model's own text, as sampled
            assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == turn["content"]
        else:  # the whole observation block: end of the model's turn, the user turn, the next assistant header
            assert text == observation_text(tokenizer, turn["content"], "user")
            assert text.startswith("<|im_end|>\n<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    # observation tokens carry no log-prob (the model did not sample them), every model token one
    assert all(lp == 0.0 for lp, m in zip(sample["rollout_logprobs"], mask) if not m)
    assert all(lp < 0.0 for lp, m in zip(sample["rollout_logprobs"], mask) if m)


def counter_script(context: str) -> str:
    """Two cells that count in a global the sandbox should keep per rollout only."""
    cells = context[context.find("What is"):].count("```python")
    if cells < 2:
        return "```python\ntry:\n    counter += 1\nexcept NameError:\n    counter = 1\nprint(counter)\n```"
    return "done"


def test_state_persists_within_a_rollout_and_never_across(tiny):
    samples, _ = rollouts(tiny, counter_script, prompts=(QUESTION, "What is 1 + 2?"), n=3)
    for sample in samples:  # 1 then 2 in every rollout: a shared interpreter would count on past 2
        outputs = [t["content"] for t in sample["turns"] if t["role"] == "user"]
        assert outputs == ["1", "2"], (sample["prompt_index"], sample["sample_index"], outputs)
    box = ToolBox(AgentConfig(tool_timeout_s=2.0))
    first, second = box.new_state(), box.new_state()
    call = find_tool_call("```python\nsecret = 41\nopen('note.txt', 'w').write('hi')\n```", "python_block")
    assert box.run(call, first).status == "ok"
    again = box.run(find_tool_call("```python\nprint(secret + 1, open('note.txt').read())\n```", "python_block"), first)
    assert (again.status, again.output.strip()) == ("ok", "42 hi")
    for code, error in (("print(secret)", "NameError"), ("print(open('note.txt').read())", "FileNotFoundError")):
        other = box.run(find_tool_call(f"```python\n{code}\n```", "python_block"), second)
        assert other.status == "error" and other.exit_code == 1 and error in other.output


def always_calls(code: str):
    return lambda context: f"```python\n{code}\n```"


def test_a_hanging_tool_is_killed_and_the_rollout_goes_on(tiny):
    (sample,), _ = rollouts(tiny, always_calls("while True:\n    pass"), max_turns=2, tool_timeout_s=1.0)
    observation = sample["turns"][1]
    assert observation["status"] == "timeout" and observation["exit_code"] is None
    assert 1.0 <= observation["wall_s"] < 4.0 and "timed out after 1 s" in observation["content"]
    # the runaway loop ends at the turn budget: the last turn's call is not run
    assert sample["finish_reason"] == "max_turns" and sample["num_turns"] == 2
    assert sample["tool_calls"] == 1 and sample["unrun_tool_calls"] == 1
    check_trajectories([sample])


def test_a_flooding_tool_is_cut_and_its_observation_truncated(tiny):
    (sample,), _ = rollouts(tiny, always_calls("while True:\n    print('x' * 1000)"), max_turns=2,
                            tool_output_bytes=4096, max_observation_chars=200)
    observation = sample["turns"][1]
    assert observation["status"] == "output_limit" and observation["exit_code"] == -9
    assert observation["truncated"] and len(observation["content"]) <= 200
    assert "characters cut" in observation["content"]
    assert observation["wall_s"] < 1.5  # cut at the cap, not at the 2 s timeout


def test_a_memory_bomb_hits_the_per_call_limit_and_later_cells_still_run(tiny):
    bomb = "```python\nblob = bytearray(400 * 2**20)\n```"
    script = lambda context: bomb if "```python\nblob" not in context else "```python\nprint('still here')\n```"
    (sample,), _ = rollouts(tiny, script, max_turns=3, tool_memory_mb=128)
    first, second = (t for t in sample["turns"] if t["role"] == "user")
    assert first["status"] == "error" and "MemoryError" in first["content"]
    assert (second["status"], second["content"]) == ("ok", "still here")  # the failed cell replays harmlessly


def test_the_token_budget_ends_a_rollout_with_length(tiny):
    (sample,), _ = rollouts(tiny, always_calls("print(1)"), max_turns=10, max_total_tokens=60)
    assert sample["finish_reason"] == "length" and len(sample["response_ids"]) <= 60
    check_trajectories([sample])


def lookup(arguments: dict, state: dict) -> str:
    """A user tool (agent.tools: {lookup: helpers-free module:function}) that counts its calls per rollout."""
    state["calls"] = state.get("calls", 0) + 1
    if arguments.get("key") == "boom":
        raise KeyError("boom")
    return f"{arguments['key']}={len(arguments['key'])} (call {state['calls']})"


def json_calls(context: str) -> str:
    plan = ['<tool_call>{"name": "lookup", "arguments": {"key": "abc"}}</tool_call>',
            '<tool_call>{"name": "lookup", "arguments": {"key": "boom"}}</tool_call>',
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "<tool_call>{not json</tool_call>",
            '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>', "42"]
    return plan[context.count("<tool_call>") - 1]  # the system turn shows the format once


def test_tool_call_json_user_tools_and_failures_become_observations(tiny):
    (sample,), _ = rollouts(tiny, json_calls, tool_format="tool_call_json", max_turns=6, observation_role="tool",
                            max_total_tokens=1024,
                            tools={"lookup": "test_agent_loop:lookup"})
    observations = [(t["status"], t["content"]) for t in sample["turns"] if t["role"] == "tool"]
    assert observations[0] == ("ok", "abc=3 (call 1)")
    assert observations[1][0] == "error" and "KeyError" in observations[1][1]
    assert observations[2][0] == "unknown_tool" and "'nope'" in observations[2][1]
    assert observations[3][0] == "invalid"
    assert observations[4] == ("ok", "42")
    assert sample["response"] == "42" and sample["finish_reason"] == "stop" and sample["tool_errors"] == 3


def test_config_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="tool_call_json"):
        AgentConfig(tools={"lookup": "test_agent_loop:lookup"})
    with pytest.raises(ValueError, match="built-in"):
        AgentConfig(tool_format="tool_call_json", tools={"python": "m:f"})
    with pytest.raises(ValueError, match="max_turns"):
        AgentConfig(max_turns=0)


def test_trajectories_round_trip_through_parquet_into_a_training_batch(tiny, tmp_path, monkeypatch):
    from batchrl.training.rl.advantages import compute_advantages
    from batchrl.training.rewards.registry import RewardConfig, compute_rewards
    from batchrl.training.rollout import ROLLOUT_ENGINES
    from batchrl.training.rollout.sampling_job import sample_to_parquet
    from batchrl.training.trainer.policy import _row_batch, load_batch

    monkeypatch.setitem(ROLLOUT_ENGINES, "forced", ForcedEngine)
    out = tmp_path / "rollouts.parquet"
    stats = sample_to_parquet({"kind": "forced", "model_path": tiny, "max_new_tokens": 64},
                              [QUESTION, "What is the sum of 1200, 3400, 5600? Answer with a number."], n=2, seed=0,
                              out_parquet=str(out), agent={"tool_timeout_s": 2.0})
    assert stats["mean_tool_calls"] == 3.0 and 0.0 < stats["tool_share"] < 1.0 and stats["finish/stop"] == 1.0
    # the forced turns end with an end-of-turn token after each call: generated, cut off, not kept
    assert 0.9 < stats["kept_token_share"] < 1.0 and stats["engine_tokens_per_s"] > stats["model_tokens_per_s"]
    table = pd.read_parquet(out)
    assert check_trajectories(table.to_dict("records"), str(out)) == 4
    assert list(table["turns"][0][-1].keys())[:3] == ["role", "content", "tokens"]
    scored = compute_rewards(table.assign(answer=["4517277"] * 2 + ["10200"] * 2), RewardConfig(rule="final_answer"))
    assert scored["reward"].tolist() == [1.0] * 4
    scored.loc[1, "reward"] = 0.0  # a group with a spread, so GRPO's advantages are not all zero
    batch = compute_advantages(scored, "grpo")
    for adv, mask in zip(batch["advantages"], batch["loss_mask"]):  # a value per response token, 0 on observations
        assert len(adv) == len(mask) and all((a == 0.0) for a, m in zip(adv, mask) if not m)
    assert any(a != 0.0 for a, m in zip(batch["advantages"][0], batch["loss_mask"][0]) if m)
    batch.to_parquet(tmp_path / "batch.parquet")
    rows = load_batch(str(tmp_path / "batch.parquet"))
    padded = _row_batch(rows, [0, 2], 0, torch.device("cpu"))
    for j, i in enumerate([0, 2]):  # the policy loss's mask: the model's tokens only
        n = len(rows["response_ids"][i])
        assert padded["response_mask"][j, :n].tolist() == [float(m) for m in rows["loss_mask"][i]]
    bad = table.to_dict("records")
    bad[1]["loss_mask"] = list(bad[1]["loss_mask"])[:-1]
    with pytest.raises(TrajectoryContractError, match=r"rollouts.parquet: row 1, field loss_mask"):
        check_trajectories(bad, str(out))


def test_evaluation_reports_accuracy_with_and_without_tools(tiny):
    from batchrl.training.agent.evaluate import tool_metrics

    rows = [{"prompt": QUESTION, "answer": "4517277", "category": "mul"},
            {"prompt": "What is the sum of 1200, 3400, 5600? Answer with a number.", "answer": "10200",
             "category": "sum"}]
    engine = ForcedEngine(tiny, script=three_cells, max_new_tokens=160, temperature=0.0)
    metrics = tool_metrics(engine, rows, {"tool_timeout_s": 2.0})
    # with tools the answer is read off the sandbox; without, the script's first turn (unrun code) is the answer
    assert metrics["tool_accuracy"] == 1.0 and metrics["tool_accuracy/sum"] == 1.0
    assert metrics["no_tool_accuracy"] == 0.0 and metrics["mean_tool_calls"] == 3.0 and metrics["mean_turns"] == 4.0


def test_the_static_cache_engine_drives_the_same_turns(tiny):
    """The loop over the static-cache engine (eager on the CPU, CUDA graphs on a GPU; padded chunks of batch_size):
    the same greedy turns as over the transformers engine, and each engine's own token cap put back."""
    from batchrl.training.rollout import make_rollout_engine

    prompts = [QUESTION, "What is the sum of 1200, 3400? Answer with a number."]
    outs = []
    for kind in ("transformers", "static"):
        engine = make_rollout_engine(kind, model_path=tiny, max_new_tokens=24, temperature=0.0, batch_size=4)
        outs.append(AgentRollouts(engine, AgentConfig(max_total_tokens=40)).generate(prompts, n=2, seed=0))
        assert engine.max_new_tokens == 24  # the loop's per-turn cap is put back
    assert [s["response_ids"] for s in outs[0]] == [s["response_ids"] for s in outs[1]]
    check_trajectories(outs[1])
