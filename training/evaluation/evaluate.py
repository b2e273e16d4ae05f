"""Evaluation of a policy folder: greedy arithmetic accuracy, preference accuracy, RM score.

Metrics (all plain floats/ints, so they can go straight into Dagster metadata):

- ``arith_accuracy`` = mean of the ``reward`` function (default ``arith_exact``; ``final_answer``
  for the real task) over greedy responses, ``accuracy/<category>`` the same per prompt category;
  ``arith_mean_reward`` = mean ``arith_partial``; ``arith_format_rate`` = fraction of responses
  containing an integer; ``arith_accuracy_stderr`` its standard error (``training.evaluation.paired``);
  ``format_rate`` = mean of the ``format_reward`` (e.g. ``format_gsm8k``) when one is
  given; ``truncation_rate``, ``loop_rate``, ``mean_answer_tokens`` (``training.answer_stats``);
- ``preference_accuracy`` = mean 1[log pi(chosen|x) > log pi(rejected|x)] and
  ``preference_margin`` = mean (log pi(chosen|x) - log pi(rejected|x)), log-probs summed over the
  completion tokens (eos included), the DPO convention;
- with reference log-probs for the same pairs: ``logratio_margin`` = mean of
  ``(log pi(c) - log ref(c)) - (log pi(r) - log ref(r))`` (DPO's implicit reward margin over beta) and
  ``logratio_accuracy`` = fraction of pairs where it is positive;
- per pair source (``pair_source`` of the DPO pairs: a log drop, a scored-logs file, self play):
  ``preference_accuracy/<source>``, ``logratio_accuracy/<source>`` and ``preference_n/<source>``;
- ``rm_mean_score`` = mean RM score of the greedy responses, when an RM folder is given.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pandas as pd

from batchrl.training.evaluation.answer_stats import answer_stats
from batchrl.training.evaluation.paired import SCORES, mean_stderr, paired_gain
from batchrl.training.data.batch_layout import encode_pairs, pair_logprobs
from batchrl.training.timing.phases import phase
from batchrl.training.rewards.registry import REWARD_FUNCTIONS, first_integer, get_reward_function, score_with_reward_model
from batchrl.training.rollout import make_rollout_engine
from batchrl.training.models.loading import cached_in_worker, load_checkpoint_in_place, load_tokenizer, tokenizer_key
from batchrl.training.models.lora import resolve_base
from batchrl.training.models.weights import host_memory_available, read_weights, same_model_files, weight_files


def _arith_metrics(samples: list[dict], arith_eval: list[dict], reward: str,
                   format_reward: str | None = None) -> dict[str, Any]:
    exact, partial = get_reward_function(reward), REWARD_FUNCTIONS["arith_partial"]
    rows = [(s, arith_eval[s["prompt_index"]]) for s in samples]
    correct = [exact(s["prompt"], s["response"], row) for s, row in rows]
    by_category: dict[str, list[float]] = {}
    for (_, row), score in zip(rows, correct):
        by_category.setdefault(str(row.get("category") or "none"), []).append(score)
    by_question = [0.0] * len(arith_eval)  # SCORES: taken out of the results unless asked for (evaluate_models)
    for s, score in zip(samples, correct):
        by_question[s["prompt_index"]] = float(score)
    return {
        "arith_n": len(rows),
        "arith_accuracy": float(np.mean(correct)),
        "arith_accuracy_stderr": mean_stderr(correct),
        SCORES: by_question,
        **{f"accuracy/{cat}": float(np.mean(scores)) for cat, scores in sorted(by_category.items())},
        **{f"n/{cat}": len(scores) for cat, scores in sorted(by_category.items())},
        "arith_mean_reward": float(np.mean([partial(s["prompt"], s["response"], row) for s, row in rows])),
        "arith_format_rate": float(np.mean([first_integer(s["response"]) is not None for s, _ in rows])),
        "arith_stop_rate": float(np.mean([s["finish_reason"] == "stop" for s in samples])),
        "mean_response_tokens": float(np.mean([len(s["response_ids"]) for s in samples])),
        **answer_stats(samples),
        **({} if format_reward is None else {"format_rate": float(np.mean(
            [get_reward_function(format_reward)(s["prompt"], s["response"], row) for s, row in rows]))}),
    }


def _engine_for(model_path: str, same_model: Any, *, engine: str, max_new_tokens: int, batch_size: int,
                device: str, dtype: str, weights: Future | None = None) -> Any:
    """A greedy-decoding engine of ``engine`` kind ("static" on GPUs: no per-step logits kept, CUDA graphs)
    for ``model_path``: ``same_model`` (an engine of a folder with the same model but other weights) with
    these weights copied in (no second load, its CUDA graphs stay valid; ``weights``: them being read ahead),
    else a new one."""
    if getattr(same_model, "model", None) is not None:  # an engine over a transformers model
        with phase("load_weights"):  # from the worker's weight cache, else as read ahead, else the files
            if load_checkpoint_in_place(same_model.model, model_path, dtype=dtype, device=device,
                                        tensors=weights.result() if weights else None):
                return same_model
    with phase("load_model"):
        return make_rollout_engine(engine, model_path=model_path, max_new_tokens=max_new_tokens, temperature=0.0,
                                   batch_size=batch_size, device=device, dtype=dtype,
                                   sampled_logprobs=False)  # greedy answers: nothing reads their log-probs


def _encoded_pairs(tokenizer: Any, pairs: pd.DataFrame, max_length: int) -> list[dict]:
    columns = [c for c in ("prompt", "chosen", "rejected", "prompt_messages") if c in pairs]  # multi-turn context kept
    return encode_pairs(tokenizer, pairs[columns].to_dict("records"), max_length)


def _evaluate(
    engine: Any,
    *,
    arith_eval: list[dict],
    pairs: pd.DataFrame | None = None,
    seed: int = 0,
    batch_size: int = 32,
    max_length: int = 256,
    num_examples: int = 5,
    reference: pd.DataFrame | None = None,
    reward: str = "arith_exact",
    format_reward: str | None = None,
    encoded: dict[str, list[dict]] | None = None,
    pairs_key: str = "",
    pairs_from_reference: bool = False,
    agent: dict | None = None,
) -> tuple[dict[str, Any], list[dict]]:
    """``evaluate_policy`` without the RM score, with a loaded engine: (results, the greedy samples).
    ``encoded``: the pairs tokenised so far, by ``pairs_key`` (the tokenizer's key: models sharing it share them).
    ``pairs_from_reference``: this model is the reference, and ``reference`` holds its pair log-probs at this
    ``max_length``: they are taken, not computed again. ``agent``: also answer the held-out prompts with tools
    (``training/agent``): ``tool_accuracy`` beside the one-turn ``arith_accuracy``, ``mean_tool_calls``, ...)."""
    results: dict[str, Any] = {}
    samples: list[dict] = []
    if arith_eval:
        with phase("generate"):
            samples = engine.generate([row["prompt"] for row in arith_eval], n=1, seed=seed)
        results.update(_arith_metrics(samples, arith_eval, reward, format_reward))
        shown: dict[str, int] = {}
        results["examples"] = []
        for s in samples:
            row = arith_eval[s["prompt_index"]]
            category = str(row.get("category") or "none")
            if shown.get(category, 0) < num_examples:
                shown[category] = shown.get(category, 0) + 1
                results["examples"].append({"category": category, "prompt": s["prompt"], "response": s["response"],
                                            "answer": str(row.get("answer"))})
        if agent is not None:  # the greedy answers above are the one-turn, no-tool baseline
            from batchrl.training.agent.evaluate import tool_metrics

            with phase("agent"):
                tools = tool_metrics(engine, arith_eval, agent, reward=reward, seed=seed, without_tools=False)
            tools.pop("tool_examples")
            results.update(tools)
    if pairs is not None and len(pairs):
        if pairs_from_reference and reference is not None:
            logps = {"chosen_logp": reference["ref_chosen_logp"].to_numpy(np.float64),
                     "rejected_logp": reference["ref_rejected_logp"].to_numpy(np.float64)}
        else:  # the reference pass's own function: policy and reference margins are computed alike
            encoded = {} if encoded is None else encoded
            with phase("tokenise"):  # done ahead on a thread for the first tokenizer (evaluate_models)
                if pairs_key not in encoded:
                    encoded[pairs_key] = _encoded_pairs(engine.tokenizer, pairs, max_length)
                items = encoded[pairs_key]
                if isinstance(items, Future):
                    items = encoded[pairs_key] = items.result()
            with phase("logprobs"):
                logps = pair_logprobs(engine.model, items, engine.tokenizer.pad_token_id, engine.device,
                                      batch_size=batch_size)
        results.update(_preference_metrics(logps, pairs, reference))
    return results, samples


def _preference_metrics(logps: dict, pairs: pd.DataFrame, reference: pd.DataFrame | None) -> dict[str, Any]:
    """Preference accuracy/margin (and the log-ratio ones with a reference) over all pairs, and the accuracies
    per ``pair_source`` (the log drop, scored file or self play each pair came from) when the pairs name it."""
    margin = logps["chosen_logp"] - logps["rejected_logp"]
    logratio = None if reference is None else \
        margin - (reference["ref_chosen_logp"] - reference["ref_rejected_logp"]).to_numpy(np.float64)
    results: dict[str, Any] = dict(preference_n=len(pairs), preference_accuracy=float((margin > 0).mean()),
                                   preference_margin=float(margin.mean()))
    if logratio is not None:
        results.update(logratio_margin=float(logratio.mean()), logratio_accuracy=float((logratio > 0).mean()))
    if "pair_source" in pairs:
        for source, rows in pairs.groupby(pairs["pair_source"].fillna("unknown").to_numpy()).indices.items():
            results[f"preference_accuracy/{source}"] = float((margin[rows] > 0).mean())
            results[f"preference_n/{source}"] = len(rows)
            if logratio is not None:
                results[f"logratio_accuracy/{source}"] = float((logratio[rows] > 0).mean())
    return results


def evaluate_policy(model_path: str, *, arith_eval: list[dict], reward_model_path: str | None = None,
                    **options: Any) -> dict[str, Any]:
    """Evaluate the causal LM in ``model_path`` (greedy decoding on ``device``); see the module doc.
    ``pairs``/``reference`` (rows aligned with ``pairs``: ``ref_chosen_logp``, ``ref_rejected_logp``),
    the decoding options: ``_evaluate``'s keywords. ``examples`` holds up to ``num_examples`` answers
    per category."""
    return evaluate_models({"model": model_path}, arith_eval=arith_eval, reward_model_path=reward_model_path,
                           **options)["model"]


def evaluate_models(models: dict[str, str], *, arith_eval: list[dict], reward_model_path: str | None = None,
                    engine: str = "transformers", max_new_tokens: int = 16, batch_size: int = 32,
                    max_length: int = 256, pair_max_length: int | None = None, device: str = "cpu",
                    dtype: str = "float32", reference_model: str | None = None, paired_with: str | None = None,
                    with_scores: bool = False, **options: Any) -> dict[str, dict[str, Any]]:
    """``evaluate_policy`` of each named model folder; checkpoints of the same model share one engine
    (weights copied in place; the next checkpoint's are read into host memory while the current one is
    evaluated), and the reward model is loaded once and scores every model's greedy
    answers (``rm_mean_score``, ``max_length`` tokens). ``pair_max_length``: the pairs' truncation (the
    reference pass's: a log-ratio margin over other tokens would mean nothing; default ``max_length``);
    ``reference_model``: the name of the model whose pair log-probs ``reference`` holds (not computed again).
    ``paired_with``: the name of the baseline (e.g. the base model) every other model's held-out accuracy is
    compared with question by question (``paired.paired_gain``: ``arith_gain``, its standard error, 95% interval,
    questions won and lost); ``with_scores``: keep each model's per-question scores (``arith_scores``)."""
    results, samples, current, encoded = {}, {}, None, {}  # current: (folder, engine) of the last model
    paths = list(models.values())
    with ThreadPoolExecutor(3, thread_name_prefix="read-ahead") as reader:
        ahead = _ReadAhead(reader)  # later checkpoints' weights, being read meanwhile
        pairs = options.get("pairs")
        if pairs is not None and len(pairs) and paths:  # tokenised while the first model loads and answers
            encoded[tokenizer_key(paths[0])] = reader.submit(_encoded_pairs, load_tokenizer(paths[0]), pairs,
                                                             pair_max_length or max_length)
        for index, (name, path) in enumerate(models.items()):
            reuse = current[1] if current is not None and same_model_files(current[0], path) else None
            current = None  # another model: the last one's memory is free before this one loads
            current = (path, _engine_for(path, reuse, engine=engine, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                         device=device, dtype=dtype, weights=ahead.pop(path, None)))
            reuse = None
            # the checkpoints after the next one are read ahead from now on; the next one loads straight from its
            # files onto the device if not cached (reads begun beside the base model's short evaluation were not
            # done by its end, and waiting for them was slower than a direct load: bench/RESULTS.md)
            if getattr(current[1], "model", None) is not None:
                for following in paths[index + 2:]:
                    if following not in ahead and same_model_files(path, following) and not cached_in_worker(
                            following, dtype=dtype, device=device):
                        ahead.read(following)
            results[name], samples[name] = _evaluate(
                current[1], arith_eval=arith_eval, batch_size=batch_size, max_length=pair_max_length or max_length,
                encoded=encoded, pairs_key=tokenizer_key(path), pairs_from_reference=name == reference_model,
                **options)
    current = None  # the policies' memory (engine, CUDA graphs) is free before the reward model loads
    answered = [(name, s) for name in models for s in samples[name]]
    if reward_model_path and answered:
        scores = score_with_reward_model(
            reward_model_path, [s["prompt"] for _, s in answered], [s["response"] for _, s in answered],
            batch_size=batch_size, max_length=max_length, device=device, dtype=dtype)
        for name in models:
            mine = [score for (owner, _), score in zip(answered, scores) if owner == name]
            if mine:
                results[name]["rm_mean_score"] = float(np.mean(mine))
    baseline = results.get(paired_with, {}).get(SCORES)
    for name, metrics in results.items():
        if baseline is not None and name != paired_with and SCORES in metrics:
            metrics.update(paired_gain(metrics[SCORES], baseline))
        if not with_scores:
            metrics.pop(SCORES, None)
    return results


class _ReadAhead:
    """Later checkpoints' weights read into host memory on ``reader``'s threads while the current model works. One
    read per set of weight files (LoRA adapters of one base share their base's), and only where the host has room
    for it twice over beside the reads still running: at 1.5B (7.1 GB in fp32) reading every later adapter's base at
    once took a 24 GB box's memory and the run was killed; a checkpoint not read ahead loads from its files."""

    def __init__(self, reader: ThreadPoolExecutor):
        self.reader, self.reads, self.owners = reader, {}, {}  # files -> (future, bytes); path -> files

    def __contains__(self, path: str) -> bool:
        return path in self.owners

    def read(self, path: str) -> None:
        files = tuple(weight_files(resolve_base(path)))
        if files not in self.reads:
            size = sum(os.path.getsize(f) for f in files)
            running = sum(n for future, n in self.reads.values() if not future.done())
            if 2 * size > host_memory_available() - running:
                return
            self.reads[files] = (self.reader.submit(read_weights, path), size)
        self.owners[path] = files

    def pop(self, path: str, default=None):
        """The read of ``path``'s weights (a future), dropped here once no later checkpoint shares it."""
        files = self.owners.pop(path, None)
        if files is None:
            return default
        future = self.reads[files][0]
        if files not in self.owners.values():
            del self.reads[files]
        return future
