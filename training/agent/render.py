"""Token ids of the turns the loop adds between model turns, rendered with the tokenizer's chat template.

The model's turn was cut right after its tool call (no end-of-turn token generated), so what follows it is the
template's end of the assistant turn, the observation turn, and the opening of the next assistant turn. Rendered
as the template would render the whole conversation: a conversation ``[user, assistant=MARK, observation]`` with
the generation prompt, everything after ``MARK``. The ids are appended to the context as they are (the model's
own tokens are never re-tokenised, so the trained ids are the sampled ones).
"""
from __future__ import annotations

from typing import Any

from batchrl.training.data.text import Messages, render_prompt

_MARK = "\x00batchrl-assistant-turn\x00"


def observation_text(tokenizer: Any, observation: str, role: str) -> str:
    """What the template writes after an assistant turn's content up to the next assistant turn's content."""
    if not getattr(tokenizer, "chat_template", None):  # a base model: plain text around the observation
        return f"\n{role.capitalize()}: {observation}\nAssistant: "
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK},
         {"role": role, "content": observation}], add_generation_prompt=True, tokenize=False)
    at = rendered.find(_MARK)
    if at < 0:
        raise ValueError("the chat template does not write the assistant's content verbatim: the agent loop cannot "
                         "place an observation after it")
    return rendered[at + len(_MARK):]


def observation_ids(tokenizer: Any, observation: str, role: str) -> list[int]:
    return list(tokenizer(observation_text(tokenizer, observation, role), add_special_tokens=False)["input_ids"])


def with_instructions(prompt: str, messages: Messages, instructions: str) -> list[dict] | Messages:
    """The conversation with the tool instructions as its system turn (a conversation that has a system turn keeps
    it, the instructions go first in it); unchanged without instructions."""
    import json

    if not instructions:
        return messages
    turns = json.loads(messages) if isinstance(messages, str) else list(messages) if messages else \
        [{"role": "user", "content": prompt}]
    if turns and turns[0].get("role") == "system":
        return [{"role": "system", "content": instructions + "\n\n" + turns[0]["content"]}, *turns[1:]]
    return [{"role": "system", "content": instructions}, *turns]


__all__ = ["observation_ids", "observation_text", "render_prompt", "with_instructions"]
