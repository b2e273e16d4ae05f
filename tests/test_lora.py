"""LoRA (issue 30) on the tiny model: every trainer trains adapters only, an adapter checkpoint is the adapter's
two files (small, named by its base), and every consumer of base + adapter gives what the merged model gives;
`batchrl export` writes the merged folder and the PEFT folder that plain transformers / PEFT load."""
import json
import os
import signal
import subprocess
import time

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from arith_pairs import ARITH, ARITH_EVAL, build_arith_pairs

from batchrl.training.models import lora
from batchrl.training.trainer.config import DPOConfig, PolicyConfig, RewardModelConfig
from batchrl.training.trainer.dpo import train_dpo
from batchrl.training.trainer.reference import compute_reference_logprobs

LORA = dict(lora_rank=4, lora_alpha=8)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    paths = build_arith_pairs(root, rejected_offset=3)
    compute_reference_logprobs(paths["model_path"], paths["pairs_parquet"], str(root / "ref.parquet"), max_length=64)
    return {**paths, "reference_parquet": str(root / "ref.parquet"), "root": root}


@pytest.fixture(scope="module")
def dpo_adapter(inputs):
    """A DPO LoRA run on the tiny model: (result, adapter folder)."""
    kw = {k: inputs[k] for k in ("pairs_parquet", "reference_parquet", "model_path")}
    result = train_dpo(DPOConfig(epochs=3, micro_batch_size=8, lr=1e-2, **LORA), out_dir=str(inputs["root"] / "dpo"),
                       **kw)
    return result, result["model_dir"]


@pytest.fixture(scope="module")
def merged(inputs, dpo_adapter):
    from batchrl.training.jobs.export import export_checkpoint

    return export_checkpoint(dpo_adapter[1], str(inputs["root"] / "merged"))["path"]


def _ids(model_path: str) -> torch.Tensor:
    from batchrl.training.models.loading import load_tokenizer

    tok = load_tokenizer(model_path)
    return torch.tensor([tok(row["prompt"] + " " + row["answer"])["input_ids"][:12] for row in ARITH[:4]])


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("fields, message", [
    (dict(lora_alpha=32), "lora_alpha set but lora_rank is 0"),
    (dict(lora_target_modules=["q_proj"]), "lora_target_modules set but lora_rank is 0"),
    (dict(lora_rank=4, lora_target_modules=["all-linear", "q_proj"]), "give it alone"),
    (dict(lora_rank=4, lora_target_modules=[]), "at least one module"),
    (dict(lora_rank=4, lora_target_modules=["q_proj"], lora_modules_to_save=["q_proj"]), "not both"),
    (dict(lora_rank=4, lora_dropout=1.0), "less than 1"),
])
def test_lora_config_rejects_bad_combinations_when_written(fields, message):
    for cls in (DPOConfig, PolicyConfig, RewardModelConfig):
        with pytest.raises(ValueError, match=message):
            cls(**fields)
    assert DPOConfig().lora_rank == 0  # full fine-tuning stays the default
    cfg = DPOConfig(lora_rank=8, lora_target_modules=["q_proj", "v_proj"], lora_modules_to_save=["embed_tokens"])
    assert DPOConfig.from_json(cfg.to_json()) == cfg


def test_dpo_lora_trains_the_adapter_only_and_publishes_it_small(inputs, dpo_adapter, tmp_path):
    result, adapter = dpo_adapter
    curve = result["loss_curve"]
    assert np.mean(curve[-3:]) < curve[0] and result["margin_after"] > result["margin_before"]
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    base_bytes = os.path.getsize(os.path.join(inputs["model_path"], "model.safetensors"))
    assert result["adapter_bytes"] == lora.adapter_bytes(adapter) < base_bytes / 5
    weights = load_file(os.path.join(adapter, lora.ADAPTER_WEIGHTS))
    assert weights and all("lora_A" in k or "lora_B" in k for k in weights)
    config = lora.read_adapter_config(adapter)
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (4, 8, "CAUSAL_LM")
    assert config["base_model_name_or_path"] == result["adapter_base"] == os.path.abspath(inputs["model_path"])
    assert config["target_modules"] == sorted(config["target_modules"])  # stable bytes, stable data version
    # the same run again elsewhere: the same adapter, byte for byte
    again = train_dpo(DPOConfig(epochs=3, micro_batch_size=8, lr=1e-2, **LORA), out_dir=str(tmp_path / "again"),
                      **{k: inputs[k] for k in ("pairs_parquet", "reference_parquet", "model_path")})
    for name in os.listdir(adapter):
        assert open(os.path.join(adapter, name), "rb").read() == open(os.path.join(again["model_dir"], name), "rb").read()


def test_an_artifact_base_is_named_by_asset_and_version_resolved_from_the_adapters_root(tmp_path, inputs):
    import shutil

    root = tmp_path / "storage"
    base = root / "base_model" / "abc123"
    shutil.copytree(inputs["model_path"], base)
    (base / "lineage.json").write_text("{}")  # a published artifact
    assert lora.base_reference(str(base)) == "base_model/abc123"
    adapter = root / "dpo_checkpoint" / "def456"
    adapter.mkdir(parents=True)
    (adapter / lora.ADAPTER_CONFIG).write_text(json.dumps({"base_model_name_or_path": "base_model/abc123"}))
    assert lora.is_adapter_folder(str(adapter)) and not lora.is_adapter_folder(str(base))
    assert lora.adapter_base(str(adapter)) == str(base)


def test_export_merged_is_the_base_plus_the_adapter_and_loads_with_transformers(inputs, dpo_adapter, merged):
    from transformers import AutoModelForCausalLM

    adapter = dpo_adapter[1]
    base, out = load_file(os.path.join(inputs["model_path"], "model.safetensors")), load_file(
        os.path.join(merged, "model.safetensors"))
    weights, config = load_file(os.path.join(adapter, lora.ADAPTER_WEIGHTS)), lora.read_adapter_config(adapter)
    scale = config["lora_alpha"] / config["r"]
    changed = 0
    for name, value in base.items():
        module = name.removesuffix(".weight")
        a = weights.get(f"base_model.model.{module}.lora_A.weight")
        expected = value + scale * weights[f"base_model.model.{module}.lora_B.weight"] @ a if a is not None else value
        torch.testing.assert_close(out[name], expected, rtol=0, atol=1e-6)
        changed += a is not None
    assert changed == 14  # every linear layer of the two decoder layers, not the head
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert model.config.use_cache and os.path.exists(os.path.join(merged, "tokenizer.json"))
    assert not os.path.exists(os.path.join(merged, "lineage.json"))


def test_peft_loads_the_exported_adapter_with_the_merged_logits(inputs, dpo_adapter, merged, tmp_path):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    from batchrl.training.jobs.export import ExportError, export_checkpoint
    from batchrl.training.models.loading import load_model_and_tokenizer

    folder = export_checkpoint(dpo_adapter[1], str(tmp_path / "peft"), adapter=True)["path"]
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(os.listdir(folder))
    ids = _ids(inputs["model_path"])
    want = _logits(AutoModelForCausalLM.from_pretrained(merged), ids)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(inputs["model_path"]), folder)
    torch.testing.assert_close(_logits(peft, ids), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(AutoPeftModelForCausalLM.from_pretrained(folder), ids), want, rtol=0, atol=1e-5)
    in_memory, _ = load_model_and_tokenizer(dpo_adapter[1])  # what every consumer loads: merged, never written
    assert torch.equal(_logits(in_memory, ids), want)
    with pytest.raises(ExportError, match="not a LoRA adapter"):
        export_checkpoint(merged, str(tmp_path / "no"), adapter=True)
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(dpo_adapter[1], folder, adapter=True)


def test_the_cli_exports_an_adapter_checkpoint(dpo_adapter, tmp_path):
    from batchrl.cli.main import main

    assert main(["export", dpo_adapter[1], "--to", str(tmp_path / "m")]) == 0
    assert main(["export", dpo_adapter[1], "--to", str(tmp_path / "a"), "--adapter", "--base-name", "org/base"]) == 0
    assert os.path.exists(tmp_path / "m" / "model.safetensors")
    assert lora.read_adapter_config(str(tmp_path / "a"))["base_model_name_or_path"] == "org/base"
    assert main(["export", dpo_adapter[1], "--to", str(tmp_path / "m")]) == 2  # not empty


def test_full_fine_tuning_continues_from_an_adapter_checkpoint(inputs, dpo_adapter, tmp_path):
    """A chain may switch from LoRA to full fine-tuning: the adapter's model (merged in memory) is trained in full."""
    kw = {k: inputs[k] for k in ("pairs_parquet", "reference_parquet")}
    result = train_dpo(DPOConfig(epochs=1, micro_batch_size=16), model_path=dpo_adapter[1], out_dir=str(tmp_path), **kw)
    assert os.path.exists(os.path.join(result["model_dir"], "model.safetensors")) and "adapter_base" not in result


@pytest.mark.parametrize("engine", ["transformers", "static"])
def test_rollouts_from_base_plus_adapter_equal_the_merged_models(dpo_adapter, merged, engine):
    from batchrl.training.rollout import make_rollout_engine

    prompts = [row["prompt"] for row in ARITH_EVAL[:6]]
    runs = [make_rollout_engine(engine, model_path=path, max_new_tokens=8, temperature=1.0, batch_size=8)
            .generate(prompts, n=2, seed=3) for path in (dpo_adapter[1], merged)]
    assert [s["response_ids"] for s in runs[0]] == [s["response_ids"] for s in runs[1]]
    np.testing.assert_allclose(np.concatenate([s["rollout_logprobs"] for s in runs[0]]),
                               np.concatenate([s["rollout_logprobs"] for s in runs[1]]), rtol=0, atol=1e-5)


def test_evaluation_and_reference_logprobs_from_base_plus_adapter_equal_the_merged_models(inputs, dpo_adapter,
                                                                                          merged, tmp_path,
                                                                                          monkeypatch):
    from batchrl.training.evaluation.evaluate import evaluate_models
    from batchrl.training.rollout import make_rollout_engine

    from batchrl.training.evaluation import evaluate

    pairs, reference = pd.read_parquet(inputs["pairs_parquet"]), pd.read_parquet(inputs["reference_parquet"])
    built = []
    monkeypatch.setattr(evaluate, "make_rollout_engine", lambda *a, **kw: built.append(kw["model_path"]) or
                        make_rollout_engine(*a, **kw))
    options = dict(arith_eval=ARITH_EVAL[:8], pairs=pairs, reference=reference, max_new_tokens=6, max_length=64)
    results = evaluate_models({"base": inputs["model_path"], "adapter": dpo_adapter[1], "merged": merged}, **options)
    assert built == [inputs["model_path"]]  # one engine: the adapter merged into the base's weights in place
    alone = evaluate_models({"adapter": dpo_adapter[1]}, **options)["adapter"]  # its own engine, merged at load
    assert results["adapter"] == results["merged"] == alone != results["base"]
    logps = []
    for name, path in (("adapter", dpo_adapter[1]), ("merged", merged)):
        compute_reference_logprobs(path, inputs["pairs_parquet"], str(tmp_path / f"{name}.parquet"), max_length=64)
        logps.append(pd.read_parquet(tmp_path / f"{name}.parquet"))
    pd.testing.assert_frame_equal(logps[0], logps[1])


def test_reward_model_lora_saves_the_score_head_with_the_adapter_and_scores_like_its_merged_export(inputs, tmp_path):
    from batchrl.training.jobs.export import export_checkpoint
    from batchrl.training.rewards.registry import score_with_reward_model
    from batchrl.training.trainer.reward import train_reward_model

    result = train_reward_model(RewardModelConfig(epochs=3, micro_batch_size=8, lr=1e-2, **LORA),
                                pairs_parquet=inputs["pairs_parquet"], model_path=inputs["model_path"],
                                out_dir=str(tmp_path / "rm"))
    assert np.mean(result["loss_curve"][-3:]) < result["loss_curve"][0]
    assert result["train_loss_after"] < result["train_loss_before"]
    adapter = result["model_dir"]
    assert lora.read_adapter_config(adapter)["task_type"] == "SEQ_CLS"
    assert "base_model.model.score.weight" in load_file(os.path.join(adapter, lora.ADAPTER_WEIGHTS))
    merged = export_checkpoint(adapter, str(tmp_path / "merged"))["path"]
    prompts, responses = [r["prompt"] for r in ARITH[:8]], [r["answer"] for r in ARITH[:8]]
    before = torch.get_rng_state()
    scores = score_with_reward_model(adapter, prompts, responses)
    assert torch.equal(torch.get_rng_state(), before)  # the head initialised before the adapter's: RNG untouched
    np.testing.assert_array_equal(scores, score_with_reward_model(merged, prompts, responses))


def _scored_batch(model_path: str, path, *, seed: int, with_values: bool = False) -> str:
    from batchrl.training.rl.advantages import compute_advantages
    from batchrl.training.rewards.registry import REWARD_FUNCTIONS
    from batchrl.training.rollout import make_rollout_engine

    rows = ARITH[seed * 8:(seed + 1) * 8]
    samples = make_rollout_engine("transformers", model_path=model_path, max_new_tokens=6, temperature=1.0,
                                  batch_size=64).generate([r["prompt"] for r in rows], n=4, seed=seed)
    frame = pd.DataFrame(samples)
    frame["reward"] = [REWARD_FUNCTIONS["arith_partial"](s["prompt"], s["response"], rows[s["prompt_index"]])
                       for s in samples]
    if with_values:
        frame["values"] = [[0.0] * len(s["response_ids"]) for s in samples]
    compute_advantages(frame, "gae" if with_values else "grpo").to_parquet(path)
    return str(path)


def test_policy_chain_of_adapters_with_a_lora_critic(inputs, tmp_path):
    """Two RL iterations with LoRA (GAE, critic): the second trains the first's adapter further on the same frozen
    base, its KL reference comes from the disabled adapter (the base, no second model), and the critic is an
    adapter with its value head."""
    from batchrl.training.models.loading import load_model_and_tokenizer
    from batchrl.training.data.batch_layout import sequence_token_logprobs
    from batchrl.training.trainer.policy import FIXED_LOGPROBS, load_batch, train_policy
    from batchrl.training.models.value_model import load_value_model, predict_values

    base = inputs["model_path"]
    cfg = PolicyConfig(adv_estimator="gae", critic=True, micro_batch_size=16, lr=1e-2, critic_lr=1e-2, kl_loss_coef=0.05,
                       **LORA)
    policy, critic, adapters = base, base, []
    for it in range(2):
        batch = _scored_batch(policy, tmp_path / f"batch{it}.parquet", seed=it, with_values=True)
        result = train_policy(cfg, batch_parquet=batch, model_path=policy, reference_model_path=base,
                              critic_path=critic, out_dir=str(tmp_path / f"it{it}"))
        policy, critic = result["model_dir"], str(tmp_path / f"it{it}" / "critic")
        adapters.append(policy)
        assert result["adapter_base"] == os.path.abspath(base) and np.isfinite(result["loss_curve"]).all()
        assert lora.read_adapter_config(critic)["task_type"] == "TOKEN_CLS"
        assert "base_model.model.score.weight" in load_file(os.path.join(critic, lora.ADAPTER_WEIGHTS))
    assert lora.adapter_base(adapters[1]) == os.path.abspath(base)
    first, second = (load_file(os.path.join(a, lora.ADAPTER_WEIGHTS)) for a in adapters)
    assert first.keys() == second.keys() and any(not torch.equal(first[k], second[k]) for k in first)
    fixed = torch.load(tmp_path / "it1" / FIXED_LOGPROBS, weights_only=False)
    model, tok = load_model_and_tokenizer(base)
    rows = load_batch(str(tmp_path / "batch1.parquet"))
    expected = sequence_token_logprobs(model, rows, tok.pad_token_id, "cpu", temperature=1.0, batch_size=64)
    for got, want in zip(fixed["ref"], expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="this adapter has rank 4"):  # a chain continues its adapter as it is
        train_policy(cfg.model_copy(update={"lora_rank": 8}), batch_parquet=batch, model_path=policy,
                     reference_model_path=base, critic_path=critic, out_dir=str(tmp_path / "other_rank"))
    values = predict_values(critic, pd.read_parquet(tmp_path / "batch1.parquet"))
    assert any(abs(v) > 0 for row in values for v in row)  # the trained head, merged in memory
    assert type(load_value_model(critic)[0]).__name__.endswith("ForTokenClassification")


def test_killed_lora_job_resumes_to_the_uninterrupted_adapter(inputs, tmp_path):
    from batchrl.training.jobs import job_command

    trainer = {"epochs": 4, "micro_batch_size": 8, "save_every": 1, "lr": 1e-2, **LORA}
    kw = {k: inputs[k] for k in ("pairs_parquet", "reference_parquet", "model_path")}
    full = train_dpo(DPOConfig(**trainer), out_dir=str(tmp_path / "full"), **kw)
    config = tmp_path / "dpo.json"
    config.write_text(json.dumps({"trainer": trainer, "out_dir": str(tmp_path / "cut"), **kw}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    proc = subprocess.Popen(job_command("train_dpo", str(config), num_gpus=1), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest, deadline = tmp_path / "cut" / "checkpoints" / "latest", time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and int(latest.read_text().split("_")[1]) >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "job finished before it could be killed"
    tag = tmp_path / "cut" / "checkpoints" / latest.read_text()
    saved = sum(f.stat().st_size for f in tag.rglob("*model_states.pt"))
    assert saved < os.path.getsize(os.path.join(inputs["model_path"], "model.safetensors")) / 2  # no frozen base
    rerun = subprocess.run(job_command("train_dpo", str(config), num_gpus=1), env=env, capture_output=True, text=True,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    meta = [json.loads(x) for x in rerun.stdout.splitlines() if x.startswith('{"materialization"')][-1]["materialization"]
    assert meta["resumed_from_step"] >= 3 and meta["global_step"] == full["global_step"]
    assert meta["loss_curve"] == pytest.approx(full["loss_curve"], abs=1e-6)
    a, b = (load_file(os.path.join(d, "model", lora.ADAPTER_WEIGHTS)) for d in (tmp_path / "full", tmp_path / "cut"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


def test_lora_under_zero3_resumes_to_the_zero0_adapter(inputs, tmp_path):
    """ZeRO-3 partitions the frozen base too: the adapter is gathered for its export, and a run stopped after a
    checkpoint (adapters + optimiser state only) resumes to what one ZeRO-0 run trains."""
    kw = {k: inputs[k] for k in ("pairs_parquet", "reference_parquet", "model_path")}
    cfg = DPOConfig(epochs=1, micro_batch_size=8, lr=1e-2, save_every=2, **LORA)
    plain = train_dpo(cfg, out_dir=str(tmp_path / "z0"), **kw)
    zero3 = cfg.model_copy(update={"zero_stage": 3})
    assert train_dpo(zero3.model_copy(update={"stop_after_steps": 3}), out_dir=str(tmp_path / "z3"), **kw)["stopped_early"]
    resumed = train_dpo(zero3, out_dir=str(tmp_path / "z3"), **kw)
    assert resumed["resumed_from_step"] == 3 and resumed["loss_curve"] == pytest.approx(plain["loss_curve"], abs=1e-6)
    a, b = (load_file(os.path.join(r["model_dir"], lora.ADAPTER_WEIGHTS)) for r in (plain, resumed))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5, rtol=0) for k in a)


def test_kto_lora_trains_an_adapter(inputs, tmp_path):
    from batchrl.training.trainer.config import KTOConfig
    from batchrl.training.trainer.kto import train_kto

    rows = [{"prompt": f"What is {a} + {a}?", "completion": c, "label": up}
            for a in range(1, 9) for c, up in ((str(2 * a), True), (f"{2 * a + 1} I think", False))]
    pd.DataFrame(rows).to_parquet(tmp_path / "feedback.parquet")
    result = train_kto(KTOConfig(epochs=3, micro_batch_size=8, lr=1e-2, beta=0.5, **LORA),
                       feedback_parquet=str(tmp_path / "feedback.parquet"), model_path=inputs["model_path"],
                       out_dir=str(tmp_path / "kto"))
    assert np.mean(result["loss_curve"][-2:]) < result["loss_curve"][0]
    assert lora.is_adapter_folder(result["model_dir"]) and result["adapter_base"] == os.path.abspath(inputs["model_path"])
