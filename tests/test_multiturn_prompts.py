"""Multi-turn RL prompts: a prompt set's chat (verl / OpenRLHF style) is kept as messages, refused at validation
when it cannot be a prompt, rendered whole by every rollout engine, and carried with the exact token ids sampled
from into the rollouts and the policy update's batch."""
from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrl.training.data.prompts import PromptFileError, load_prompts
from batchrl.training.rollout import make_rollout_engine
from batchrl.training.models.loading import load_tokenizer

CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 5?"}]
CHAT_TEXT = "system: Answer with a number.\nuser: What is 2 + 2?\nassistant: 4\nuser: And 3 + 5?"
VERL = {"reward_model.ground_truth": "answer"}


def _verl_parquet(path, prompts: list[list[dict]]) -> str:
    rows = [{"data_source": "openai/gsm8k", "prompt": prompt, "reward_model": {"style": "rule", "ground_truth": str(i)}}
            for i, prompt in enumerate(prompts)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _chat_template_ids(tok, messages: list[dict]) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])


def test_a_verl_chat_prompt_loads_with_its_messages(tmp_path):
    single = [{"role": "user", "content": "What is 1 + 1?"}]
    table = load_prompts(_verl_parquet(tmp_path / "train.parquet", [CHAT, single]), mapping=VERL)
    assert table["prompt"].tolist() == [CHAT_TEXT, "What is 1 + 1?"]
    assert json.loads(table["prompt_messages"][0]) == CHAT
    assert table["prompt_messages"][1] is None  # one user message stays a plain prompt
    assert table["answer"].tolist() == ["0", "1"]
    plain = load_prompts(_verl_parquet(tmp_path / "single.parquet", [single]), mapping=VERL)
    assert "prompt_messages" not in plain.columns  # a set without chats has the table of before


@pytest.mark.parametrize("prompt,field", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
     r"field 'prompt\[1\].role' is 'assistant'"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], r"field 'prompt\[0\].content' must be a string"),
    ([{"role": "tool", "content": "42"}, {"role": "user", "content": "and?"}], r"field 'prompt\[0\].role' must be one of"),
    (["user: hi"], r"field 'prompt\[0\]' must be a \{role, content\} message"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "  "}],
     r"field 'prompt\[1\].content' is empty"),
    ([], "field 'prompt' is an empty chat"),
])
def test_a_chat_that_cannot_be_a_prompt_is_refused_with_file_line_and_field(tmp_path, prompt, field):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": prompt}) + "\n")
    with pytest.raises(PromptFileError, match=rf"prompts.jsonl:2: {field}"):
        load_prompts(str(path))


def test_a_parquet_chat_ending_with_the_assistant_is_refused_with_its_row(tmp_path):
    ends_with_answer = CHAT + [{"role": "assistant", "content": "8"}]
    path = _verl_parquet(tmp_path / "train.parquet", [CHAT, ends_with_answer])
    with pytest.raises(PromptFileError, match=r"train.parquet: row 2: field 'prompt\[4\].role' is 'assistant'"):
        load_prompts(path, mapping=VERL)


def test_prompt_ids_differ_by_the_earlier_turns(tmp_path):
    other_context = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"},
                     CHAT[-1]]
    last_turn_only = [CHAT[-1]]
    table = load_prompts(_verl_parquet(tmp_path / "train.parquet", [CHAT, other_context, last_turn_only]), mapping=VERL)
    assert table["prompt_id"].nunique() == 3
    # a plain prompt that reads like the chat's rendering is another prompt than the chat
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"prompt": CHAT_TEXT}) + "\n" + json.dumps({"prompt": CHAT[-1]["content"]}) + "\n")
    plain = load_prompts(str(path))
    assert plain["prompt_id"][0] != table["prompt_id"][0]
    assert plain["prompt_id"][1] == table["prompt_id"][2]  # one user message: the id of its text, as before


@pytest.mark.parametrize("kind", ["transformers", "static"])
def test_engines_render_the_chat_template_over_every_turn(arith_model, kind):
    tok = load_tokenizer(arith_model)
    engine = make_rollout_engine(kind, model_path=arith_model, max_new_tokens=4, batch_size=4)
    prompts, messages = [CHAT_TEXT, "What is 1 + 1?"], [json.dumps(CHAT), None]
    samples = engine.generate(prompts, n=2, seed=0, messages=messages)
    whole = _chat_template_ids(tok, CHAT)
    assert [s["prompt_ids"] for s in samples[:2]] == [whole, whole]
    assert samples[2]["prompt_ids"] == _chat_template_ids(tok, [{"role": "user", "content": "What is 1 + 1?"}])
    assert all(s["response_ids"] for s in samples)
    # the same prompt texts without their messages are other prompts (the engine's encoding cache keys both)
    flat = engine.generate(prompts, n=1, seed=0)
    assert flat[0]["prompt_ids"] == _chat_template_ids(tok, [{"role": "user", "content": CHAT_TEXT}]) != whole


def test_rollouts_keep_the_messages_and_the_policy_batch_the_sampled_ids(arith_model, tmp_path):
    from batchrl.resources import RolloutEngineResource
    from batchrl.training.rl.advantages import compute_advantages
    from batchrl.training.jobs._runtime import Reporter
    from batchrl.training.jobs.rollouts import work
    from batchrl.training.rewards.registry import compute_rewards
    from batchrl.training.data.text import prompt_messages
    from batchrl.training.trainer.policy import load_batch

    table = load_prompts(_verl_parquet(tmp_path / "train.parquet", [CHAT, [{"role": "user", "content": "1 + 1?"}]]),
                         mapping=VERL)
    messages = prompt_messages(table.to_dict("records"))
    resource = RolloutEngineResource(max_new_tokens=4)
    samples, _ = resource.sample(None, None, model_path=arith_model, prompts=list(table["prompt"]), n=2, seed=0,
                                 workdir=str(tmp_path), cache_dir=str(tmp_path / "cache"), messages=messages)
    # the Pipes job (GPU hosts) reads the messages back from the prompts file it is handed
    pd.DataFrame({"prompt": list(table["prompt"]), "prompt_messages": messages}).to_parquet(tmp_path / "p.parquet")
    work({"engine": resource.engine_options(arith_model, str(tmp_path)), "prompts_parquet": str(tmp_path / "p.parquet"),
          "n": 2, "seed": 0, "out_parquet": str(tmp_path / "job.parquet")}, Reporter(None))
    assert pd.read_parquet(tmp_path / "job.parquet")["prompt_ids"].map(list).tolist() == \
        samples["prompt_ids"].map(list).tolist()
    rollouts = samples.join(table.drop(columns=["prompt"]), on="prompt_index")  # as the rollouts asset joins them
    assert json.loads(rollouts["prompt_messages"][0]) == CHAT
    batch_path = tmp_path / "advantages.parquet"
    compute_advantages(compute_rewards(rollouts), "grpo").to_parquet(batch_path)
    whole = _chat_template_ids(load_tokenizer(arith_model), CHAT)
    assert load_batch(str(batch_path))["prompt_ids"][:2] == [whole, whole]  # what the policy update trains on


@pytest.fixture(scope="module")
def chat_reward_model(arith_model, tmp_path_factory) -> str:
    """The arithmetic model as a reward model with a head saved once (scores are the same on every load)."""
    import shutil

    import torch
    from transformers import AutoModelForSequenceClassification

    rm = tmp_path_factory.mktemp("chat_rm") / "rm"
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(arith_model, num_labels=1).save_pretrained(rm)
    shutil.copytree(arith_model, rm, ignore=shutil.ignore_patterns("*.safetensors", "config.json"), dirs_exist_ok=True)
    return str(rm)


def test_the_reward_model_scores_a_multi_turn_sample_after_its_whole_conversation(chat_reward_model, monkeypatch):
    import numpy as np

    from batchrl.training.rewards import reward_model
    from batchrl.training.rewards.registry import REWARD_MODEL, RewardConfig, compute_rewards

    tok = load_tokenizer(chat_reward_model)
    other = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}, CHAT[-1]]
    last = CHAT[-1]["content"]
    # the same last user turn and completion, different earlier turns (and a single-turn row beside them)
    rows = pd.DataFrame({"prompt": [last, last, "What is 1 + 1?"], "response": ["8", "8", "2"],
                         "prompt_messages": [json.dumps(CHAT), json.dumps(other), None]})
    seen = []
    score_sequences = reward_model.score_sequences
    monkeypatch.setattr(reward_model, "score_sequences", lambda model, sequences, *a, **k: (
        seen.append(sequences), score_sequences(model, sequences, *a, **k))[1])
    cfg = RewardConfig(weights={"rule": 0.0, REWARD_MODEL: 1.0})
    scored = compute_rewards(rows, cfg, reward_model_path=chat_reward_model)
    eos = [tok.eos_token_id]
    reply = list(tok("8", add_special_tokens=False)["input_ids"]) + eos
    assert seen[0][0] == _chat_template_ids(tok, CHAT) + reply  # every turn, not the flat prompt alone
    assert seen[0][1] == _chat_template_ids(tok, other) + reply
    # a single-turn row is encoded as before: the user prompt alone (its RM scores and data versions unchanged)
    assert seen[0][2] == _chat_template_ids(tok, [{"role": "user", "content": "What is 1 + 1?"}]) + \
        list(tok("2", add_special_tokens=False)["input_ids"]) + eos
    assert seen[0][2] == reward_model.encode_scored(tok, ["What is 1 + 1?"], ["2"], 256)[0]
    scores = scored[REWARD_MODEL].to_numpy()
    assert scores[0] != scores[1]
    # a table without any prompt_messages column scores as before
    plain = compute_rewards(rows.drop(columns=["prompt_messages"]).iloc[2:], cfg, reward_model_path=chat_reward_model)
    np.testing.assert_allclose(plain[REWARD_MODEL].to_numpy(), scores[2:], rtol=1e-5)
