"""Atomic checkpoints, keep-last-K, RNG restore and exact resume (CPU, DeepSpeed gloo)."""
import json
import os
import random
import time

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from arith_pairs import build_arith_pairs

from batchrl.training.trainer.checkpoint import (LATEST, latest_tag, list_checkpoints, load_checkpoint,
                                                 save_checkpoint)
from batchrl.training.trainer.config import DPOConfig, PolicyConfig
from batchrl.training.trainer.dpo import train_dpo
from batchrl.training.trainer.engine import init_deepspeed
from batchrl.training.trainer.policy import train_policy
from batchrl.training.trainer.reference import compute_reference_logprobs



@pytest.fixture(scope="module")
def dpo_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    paths = build_arith_pairs(root, rejected_offset=3)
    compute_reference_logprobs(paths["model_path"], paths["pairs_parquet"], str(root / "ref.parquet"),
                               max_length=64, batch_size=16)
    return {**paths, "reference_parquet": str(root / "ref.parquet")}


def _weights(out_dir):
    return load_file(os.path.join(out_dir, "model", "model.safetensors"))


def test_checkpoints_keep_last_k_and_tracker(dpo_inputs, tmp_path):
    cfg = DPOConfig(epochs=1, micro_batch_size=8, save_every=1, keep_last=2)
    result = train_dpo(cfg, out_dir=str(tmp_path), **dpo_inputs)
    ckpt = tmp_path / "checkpoints"
    assert result["global_step"] == 4
    assert list_checkpoints(str(ckpt)) == ["step_00000003", "step_00000004"]
    assert (ckpt / LATEST).read_text() == "step_00000004"
    state = json.loads((ckpt / "step_00000004" / "trainer_state.json").read_text())
    assert (state["epoch"], state["step_in_epoch"], state["global_step"]) == (0, 4, 4)
    assert len(state["history"]) == 4
    assert not [p for p in os.listdir(ckpt) if p.startswith(".tmp")]


def test_interrupted_save_leaves_previous_checkpoint(dpo_inputs, tmp_path):
    train_dpo(DPOConfig(epochs=1, micro_batch_size=8, save_every=2, stop_after_steps=2),
              out_dir=str(tmp_path), **dpo_inputs)
    ckpt = str(tmp_path / "checkpoints")
    # a save killed half-way: its temp dir exists, a tag dir never appeared, latest untouched
    os.makedirs(os.path.join(ckpt, ".tmp-step_00000003", "step_00000003"))
    open(os.path.join(ckpt, ".tmp-step_00000003", "step_00000003", "half.pt"), "wb").write(b"\0" * 10)
    assert latest_tag(ckpt) == "step_00000002" and list_checkpoints(ckpt) == ["step_00000002"]
    resumed = train_dpo(DPOConfig(epochs=1, micro_batch_size=8, save_every=2), out_dir=str(tmp_path), **dpo_inputs)
    assert resumed["resumed_from_step"] == 2 and resumed["global_step"] == 4


def test_rng_states_round_trip(tmp_path):
    engine = init_deepspeed(torch.nn.Linear(4, 2), DPOConfig(micro_batch_size=1))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    save_checkpoint(engine, str(tmp_path), 1, {"epoch": 0, "step_in_epoch": 1})
    first = (random.random(), np.random.rand(), torch.rand(3))
    load_checkpoint(engine, str(tmp_path))
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[0] == again[0] and first[1] == again[1] and torch.equal(first[2], again[2])


@pytest.mark.parametrize("stop_at", [3, 4])  # mid-epoch and exactly on the epoch boundary
def test_dpo_resume_is_exact(dpo_inputs, tmp_path, stop_at):
    cfg = DPOConfig(epochs=2, micro_batch_size=8, lr=1e-3)
    full = train_dpo(cfg, out_dir=str(tmp_path / "full"), **dpo_inputs)
    part = train_dpo(cfg.model_copy(update={"stop_after_steps": stop_at}), out_dir=str(tmp_path / "cut"), **dpo_inputs)
    assert part["stopped_early"] and part["global_step"] == stop_at and "model_dir" not in part
    resumed = train_dpo(cfg, out_dir=str(tmp_path / "cut"), **dpo_inputs)
    assert resumed["resumed_from_step"] == stop_at and resumed["global_step"] == full["global_step"] == 8
    assert resumed["loss_curve"] == full["loss_curve"]  # bitwise on CPU
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["margin_after"] == pytest.approx(full["margin_after"], abs=1e-9)


def test_exported_model_loads_with_transformers(dpo_inputs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train_dpo(DPOConfig(epochs=1, micro_batch_size=16), out_dir=str(tmp_path), **dpo_inputs)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    base = AutoModelForCausalLM.from_pretrained(dpo_inputs["model_path"])
    ids = torch.tensor([tok("Compute 1 + 2.")["input_ids"]])
    assert model(ids).logits.shape == base(ids).logits.shape
    assert not torch.allclose(model(ids).logits, base(ids).logits)  # the weights were trained
    assert model.config.use_cache  # exported for generation
    meta = json.loads((tmp_path / "batchrl_train.json").read_text())  # beside the export, not in it
    assert not (tmp_path / "model" / "batchrl_train.json").exists()
    assert meta["config"]["beta"] == 0.1 and meta["global_step"] == 2
    # the tokenizer's files are its base's, byte for byte: the checkpoint is the same model but for its weights
    from batchrl.training.models.folders import tokenizer_files
    from batchrl.training.models.loading import tokenizer_key
    from batchrl.training.models.weights import same_model_files

    names = tokenizer_files(dpo_inputs["model_path"])
    assert names and names == tokenizer_files(str(tmp_path / "model"))
    for name in names:
        assert (tmp_path / "model" / name).read_bytes() == open(os.path.join(dpo_inputs["model_path"], name), "rb").read()
    assert tokenizer_key(str(tmp_path / "model")) == tokenizer_key(dpo_inputs["model_path"])
    assert same_model_files(str(tmp_path / "model"), dpo_inputs["model_path"])


def test_policy_resume_is_exact(dpo_inputs, tmp_path):
    rng = np.random.default_rng(0)
    rows = [{"prompt_index": i // 4, "prompt_ids": [1, 2, 3 + i % 5], "response_ids": list(rng.integers(3, 60, 1 + i % 4)),
             "reward": float(i % 2)} for i in range(32)]
    from batchrl.training.rl.advantages import compute_advantages

    compute_advantages(pd.DataFrame(rows), "grpo").to_parquet(tmp_path / "batch.parquet")
    cfg = PolicyConfig(micro_batch_size=4, grad_accum=2, ppo_epochs=2, kl_loss_coef=0.05)
    kw = dict(batch_parquet=str(tmp_path / "batch.parquet"), model_path=dpo_inputs["model_path"],
              reference_model_path=dpo_inputs["model_path"])
    full = train_policy(cfg, out_dir=str(tmp_path / "full"), **kw)
    train_policy(cfg.model_copy(update={"stop_after_steps": 5}), out_dir=str(tmp_path / "cut"), **kw)
    resumed = train_policy(cfg, out_dir=str(tmp_path / "cut"), **kw)
    assert full["global_step"] == full["optimizer_steps"] == 8 and resumed["resumed_from_step"] == 5
    assert resumed["optimizer_steps"] == 8  # one optimiser step per grad_accum micro-batches
    assert resumed["loss_curve"] == full["loss_curve"]
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert full["final"]["kl_loss"] > 0


@pytest.mark.parametrize("old_logprobs", ["recompute", "rollout"])
def test_first_policy_update_takes_the_reference_log_probs_from_its_own_pass(dpo_inputs, tmp_path, monkeypatch,
                                                                             old_logprobs):
    """When the policy being updated is the reference model itself (the chain's first update), the reference
    log-probs come from the policy's own pass (the old-policy pass itself where it recomputes; with the engine's
    log-probs as the old ones, one pass of the policy): no second model load, and the same numbers and update as
    a reference loaded from a copy of the folder."""
    import shutil

    from batchrl.training.models import loading
    from batchrl.training.rl.advantages import compute_advantages
    from batchrl.training.trainer.policy import FIXED_LOGPROBS

    rng = np.random.default_rng(1)
    rows = [{"prompt_index": i // 4, "prompt_ids": [1, 2, 3 + i % 5], "response_ids": list(rng.integers(3, 60, 2 + i % 3)),
             "reward": float(i % 3 == 0)} for i in range(16)]
    for row in rows:  # what an engine reports for its sampled tokens (used with old_logprobs="rollout")
        row["rollout_logprobs"] = list(-rng.random(len(row["response_ids"])))
    compute_advantages(pd.DataFrame(rows), "grpo").to_parquet(tmp_path / "batch.parquet")
    copy = shutil.copytree(dpo_inputs["model_path"], tmp_path / "reference_copy")
    loads = []
    load = loading.load_model_and_tokenizer
    monkeypatch.setattr(loading, "load_model_and_tokenizer", lambda *a, **kw: loads.append(a[0]) or load(*a, **kw))
    cfg = PolicyConfig(micro_batch_size=4, grad_accum=2, kl_loss_coef=0.1, old_logprobs=old_logprobs)
    runs = {}
    for name, reference in (("same", dpo_inputs["model_path"]), ("copy", str(copy))):
        runs[name] = train_policy(cfg, batch_parquet=str(tmp_path / "batch.parquet"), out_dir=str(tmp_path / name),
                                  model_path=dpo_inputs["model_path"], reference_model_path=reference)
    # each run loads the trainable policy; only the copy is loaded again as a separate reference
    assert loads == [dpo_inputs["model_path"], dpo_inputs["model_path"], str(copy)]
    same, other = (torch.load(tmp_path / n / FIXED_LOGPROBS, weights_only=False) for n in ("same", "copy"))
    assert all(np.allclose(a, b, atol=1e-6) for a, b in zip(same["ref"], other["ref"]))
    assert np.allclose(runs["same"]["loss_curve"], runs["copy"]["loss_curve"], atol=1e-6)
    assert runs["same"]["final"]["kl_loss"] == pytest.approx(runs["copy"]["final"]["kl_loss"], abs=1e-6)
    # the fixed passes' time, apart: the old policy's, the reference's, and the separate reference's load
    copy_phases, same_phases = runs["copy"]["phase_s"], runs["same"]["phase_s"]
    assert {"fixed_logprobs", "reference_pass", "load_model"} <= copy_phases.keys() and "load_model" not in same_phases
    assert copy_phases["load_model"] > 0 and copy_phases["reference_pass"] > 0
    if old_logprobs == "recompute":  # with the engine's log-probs as the old ones, no old-policy pass runs
        assert copy_phases["fixed_logprobs"] > 0


def test_resume_refuses_checkpoints_of_another_run(dpo_inputs, tmp_path):
    train_dpo(DPOConfig(epochs=1, micro_batch_size=8, stop_after_steps=1), out_dir=str(tmp_path), **dpo_inputs)
    with pytest.raises(ValueError, match="another run"):
        train_dpo(DPOConfig(epochs=1, micro_batch_size=8, lr=1e-2), out_dir=str(tmp_path), **dpo_inputs)
    # resumable settings may change: this continues the first run
    done = train_dpo(DPOConfig(epochs=1, micro_batch_size=8, save_every=1), out_dir=str(tmp_path), **dpo_inputs)
    assert done["resumed_from_step"] == 1


def test_finished_run_exports_instead_of_a_final_checkpoint_and_reruns_for_free(dpo_inputs, tmp_path, monkeypatch):
    cfg = DPOConfig(epochs=1, micro_batch_size=8)
    first = train_dpo(cfg, out_dir=str(tmp_path), **dpo_inputs)
    ckpt = str(tmp_path / "checkpoints")
    assert list_checkpoints(ckpt) == [] and latest_tag(ckpt) is None  # no engine/optimiser state at the end
    assert os.path.exists(os.path.join(ckpt, "completed.json")) and "completed_earlier" not in first
    weights = _weights(tmp_path)

    import batchrl.training.trainer.dpo as dpo

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run must not build an engine again")

    with monkeypatch.context() as m:
        m.setattr(dpo, "TrainLoop", no_training)
        again = train_dpo(cfg, out_dir=str(tmp_path), **dpo_inputs)
    assert again.pop("completed_earlier") and again == first
    with pytest.raises(AssertionError, match="must not build"):  # another run in the same folder trains
        monkeypatch.setattr(dpo, "TrainLoop", no_training)
        train_dpo(cfg.model_copy(update={"lr": 1e-3}), out_dir=str(tmp_path), **dpo_inputs)
    monkeypatch.undo()
    import shutil

    shutil.rmtree(tmp_path / "model")  # the export is gone: the run is trained again, to the same weights
    redone = train_dpo(cfg, out_dir=str(tmp_path), **dpo_inputs)
    assert "completed_earlier" not in redone and redone["loss_curve"] == first["loss_curve"]
    assert all(torch.equal(weights[k], v) for k, v in _weights(tmp_path).items())


def test_result_says_where_the_job_time_went(dpo_inputs, tmp_path):
    """phase_s: model load + engine, the measurement passes, the steps, the export, the rest — they add up to
    the job's time (the UI shows them per materialisation: where a GPU stage idles)."""
    started = time.perf_counter()
    result = train_dpo(DPOConfig(epochs=1, micro_batch_size=8), out_dir=str(tmp_path), **dpo_inputs)
    took = time.perf_counter() - started
    phases = result["phase_s"]
    assert set(phases) == {"setup", "margin_before", "steps", "margin_after", "export", "other"}
    assert all(phases[name] > 0 for name in set(phases) - {"other"}), phases  # each part took its time
    assert sum(phases.values()) <= took and sum(phases.values()) > 0.8 * took


def test_large_exports_are_sharded_and_hashed_file_by_file_in_parallel(dpo_inputs, tmp_path, monkeypatch):
    import hashlib

    from transformers import AutoModelForCausalLM

    from batchrl.common import fsutil
    from batchrl.training.trainer import checkpoint

    monkeypatch.setattr(checkpoint, "EXPORT_SHARD_MIN", 200_000)  # a big model's export, at the tiny model's size
    model = AutoModelForCausalLM.from_pretrained(dpo_inputs["model_path"])
    out = checkpoint.export_hf_model(model, None, str(tmp_path / "model"))
    shards = sorted(p for p in os.listdir(out) if p.endswith(".safetensors"))
    assert len(shards) > 2 and "model.safetensors.index.json" in os.listdir(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for (name, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    sequential = hashlib.sha256()  # the tree hash's definition, one file after the other
    for name in sorted(os.listdir(out)):
        sequential.update(name.encode() + b"\0" + hashlib.sha256((tmp_path / "model" / name).read_bytes())
                          .hexdigest().encode() + b"\n")
    fs = fsutil.filesystem_for(out)[0]
    assert fsutil.sha256_tree(fs, out, threads=4) == fsutil.sha256_tree(fs, out, threads=1) == sequential.hexdigest()


def test_an_export_is_cut_into_shards_for_the_writer_threads_by_the_models_size():
    """SmolLM2-135M's fp32 export (538 MB) went to one 512 MB shard: one thread wrote and hashed nearly all of it
    (~0.7 s of each RL iteration on the H200). An eighth of the weights a shard, 64-512 MB, whole kB."""
    from batchrl.training.trainer.checkpoint import export_shard_size

    weights = lambda nbytes: [torch.empty(nbytes // 4, dtype=torch.float32, device="meta")]  # noqa: E731
    assert export_shard_size(weights(538_000_000)) == 67_250_000  # 8 shards
    assert export_shard_size(weights(2_000_000_000)) == 250_000_000  # the 0.5B shape in fp32
    assert export_shard_size(weights(30_000_000_000)) == 512_000_000  # a 7B model in fp32: 59 files, not 469
    assert export_shard_size(weights(10_000_000)) == 64_000_000  # a small model stays one file


def test_shards_written_by_threads_are_safetensors_hashed_as_written(dpo_inputs, tmp_path, monkeypatch):
    """The export's own writer: files safetensors reads back exactly (every dtype a model has, 0-d and
    empty tensors, metadata), whose sha256 is taken while writing — the job's content hash then reads
    nothing again, and a file changed afterwards is hashed from its bytes."""
    import hashlib

    from safetensors import safe_open

    from batchrl.common import fsutil
    from batchrl.training.trainer import checkpoint
    from batchrl.training.trainer.safetensors_writer import write_safetensors

    tensors = {"w": torch.randn(3, 5), "h": torch.randn(7, dtype=torch.float64).to(torch.bfloat16),
               "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3), "mask": torch.tensor([True, False, True]),
               "scale": torch.tensor(2.5), "empty": torch.zeros(0, 4), "t": torch.randn(4, 3).t()}
    path = str(tmp_path / "w.safetensors")
    digest = write_safetensors(tensors, path, {"format": "pt"})
    assert digest == hashlib.sha256(open(path, "rb").read()).hexdigest()
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor) and f.get_tensor(name).dtype == tensor.dtype, name
    fs = fsutil.filesystem_for(path)[0]
    reads = []
    monkeypatch.setattr(fs, "open", lambda *a, **k: reads.append(a) or open(a[0], "rb"))
    assert fsutil.sha256_file(fs, path) == digest and not reads  # known from the write
    with open(path, "r+b") as f:  # changed afterwards (other size): hashed from the bytes again
        f.seek(0, 2)
        f.write(b"x")
    assert fsutil.sha256_file(fs, path) == hashlib.sha256(open(path, "rb").read()).hexdigest() and reads
    with pytest.raises(TypeError, match="bad.safetensors.*'z'.*complex"):
        write_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, str(tmp_path / "bad.safetensors"))

    monkeypatch.setattr(checkpoint, "EXPORT_SHARD_MIN", 200_000)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dpo_inputs["model_path"])
    out = checkpoint.export_hf_model(model, None, str(tmp_path / "model"))
    shards = [os.path.join(out, p) for p in os.listdir(out) if p.endswith(".safetensors")]
    assert len(shards) > 2
    assert all(fsutil._identity(p) in fsutil._WRITTEN_SHA256 for p in shards)  # hashed while written, renamed since


class _FakeTime:
    """A clock for ``training.phases`` that moves only when told: phase times are exact, whatever the load."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_library_phases_are_recorded_only_while_a_job_records(monkeypatch):
    """``phase`` marks in library code: summed per name into the recording clock, ``other`` the rest; a
    no-op when nobody records (the functions stay usable anywhere)."""
    from batchrl.training.timing import phases

    clock = _FakeTime()
    monkeypatch.setattr(phases, "time", clock)
    with phases.phase("load_model"):  # nobody records: nothing recorded anywhere
        clock.now += 5
    with phases.recording() as recorded:
        for _ in range(2):
            with phases.phase("load_model"):
                clock.now += 0.02
        clock.now += 0.02
        with phases.phase("evaluate"):
            clock.now += 0.02
            with phases.phase("load_model"):  # nested: counts for itself only
                clock.now += 0.3
    # evaluate: its own 0.02 s, not the nested load's 0.3 s; the load's 5 s before the recording: nowhere
    assert recorded.summary() == {"load_model": 0.34, "evaluate": 0.02, "other": 0.02}
    with phases.recording() as fresh:
        pass
    assert fresh.summary() == {"other": 0.0} and fresh.seconds == {}


def test_work_beside_a_load_runs_on_a_thread_and_its_phase_is_the_wait_after_the_load(monkeypatch):
    import threading

    from batchrl.training.timing import phases

    caller, loaded_event, waiting = threading.current_thread(), threading.Event(), threading.Event()

    class Clock(_FakeTime):
        def perf_counter(self) -> float:
            if loaded_event.is_set() and threading.current_thread() is caller:
                waiting.set()  # the caller reads the clock after the load: the wait for the work is timed
            return self.now

    clock = Clock()
    monkeypatch.setattr(phases, "time", clock)

    def load():
        clock.now += 0.1  # the load takes 0.1 s
        loaded_event.set()
        return "model"

    def work():
        assert waiting.wait(60)
        clock.now += 0.2  # the work ends 0.2 s after the load did
        return threading.current_thread().name

    with phases.recording() as recorded:
        loaded, worker = phases.beside_load(work, load)
    assert loaded == "model" and worker.startswith("tokenise")
    assert recorded.seconds == {"tokenise": pytest.approx(0.2)}  # the wait after the load, not the work's 0.3 s


def test_reference_logprobs_by_token_budget_equal_fixed_batches(dpo_inputs, tmp_path):
    """``batch_tokens``: short pairs go in larger batches (fewer forward passes); the log-probs are the
    same pair for pair, in input order."""
    import pandas as pd

    fixed = pd.read_parquet(dpo_inputs["reference_parquet"])
    out = str(tmp_path / "ref_tokens.parquet")
    compute_reference_logprobs(dpo_inputs["model_path"], dpo_inputs["pairs_parquet"], out, max_length=64,
                               batch_size=1000, batch_tokens=600)
    budget = pd.read_parquet(out)
    assert list(budget["id"]) == list(fixed["id"])
    for column in ("ref_chosen_logp", "ref_rejected_logp"):
        assert budget[column].to_numpy() == pytest.approx(fixed[column].to_numpy(), abs=1e-4)
    assert (budget[["chosen_len", "rejected_len"]] == fixed[["chosen_len", "rejected_len"]]).all().all()
