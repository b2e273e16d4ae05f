"""Rewards: rule functions, reward-model scores, custom ``module:function`` rewards, and their mix.

A reward function is ``fn(prompt: str, response: str, meta: dict) -> float``; ``meta`` is the whole
row (``answer``, ``category``, ...). ``compute_rewards`` evaluates every component per row and mixes
them: ``reward = sum_k w_k(category) * component_k`` where the weights come from
``RewardConfig.routing[category]`` when the row's category (or the field named by ``route_by``, e.g.
``data_source``) is routed, else ``RewardConfig.weights``
(the category-routed reward idea: e.g. arithmetic judged by the rule, chat by the RM).
"""
from __future__ import annotations

import importlib
import math
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from batchrl.training.timing.phases import beside_load, phase
from batchrl.training.data.text import Messages, prompt_messages

RewardFn = Callable[[str, str, dict], float]
REWARD_FUNCTIONS: dict[str, RewardFn] = {}
# What each registered reward reads from a row besides prompt/response (e.g. "answer", "tests"),
# so a run config can be checked against the prompt set before anything runs.
REWARD_NEEDS: dict[str, tuple[str, ...]] = {}
RULE, REWARD_MODEL = "rule", "reward_model"

_INTEGER = re.compile(r"[-+]?\d+")
# A number as people write it: sign, thousands separators, decimals ("-1,234.50").
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_FINAL_MARK = "####"


def register_reward(name: str, needs: tuple[str, ...] = ()) -> Callable[[RewardFn], RewardFn]:
    """Register ``fn`` under ``name``; ``needs`` lists the row fields it reads (documentation and
    config checks)."""
    def decorate(fn: RewardFn) -> RewardFn:
        known = REWARD_FUNCTIONS.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"reward {name!r} is already registered")
        REWARD_FUNCTIONS[name] = fn
        REWARD_NEEDS[name] = tuple(needs)
        return fn

    return decorate


def first_integer(text: str) -> int | None:
    """The first (optionally signed) integer written in ``text``, or None."""
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


def final_number_text(text: str) -> str | None:
    """The final answer written in ``text`` as written: the first number after the last ``####`` if
    there is one (GSM8K's convention), else the last number in the text."""
    head, mark, tail = text.rpartition(_FINAL_MARK)
    if mark:
        match = _NUMBER.search(tail)
        return match.group() if match else None
    numbers = _NUMBER.findall(head or tail)
    return numbers[-1] if numbers else None


def final_number(text: str) -> float | None:
    """``final_number_text`` as a float, thousands separators dropped (for display and statistics;
    answers are compared exactly with ``same_number``)."""
    number = final_number_text(text)
    return None if number is None else float(number.replace(",", ""))


# A gold answer written with this many decimals or more is a rounded non-terminating value (1/3 as
# 0.333333): there, and only there, a prediction within ANSWER_TOLERANCE counts as equal.
ROUNDED_DECIMALS = 6
ANSWER_TOLERANCE = Decimal("1e-6")


def same_number(predicted: str | None, gold: str | None) -> bool:
    """Whether two written numbers are the same answer: exact decimal equality after dropping
    thousands separators, a plus sign and trailing zeros ("1,234.50" = "1234.5", "-5" ≠ "5",
    "1000001" ≠ "1000000" — no relative tolerance that grows with the number). Only when the gold has
    ``ROUNDED_DECIMALS`` or more decimals (a rounded non-terminating decimal) may they differ by
    ``ANSWER_TOLERANCE``."""
    if predicted is None or gold is None:
        return False
    try:
        got, want = (Decimal(n.replace(",", "")) for n in (predicted, gold))
    except InvalidOperation:
        return False
    if got == want:
        return True
    decimals = -want.as_tuple().exponent if want.as_tuple().exponent < 0 else 0
    return decimals >= ROUNDED_DECIMALS and abs(got - want) <= ANSWER_TOLERANCE


def _answer_text(meta: Mapping[str, Any]) -> str | None:
    answer = meta.get("answer")
    return None if answer is None or (isinstance(answer, float) and math.isnan(answer)) else str(answer)


def _gold(meta: Mapping[str, Any]) -> int | None:
    text = _answer_text(meta)
    return None if text is None else first_integer(text)


@register_reward("arith_exact", needs=("answer",))
def arith_exact(prompt: str, response: str, meta: dict) -> float:
    """1.0 iff the first integer in the response equals ``meta["answer"]``; 0.0 otherwise (also when
    the row has no answer). "7", " 7.", "It is 7" score 1 for answer 7; "17", "3 then 7" score 0."""
    gold = _gold(meta)
    return float(gold is not None and first_integer(response) == gold)


@register_reward("arith_partial", needs=("answer",))
def arith_partial(prompt: str, response: str, meta: dict) -> float:
    """Shaped arithmetic reward: 0.2 for writing any integer, +0.8 if it is the right one (max 1.0).

    The format bonus gives a random policy a gradient long before it hits an exact answer."""
    if _gold(meta) is None:
        return 0.0
    return (0.2 if first_integer(response) is not None else 0.0) + 0.8 * arith_exact(prompt, response, meta)


@register_reward("final_answer", needs=("answer",))
def final_answer(prompt: str, response: str, meta: dict) -> float:
    """1.0 iff the response's final number (``final_number_text``: after the last ``####``, else the
    last number) is the gold answer's final number (``same_number``: exact); 0.0 otherwise. Credits
    worked solutions: "17 + 25 = 42" and "... so 16 - 7 = 9. #### 9" score 1 for answers 42 and 9."""
    return float(same_number(final_number_text(response), gold_number_text(meta)))


def gold_number_text(meta: Mapping[str, Any]) -> str | None:
    """The final number of the row's gold answer (a bare answer or a worked solution), as written."""
    text = _answer_text(meta)
    return None if text is None else final_number_text(text)


@register_reward("length_penalty")
def length_penalty(prompt: str, response: str, meta: dict) -> float:
    """``-min(1, max(0, len(response) - budget) / budget)`` characters, ``budget = meta.get("length_budget", 32)``:
    0 within budget, falling linearly to -1 at twice the budget."""
    budget = float(meta.get("length_budget") or 32)
    return -min(1.0, max(0.0, len(response) - budget) / budget)


def get_reward_function(spec: str) -> RewardFn:
    """A registered name (``"arith_exact"``) or an importable ``"package.module:function"``."""
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    if ":" not in spec:
        raise KeyError(f"unknown reward {spec!r}: not in {sorted(REWARD_FUNCTIONS)} and not 'module:function'")
    module_name, _, attr = spec.partition(":")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise TypeError(f"{spec!r} does not name a callable")
    return fn


def score_with_reward_model(
    rm_path: str, prompts: list[str], responses: list[str], *, batch_size: int = 32, max_length: int = 256,
    device: str = "cpu", dtype: str = "float32", messages: Sequence[Messages] | None = None,
) -> np.ndarray:
    """Scalar RM scores (float32) of each (prompt, response), from an RM folder (``train_reward_model``);
    ``messages``: per prompt, its multi-turn context (``prompt_messages``, or None), which the RM reads whole
    (the chat template over every turn) in the flat prompt's place, as the rollout engine sampled from it;
    the model runs in ``dtype`` (bfloat16 on GPUs: float32 matmuls there run at a fraction of the speed).
    The texts are tokenised on a thread while the model loads (the tokenizer's batch call releases the GIL
    and spreads over the cores); the ``tokenise`` phase is what remains of it once the model is loaded."""
    from batchrl.training.rewards.reward_model import encode_scored, load_reward_model, score_sequences
    from batchrl.training.models.loading import load_tokenizer

    tokenizer = load_tokenizer(rm_path)
    (model, _), sequences = beside_load(
        lambda: encode_scored(tokenizer, list(prompts), list(responses), max_length,
                              messages=None if messages is None else list(messages)),
        lambda: load_reward_model(rm_path, device=device, dtype=dtype, tokenizer=tokenizer))
    return score_sequences(model, sequences, tokenizer.pad_token_id, batch_size=batch_size)


def mix_rewards(
    components: Mapping[str, np.ndarray],
    weights: Mapping[str, float],
    *,
    category: str | Iterable[str | None] | None = None,
    routing: Mapping[str, Mapping[str, float]] | None = None,
) -> np.ndarray:
    """``reward[i] = sum_k W_i[k] * components[k][i]``, ``W_i = routing[category_i]`` if routed else ``weights``.

    ``category`` is one label for all rows or one per row. A routed category's weights replace the
    defaults entirely; a component absent from a weight dict has weight 0. A non-zero weight on a
    component that was not computed is an error (a silent 0 would hide a misconfiguration).
    """
    names = list(components)
    n = len(next(iter(components.values()))) if components else 0
    matrix = np.stack([np.asarray(components[k], dtype=np.float64) for k in names], axis=1) if names else np.zeros((n, 0))
    cats = [category] * n if category is None or isinstance(category, str) else list(category)
    if len(cats) != n:
        raise ValueError(f"{len(cats)} categories for {n} rows")

    def weight_vector(w: Mapping[str, float]) -> np.ndarray:
        missing = [k for k, v in w.items() if v and k not in components]
        if missing:
            raise KeyError(f"weights given for components that were not computed: {missing}")
        return np.array([float(w.get(k, 0.0)) for k in names])

    default = weight_vector(weights)
    routed = {c: weight_vector(w) for c, w in (routing or {}).items()}
    row_weights = np.stack([routed.get(c, default) if c is not None else default for c in cats]) if n else default[None][:0]
    return (matrix * row_weights).sum(axis=1)


UNFINISHED = ("max_turns", "length")  # a trajectory's finish reasons that are not its own end (training/agent)
OVERLONG_PENALTY = "overlong_penalty"  # the column of the soft overlong punishment, when configured


class OverlongBuffer(BaseModel):
    """DAPO's soft overlong punishment (``algos.dapo.compute_overlong_penalty``; verl's
    ``reward_model.overlong_buffer``): the last ``length`` tokens before the rollouts' token limit are a buffer
    through which the reward falls linearly, by up to ``penalty_factor``."""

    model_config = ConfigDict(extra="forbid")

    length: int = Field(..., gt=0, description="L_cache: tokens before the rollouts' limit (max_new_tokens; an "
                        "agent's max_total_tokens) where the penalty starts; must be smaller than that limit")
    penalty_factor: float = Field(1.0, gt=0, allow_inf_nan=False, description="the penalty at the limit: a "
                                  "response of limit - length tokens or fewer gets 0, one at the limit -penalty_factor")


class RewardConfig(BaseModel):
    """Reward mix of the ``rewards`` stage.

    - ``rule``: the rule reward (registry name or ``module:function``), column ``rule``;
    - ``custom``: more rule-like components, ``{column name: registry name or module:function}``;
    - ``reward_model_path``: RM folder, loaded only when a weight (or a routing entry) gives the RM a
      non-zero weight: then column ``reward_model`` is computed; a non-zero RM weight without a path is
      an error. At weight 0 the RM is neither required nor loaded;
    - ``weights`` / ``routing``: see ``mix_rewards``. The default keeps the RM out of the mix: the
      embedded arithmetic task is judged exactly by its rule, and an RM trained on unrelated logs
      should be weighted in deliberately (e.g. routed to the categories it was trained on).
    """

    rule: str = Field("arith_partial", description="the rule reward (column rule): a registered reward name or "
                      "module:function")
    custom: dict[str, str] = Field(default_factory=dict, description="more rule-like rewards: {column name: "
                                   "registered reward or module:function}")
    weights: dict[str, float] = Field(default_factory=lambda: {RULE: 1.0, REWARD_MODEL: 0.0}, description=(
        "mix weight per reward column (rule, reward_model, custom names): reward = sum of weight x column; "
        "reward_model at 0 = the reward model is neither needed nor loaded"))
    routing: dict[str, dict[str, float]] | None = Field(None, description=(
        "per-category weights {category: {column: weight}}, replacing weights for the rows whose route_by field "
        "has that value"))
    route_by: str = Field("category", description="row field whose value picks the routing entry "
                          "(category, or data_source as verl's reward manager does)")
    reward_model_path: str | None = Field(None, description=(
        "HF reward-model folder scored with when the mix weighs reward_model (library use: the rewards asset "
        "always takes the reward_model asset's folder)"))
    unfinished_reward: float | None = Field(None, description=(
        "the reward of a multi-turn trajectory that did not end on its own (finish_reason max_turns: its last "
        "allowed turn still called a tool; length: the token budget), whatever its answer, e.g. 0: a policy is not "
        "paid for echoing results in tool calls until the turn budget (seen on the tool task, bench/RESULTS.md). "
        "None: the mix, as for every row. Single-turn rollouts carry no finish_reason and are never affected"))
    overlong_buffer: OverlongBuffer | None = Field(None, description=(
        "DAPO's soft overlong punishment added to the reward: {length: L_cache, penalty_factor}; a response longer "
        "than the rollouts' token limit minus length loses up to penalty_factor, linearly (column overlong_penalty). "
        "None: off"))
    rm_batch_size: int = Field(32, description="sequences per reward-model forward pass")
    rm_max_length: int = Field(256, description="tokens of prompt + response the reward model reads; longer "
                               "ones are truncated")

    def weighs(self, component: str) -> bool:
        """Whether ``component`` has a non-zero weight in ``weights`` or any routing entry."""
        return any(w.get(component, 0.0) for w in [self.weights, *(self.routing or {}).values()])

    @property
    def needs_reward_model(self) -> bool:
        return self.weighs(REWARD_MODEL)


def overlong_penalty(frame: pd.DataFrame, buffer: OverlongBuffer, max_response_length: int | None) -> np.ndarray:
    """Each row's soft overlong punishment (``algos.dapo.compute_overlong_penalty``) over its ``response_ids``
    count, against ``max_response_length`` (the rollouts' token limit)."""
    from batchrl.training.algos.dapo import compute_overlong_penalty  # torch: only when configured

    if max_response_length is None:
        raise ValueError("rewards.overlong_buffer needs the rollouts' token limit (max_response_length): the "
                         "rollouts' lineage names no max_new_tokens")
    if buffer.length >= max_response_length:
        raise ValueError(f"rewards.overlong_buffer.length {buffer.length} must be smaller than the rollouts' token "
                         f"limit {max_response_length}")
    lengths = [len(ids) for ids in frame["response_ids"]]
    return compute_overlong_penalty(lengths, max_response_length=max_response_length, buffer_length=buffer.length,
                                    penalty_factor=buffer.penalty_factor).double().numpy()


def compute_rewards(
    rows: list[dict] | pd.DataFrame, cfg: RewardConfig | None = None, *, reward_model_path: str | None = None,
    device: str = "cpu", dtype: str = "float32", max_response_length: int | None = None,
) -> pd.DataFrame:
    """The input rows (needs ``prompt``, ``response``; ``category``/``answer`` etc. go to ``meta``) plus
    one float column per component (``rule``, each ``custom`` name, ``reward_model`` if the mix weighs
    the RM) and ``reward``, the mix. ``reward_model_path``, when given, overrides ``cfg.reward_model_path``.
    A row's ``prompt_messages`` (a multi-turn prompt) is the conversation the RM scores the response after.
    With ``cfg.overlong_buffer`` the soft overlong punishment against ``max_response_length`` (the rollouts'
    token limit) is added to the mix and kept as column ``overlong_penalty``."""
    cfg = cfg or RewardConfig()
    if reward_model_path:
        cfg = cfg.model_copy(update={"reward_model_path": reward_model_path})
    frame = pd.DataFrame(rows).reset_index(drop=True)
    records = frame.to_dict(orient="records")
    rule_specs = {RULE: cfg.rule, **cfg.custom}
    components: dict[str, np.ndarray] = {}
    with phase("rule_rewards"):
        for name, spec in rule_specs.items():
            fn = get_reward_function(spec)
            components[name] = np.array([float(fn(r["prompt"], r["response"], r)) for r in records], dtype=np.float64)
    if cfg.needs_reward_model and cfg.reward_model_path:
        components[REWARD_MODEL] = score_with_reward_model(
            cfg.reward_model_path, frame["prompt"].tolist(), frame["response"].tolist(),
            batch_size=cfg.rm_batch_size, max_length=cfg.rm_max_length, device=device, dtype=dtype,
            messages=prompt_messages(records),
        ).astype(np.float64)
    elif cfg.needs_reward_model:
        raise ValueError("the reward mix weights the reward model but no reward_model_path is set")
    key = cfg.route_by
    categories = [c if isinstance(c, str) else None for c in frame[key]] if key in frame else None
    reward = mix_rewards(components, cfg.weights, category=categories, routing=cfg.routing)
    if cfg.overlong_buffer is not None:
        components[OVERLONG_PENALTY] = overlong_penalty(frame, cfg.overlong_buffer, max_response_length)
        reward = reward + components[OVERLONG_PENALTY]
    if cfg.unfinished_reward is not None and "finish_reason" in frame:
        reward = np.where(frame["finish_reason"].isin(UNFINISHED).to_numpy(), cfg.unfinished_reward, reward)
    out = frame.copy()
    for name, values in components.items():
        out[name] = values
    out["reward"] = reward
    return out
