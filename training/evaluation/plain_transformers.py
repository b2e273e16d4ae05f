"""What a user of an exported model sees: plain transformers (no batchrl loader), the chat template, greedy; one
prompt at a time with no padding, or batched with left padding as transformers' docs batch generation. `batchrl
export` promises that these answers are the ones the evaluation asset reported for the policy
(tests/test_pipeline_e2e.py on the tiny default, bench/check_export_answers.py on a real model)."""
from __future__ import annotations


def plain_answers(folder: str, prompts: list[str], max_new_tokens: int, batch_size: int = 1, device: str = "cpu",
                  dtype: str | None = None) -> tuple[list[str], list[int]]:
    """The greedy answer of the model in ``folder`` to each prompt, and its length in tokens (up to and with the
    first end-of-sequence token). ``batch_size`` > 1 pads on the left; ``dtype`` (e.g. ``bfloat16``): the weights'
    (default: transformers' float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, **({"dtype": getattr(torch, dtype)} if dtype else {}))
    model.to(device)
    model.eval()
    stops = model.generation_config.eos_token_id
    stops = set(stops if isinstance(stops, list) else [stops]) | {tokenizer.eos_token_id}
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    answers, lengths = [], []
    for start in range(0, len(prompts), batch_size):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=False) for text in prompts[start:start + batch_size]]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id)
        for row in out[:, batch["input_ids"].shape[1]:].tolist():
            end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
            answers.append(tokenizer.decode(row[:end], skip_special_tokens=True))
            lengths.append(end)
    return answers, lengths


def evaluated_rows(lineage: dict) -> list[dict]:
    """The held-out rows an evaluation artifact scored, in its order, from its ``lineage.json`` (the prompt file,
    shape, suffix and row limit it recorded)."""
    from batchrl.training.data.prompts import load_prompts

    config = lineage["config"]
    rows = load_prompts(lineage["input_files"][0]["uri"], shape=config["shape"], suffix=config["prompt_suffix"])
    return rows.head(config["max_eval_prompts"] or len(rows)).to_dict("records")
