"""Multi-turn logs: the context before the trained turn (``prompt_messages``) is rendered turn by turn with the
chat template wherever a prompt is encoded (DPO pairs and their reference pass, reward-model pairs, KTO,
logged completions); rows without one keep the single user turn."""
from __future__ import annotations

import json

import pandas as pd

from batchrl.training.data.batch_layout import encode_pairs
from batchrl.training.rewards.reward_model import encode_pairs_scored
from batchrl.training.data.text import encode_prompts
from batchrl.training.models.loading import load_tokenizer
from batchrl.training.trainer.kto import encode_feedback

CONTEXT = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
           {"role": "user", "content": "And times 3?"}]


def _expected(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_every_encoder_renders_the_conversation_before_the_trained_turn(arith_model):
    tok = load_tokenizer(arith_model)
    multi = _expected(tok, CONTEXT)
    single = _expected(tok, [{"role": "user", "content": "What is 1 + 1?"}])
    rows = [{"prompt": "user: What is 2 + 2?\nassistant: 4\nuser: And times 3?", "prompt_messages": json.dumps(CONTEXT),
             "chosen": "12", "rejected": "7"},
            {"prompt": "What is 1 + 1?", "prompt_messages": None, "chosen": "2", "rejected": "3"}]
    pairs = encode_pairs(tok, rows, max_length=128)
    assert pairs[0]["chosen_prompt"] == pairs[0]["rejected_prompt"] == multi
    assert pairs[1]["chosen_prompt"] == single
    scored = encode_pairs_scored(tok, pd.DataFrame(rows), max_length=128)
    assert scored[0][:len(multi)] == multi and scored[2][:len(multi)] == multi  # chosen, then rejected
    feedback = pd.DataFrame([{"prompt": rows[0]["prompt"], "prompt_messages": rows[0]["prompt_messages"],
                              "completion": "12", "label": True},
                             {"prompt": "What is 1 + 1?", "prompt_messages": float("nan"), "completion": "2",
                              "label": True}])
    encoded = encode_feedback(tok, feedback, max_length=128)
    assert encoded["matched"]["prompt_ids"] == [multi, single]
    assert encode_prompts(tok, ["x", "x"], [json.dumps(CONTEXT), None]) == [multi, _expected(
        tok, [{"role": "user", "content": "x"}])]  # the same prompt text with and without context: two prompts
