"""The job worker's weight cache (``training/models/weight_cache.py``): a model built from cached weights is the model
the files give, bit for bit; the cache is never aliased by a loaded model; a rewritten weight file is a miss;
entries are evicted least-recently-used by bytes; and it is off unless a process switches it on."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchrl.training.models import weight_cache
from batchrl.training.models.loading import load_model_and_tokenizer
from batchrl.training.models.tiny import build_tiny_model

ARITH = Path(__file__).resolve().parents[1] / "sample_data" / "arith"
TEXTS = [f"{r['prompt']} {r['answer']}" for r in map(json.loads, (ARITH / "train.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return build_tiny_model(TEXTS, str(tmp_path_factory.mktemp("untied") / "model"), seed=0, hidden_size=64,
                            intermediate_size=128)["path"]


def _tied_copy(src: str, dst: str, seed: int = 1) -> str:
    """``src``'s tokenizer and config, tied input/output embeddings (as Qwen2-0.5B), other seeded weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    config = AutoConfig.from_pretrained(src)
    config.tie_word_embeddings = True
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def tied(untied, tmp_path_factory):
    return _tied_copy(untied, str(tmp_path_factory.mktemp("tied") / "model"))


@pytest.fixture(autouse=True)
def cache_off_after():
    weight_cache.clear()
    yield
    weight_cache.disable()
    weight_cache.clear()


def _uncached(path, dtype="float32"):
    assert not weight_cache.enabled()
    return load_model_and_tokenizer(path, dtype=dtype)[0]


def _tensors(model) -> dict[str, torch.Tensor]:
    return {**model.state_dict(), **dict(model.named_buffers())}


def _assert_same_model(got, want):
    assert type(got) is type(want) and not got.training
    assert got.config.to_dict() == want.config.to_dict()
    assert got.generation_config.to_dict() == want.generation_config.to_dict()
    mine, theirs = _tensors(got), _tensors(want)
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        assert mine[name].dtype == value.dtype and torch.equal(mine[name], value), name
    tied = lambda m: m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert tied(got) == tied(want)
    assert [p.requires_grad for p in got.parameters()] == [p.requires_grad for p in want.parameters()]
    ids = torch.randint(0, want.config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a left-padded row
    with torch.no_grad():
        assert torch.equal(got(ids, attention_mask=mask).logits, want(ids, attention_mask=mask).logits)
    generated = [m.generate(ids[:1], max_new_tokens=6, do_sample=False) for m in (got, want)]
    assert torch.equal(*generated)


@pytest.mark.parametrize("which, dtype", [("untied", "float32"), ("tied", "float32"), ("tied", "bfloat16")])
def test_a_hit_is_the_model_the_files_give_and_reads_no_file(which, dtype, untied, tied, monkeypatch):
    from transformers import AutoModelForCausalLM

    path = {"untied": untied, "tied": tied}[which]
    want = _uncached(path, dtype)
    weight_cache.enable(10**9)
    first = load_model_and_tokenizer(path, dtype=dtype)[0]  # miss: loaded, a copy kept
    assert weight_cache.stats()["entries"] == 1 and weight_cache.stats()["misses"] == 1
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("a hit must not load from the files")))
    got = load_model_and_tokenizer(path, dtype=dtype)[0]
    stats = weight_cache.stats()
    assert stats["hits"] == 1 and stats["fallbacks"] == 0
    _assert_same_model(got, want)
    _assert_same_model(first, want)
    kept = weight_cache.stats()["bytes"]  # tied embeddings are kept once
    unique = {t.data_ptr(): t.nbytes for t in want.state_dict().values()}
    assert kept == sum(unique.values()) + sum(b.nbytes for n, b in want.named_buffers() if n not in want.state_dict())


def test_the_cache_is_not_aliased_by_the_models_it_builds(untied, tmp_path):
    from safetensors.torch import load_file, save_file

    from batchrl.training.models.weights import load_weights_in_place

    want = _uncached(untied)
    weight_cache.enable(10**9)
    loaded = load_model_and_tokenizer(untied)[0]  # miss
    with torch.no_grad():
        for p in loaded.parameters():
            p.add_(1.0)  # trained in place
    hit = load_model_and_tokenizer(untied)[0]
    _assert_same_model(hit, want)
    with torch.no_grad():
        for _, b in hit.named_buffers():
            b.mul_(2)  # rotary inv_freq: restored from the cache, not shared with it
    # evaluation's pattern: the next checkpoint copied into the loaded model
    other = shutil.copytree(untied, tmp_path / "next")
    save_file({k: -v for k, v in load_file(other / "model.safetensors").items()}, str(other / "model.safetensors"),
              metadata={"format": "pt"})
    assert load_weights_in_place(hit, str(other))
    assert torch.equal(hit.lm_head.weight, -want.lm_head.weight)
    again = load_model_and_tokenizer(untied)[0]
    assert weight_cache.stats()["hits"] == 2
    _assert_same_model(again, want)


def test_a_rewritten_weight_file_is_a_miss_and_its_weights_load_even_with_its_old_mtime(untied, tmp_path):
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(untied, tmp_path / "model")
    weight_cache.enable(10**9)
    before = load_model_and_tokenizer(str(path))[0].lm_head.weight.detach().clone()  # (a CPU load maps the file)
    file = path / "model.safetensors"
    stamp = os.stat(file)
    new = {k: v + 0.5 for k, v in load_file(file).items()}
    save_file(new, str(tmp_path / "new.safetensors"), metadata={"format": "pt"})  # same names and shapes: same size
    with open(file, "r+b") as f:  # written over in place (same inode), its old mtime put back (`cp -p`, copy2)
        f.write((tmp_path / "new.safetensors").read_bytes())
    os.utime(file, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    after_stat = os.stat(file)
    if after_stat.st_ctime_ns == stamp.st_ctime_ns and after_stat.st_ino == stamp.st_ino:
        pytest.skip("the file system did not tell the rewrite apart (timestamp granularity)")
    after = load_model_and_tokenizer(str(path))[0]
    stats = weight_cache.stats()
    assert stats["hits"] == 0 and stats["misses"] == 2
    state = after.state_dict()
    assert all(torch.equal(state[k], v) for k, v in new.items())
    assert not torch.equal(after.lm_head.weight, before)
    hit = load_model_and_tokenizer(str(path))[0]  # the rewritten file's weights, now cached
    assert weight_cache.stats()["hits"] == 1
    _assert_same_model(hit, after)


def _module(n: int, dtype=torch.float32) -> torch.nn.Module:
    """A module of ``n`` float32 weights (4 n bytes) and a non-persistent buffer of 4 bytes."""
    module = torch.nn.Linear(n, 1, bias=False)
    module.register_buffer("scale", torch.ones(1), persistent=False)
    return module.to(dtype)


def test_least_recently_used_entries_are_evicted_by_bytes():
    entry = lambda: weight_cache.snapshot(_module(249))  # 996 + 4 bytes
    assert entry().nbytes == 1000
    weight_cache.enable(2500)
    assert weight_cache.put("a", entry()) and weight_cache.put("b", entry())
    assert weight_cache.get("a") is not None  # a is now the most recently used
    assert weight_cache.put("c", entry())
    assert weight_cache.get("b") is None and weight_cache.get("a") is not None and weight_cache.get("c") is not None
    assert weight_cache.stats()["evictions"] == 1 and weight_cache.stats()["bytes"] == 2000
    assert not weight_cache.put("big", weight_cache.snapshot(_module(1000)))  # larger than the limit: not kept
    assert weight_cache.stats()["entries"] == 2 and weight_cache.get("big") is None
    weight_cache.enable(1500)  # a smaller limit evicts at once (c is the more recent)
    assert weight_cache.get("a") is None and weight_cache.get("c") is not None
    weight_cache.disable()
    assert weight_cache.stats()["entries"] == 0 and not weight_cache.put("d", entry())


def test_a_model_larger_than_the_limit_is_loaded_and_not_kept(untied):
    want = _uncached(untied)
    weight_cache.enable(1000)
    model = load_model_and_tokenizer(untied)[0]
    stats = weight_cache.stats()
    assert stats["entries"] == 0 and stats["not_kept"] == 1 and stats["misses"] == 1
    _assert_same_model(model, want)


def test_an_entry_that_does_not_fit_the_built_model_falls_back_to_the_load_and_is_dropped():
    weight_cache.enable(10**6)
    source = _module(8)
    loads = []
    load = lambda: loads.append(1) or source
    copy_state = lambda m, tensors: m.load_state_dict(tensors) is not None
    _, hit = weight_cache.load("k", build=lambda e: _module(8), load=load, copy_state=copy_state)
    assert not hit and loads == [1]
    model, hit = weight_cache.load("k", build=lambda e: _module(8), load=load, copy_state=copy_state)
    assert hit and loads == [1] and torch.equal(model.weight, source.weight)
    assert model.weight.data_ptr() != weight_cache.get("k").tensors["weight"].data_ptr()
    # a build that does not match (another dtype): the entry is dropped, the load runs, nothing kept again
    _, hit = weight_cache.load("k", build=lambda e: _module(8, torch.float64), load=load, copy_state=copy_state)
    assert not hit and loads == [1, 1] and weight_cache.stats()["fallbacks"] == 1
    assert weight_cache.get("k") is None


def test_the_key_follows_the_files_dtype_and_device(untied, tmp_path):
    files = [os.path.join(untied, "model.safetensors")]
    key = lambda **k: weight_cache.key(files, **{"dtype": torch.float32, "device": "cpu", **k})
    assert key() == key() and key() != key(dtype=torch.bfloat16)
    assert weight_cache.key([], dtype=torch.float32, device="cpu") is None
    assert weight_cache.key([str(tmp_path / "missing.safetensors")], dtype=torch.float32, device="cpu") is None
    link = tmp_path / "link.safetensors"
    link.symlink_to(files[0])
    assert weight_cache.key([str(link)], dtype=torch.float32, device="cpu") == key()  # the real file counts
    config = tmp_path / "config.json"
    config.write_text("{}")
    assert key(other_files=(str(config),)) != key()
    weight_cache.enable(10**6, host=False)  # the worker on a CUDA host keeps GPU models only
    assert key() is None


def test_the_worker_limit_follows_the_setting():
    assert weight_cache.worker_limit_bytes({"BATCHRL_WEIGHT_CACHE_GB": "1.5"}) == 1_500_000_000
    assert weight_cache.worker_limit_bytes({"BATCHRL_WEIGHT_CACHE_GB": "0"}) == 0
    default = weight_cache.worker_limit_bytes({})
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        assert 0 < default <= min(4 * 10**9, 0.1 * total)
    else:
        assert default == 0  # a host without CUDA: off unless asked for


def test_off_in_a_normal_process(untied):
    """A process that does not switch it on (the Dagster process, a job in a process of its own) keeps nothing."""
    code = ("from batchrl.training.models import weight_cache; from batchrl.training.models.loading import "
            f"load_model_and_tokenizer as load; load({untied!r}); load({untied!r}); print(weight_cache.stats())")
    env = {k: v for k, v in os.environ.items() if k != "BATCHRL_WEIGHT_CACHE_GB"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    stats = eval(out.strip().splitlines()[-1])
    assert stats["limit_bytes"] == 0 and stats["entries"] == 0 and stats["hits"] == stats["misses"] == 0


def test_a_reward_model_comes_from_the_cache_and_a_head_its_files_lack_is_not_kept(untied, tmp_path):
    """Reward scoring (``rewards``, then ``evaluation``) loads the trained reward model again: a hit scores as
    the files do. A base model's folder loaded as a reward model gets a head initialised at load: not kept, so
    no later load is handed that load's random head."""
    import numpy as np
    from transformers import AutoModelForSequenceClassification

    from batchrl.training.rewards.reward_model import load_reward_model, score_texts

    rm = str(tmp_path / "rm")
    torch.manual_seed(3)
    AutoModelForSequenceClassification.from_pretrained(untied, num_labels=1).save_pretrained(rm)
    shutil.copytree(untied, rm, ignore=shutil.ignore_patterns("*.safetensors", "config.json"), dirs_exist_ok=True)
    prompts, responses = ["1 + 1 =", "2 + 3 =", "4 + 4 ="], [" 2", " 7", " 8"]
    model, tokenizer = load_reward_model(rm)
    want = score_texts(model, tokenizer, prompts, responses)
    weight_cache.enable(10**9, host=True)
    load_reward_model(rm)
    assert weight_cache.stats()["entries"] == 1
    model, tokenizer = load_reward_model(rm)
    assert weight_cache.stats()["hits"] == 1
    np.testing.assert_array_equal(score_texts(model, tokenizer, prompts, responses), want)
    base_as_rm = score_texts(*load_reward_model(untied), prompts, responses)
    assert weight_cache.stats()["entries"] == 1  # the reward model's only
    again = score_texts(*load_reward_model(untied), prompts, responses)
    assert weight_cache.stats()["hits"] == 1 and not np.array_equal(again, base_as_rm)  # a head of its own


def _assert_same_weights(got, want):
    """The engine keeps its own config (the base's path in it): its weights and outputs are the checkpoint's."""
    mine, theirs = _tensors(got), _tensors(want)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], v) for n, v in theirs.items())


def test_a_checkpoint_copied_into_a_loaded_model_comes_from_the_cache_once_kept(untied, tmp_path, monkeypatch):
    """Evaluation copies each checkpoint of one model into the engine it loaded (its CUDA graphs stay valid): the
    first copy of a folder reads its files and keeps it; the next job's copy of it reads no file."""
    from safetensors.torch import load_file, save_file

    from batchrl.training.models import weights
    from batchrl.training.models.loading import cached_in_worker, load_checkpoint_in_place

    other = shutil.copytree(untied, tmp_path / "trained")
    save_file({k: v * 0.5 for k, v in load_file(other / "model.safetensors").items()}, str(other / "model.safetensors"),
              metadata={"format": "pt"})
    want = _uncached(str(other))
    weight_cache.enable(10**9)
    engine_model = load_model_and_tokenizer(untied)[0]  # a miss: the base model, kept
    assert not cached_in_worker(str(other), dtype="float32", device="cpu")
    assert load_checkpoint_in_place(engine_model, str(other), dtype="float32", device="cpu")
    _assert_same_weights(engine_model, want)
    assert cached_in_worker(str(other), dtype="float32", device="cpu") and weight_cache.stats()["misses"] == 2
    next_job = load_model_and_tokenizer(untied)[0]  # the next evaluation: base from the cache (hit 1) ...
    import safetensors

    def no_file(*args, **kwargs):
        raise AssertionError("a weight file was read")

    monkeypatch.setattr(safetensors, "safe_open", no_file)  # ... and no file read for the checkpoint
    monkeypatch.setattr(weights, "read_weights", no_file)
    assert load_checkpoint_in_place(next_job, str(other), dtype="float32", device="cpu")
    assert weight_cache.stats()["hits"] == 2
    _assert_same_weights(next_job, want)
    with torch.no_grad():
        next_job.lm_head.weight.add_(1.0)  # the engine's copy is its own: the cache is untouched
    assert load_checkpoint_in_place(load_model_and_tokenizer(untied)[0], str(other), dtype="float32", device="cpu")
    cached = load_model_and_tokenizer(str(other))[0]
    _assert_same_model(cached, want)


def test_a_load_not_worth_keeping_evicts_nothing(untied):
    """The 7B-shape RL iteration (LoRA reward model on the base's folder): the reward model's load (a head the
    base's files lack) must not push the policy's base out of a cache that holds one model (measured: the base
    reloaded by every policy update, 2.5 s an iteration)."""
    from batchrl.training.rewards.reward_model import load_reward_model

    base = _uncached(untied)
    nbytes = weight_cache.snapshot(base).nbytes
    weight_cache.enable(nbytes + nbytes // 2, host=True)  # room for the base, not for the base and a classifier
    load_model_and_tokenizer(untied)
    assert weight_cache.stats()["entries"] == 1
    load_reward_model(untied)  # from the same folder: its head initialised at load, not kept
    stats = weight_cache.stats()
    assert stats["entries"] == 1 and stats["evictions"] == 0 and stats["not_kept"] == 1
    _assert_same_model(load_model_and_tokenizer(untied)[0], base)
    assert weight_cache.stats()["hits"] == 1


def test_a_reward_models_adapter_is_kept_merged_and_scores_as_its_files_do(untied, tmp_path):
    """A LoRA reward model (adapter + its own head, ``modules_to_save``) on the base's folder: the merged model is
    kept under the adapter's and the base's files (rewards, then evaluation, load it again: 3.1 s at the 7B
    shape); the base loaded as a classifier on the way (a random head) is not."""
    import numpy as np
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from batchrl.training.models import lora
    from batchrl.training.rewards.reward_model import load_reward_model, score_texts
    from batchrl.training.models.loading import load_tokenizer

    torch.manual_seed(5)
    model = get_peft_model(AutoModelForSequenceClassification.from_pretrained(untied, num_labels=1),
                           LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "score" in name:
                p.normal_()
    adapter = lora.save_adapter(model, str(tmp_path / "rm"), untied)
    assert lora.read_adapter_config(adapter)["modules_to_save"] and not lora.merges_in_place(adapter)
    tokenizer = load_tokenizer(untied)
    prompts, responses = ["1 + 1 =", "2 + 3 =", "4 + 4 ="], [" 2", " 7", " 8"]
    score = lambda: score_texts(load_reward_model(adapter, tokenizer=tokenizer)[0], tokenizer, prompts, responses)  # noqa: E731
    want = score()
    weight_cache.enable(10**9, host=True)
    np.testing.assert_array_equal(score(), want)
    assert weight_cache.stats()["entries"] == 1 and weight_cache.stats()["hits"] == 0  # the merged model only
    np.testing.assert_array_equal(score(), want)
    assert weight_cache.stats()["hits"] == 1
