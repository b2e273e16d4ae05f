"""A tool-using "model" for the agent-loop tests: the tiny model with forced tokens.

``ForcedEngine`` is the transformers engine over a real (tiny) model whose sampled tokens are replaced by a script's
(``script(context_text) -> the next turn's text``): the loop, the tokenizer, the chat template, the sandbox and the
log-probs (a real forward pass of the forced tokens) are the real ones; only the choice of tokens is scripted, since
a 2.5M-parameter model cannot write code.
"""
from __future__ import annotations

import re

import torch

from batchrl.training.data.batch_layout import sequence_token_logprobs
from batchrl.training.rollout.transformers_engine import TransformersRolloutEngine


def _expression(question: str) -> str:
    """The Python expression of a tool-task question (sample_data/tools): a sum of a list, or the arithmetic."""
    listed = re.search(r"the sum of ([\d, ]+)\?", question)
    if listed:
        return f"sum([{listed.group(1)}])"
    return re.search(r"What is ([\d *+-]+)\?", question).group(1).strip()


def three_cells(context: str) -> str:
    """Three cells that need each other's state (x = EXPR; y = x * 1; print(y)), then "The answer is <output>."."""
    start = context.find("What is")
    done = context[start:].count("```python")  # the model's cells so far (the system turn names the format too)
    if done == 0:
        return f"Let me compute.\n```python\nx = {_expression(context[start:])}\n```"
    if done == 1:
        return "```python\ny = x * 1\n```"
    if done == 2:
        return "```python\nprint(y)\n```"
    outputs = re.findall(r"user\n(.*?)<\|im_end\|>", context, re.DOTALL)
    return f"The answer is {outputs[-1].strip()}."


class ForcedEngine(TransformersRolloutEngine):
    """``TransformersRolloutEngine`` whose turns are ``script``'s text (cut at ``max_new_tokens``, eos appended
    when it fits), with the model's own log-probs of those tokens."""

    def __init__(self, model_path: str | None = None, *, script=three_cells, **kwargs) -> None:
        super().__init__(model_path, **kwargs)
        self.script = script

    @torch.no_grad()
    def _generate_chunk(self, prompt_ids, seed):
        rows = []
        for ids in prompt_ids:
            text = self.script(self.tokenizer.decode(ids, skip_special_tokens=False))
            new = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            rows.append(new[:self.max_new_tokens])
        logps = sequence_token_logprobs(self.model, {"prompt_ids": list(prompt_ids), "response_ids": rows},
                                        self.tokenizer.pad_token_id, self.device, temperature=1.0,
                                        batch_size=len(rows))
        return [(row, lp.tolist(), row[-1] == self.tokenizer.eos_token_id) for row, lp in zip(rows, logps)]
