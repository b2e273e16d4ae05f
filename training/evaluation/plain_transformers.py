"""What a user of an exported model sees: plain transformers (no batchrl loader), one prompt at a time with the
chat template, greedy, no padding. `batchrl export` promises that these answers are the ones the evaluation asset
reported for the policy (tests/test_pipeline_e2e.py on the tiny default, bench/check_export_answers.py on a real
model)."""
from __future__ import annotations


def plain_answers(folder: str, prompts: list[str], max_new_tokens: int) -> tuple[list[str], list[int]]:
    """The greedy answer of the model in ``folder`` to each prompt, and its length in tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    answers, lengths = [], []
    for text in prompts:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**prompt, do_sample=False, max_new_tokens=max_new_tokens)
        answer_ids = out[0, prompt["input_ids"].shape[1]:]
        answers.append(tokenizer.decode(answer_ids, skip_special_tokens=True))
        lengths.append(len(answer_ids))
    return answers, lengths


def evaluated_rows(lineage: dict) -> list[dict]:
    """The held-out rows an evaluation artifact scored, in its order, from its ``lineage.json`` (the prompt file,
    shape, suffix and row limit it recorded)."""
    from batchrl.training.data.prompts import load_prompts

    config = lineage["config"]
    rows = load_prompts(lineage["input_files"][0]["uri"], shape=config["shape"], suffix=config["prompt_suffix"])
    return rows.head(config["max_eval_prompts"] or len(rows)).to_dict("records")
