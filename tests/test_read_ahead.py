"""Evaluation's read-ahead of later checkpoints' weights (training/evaluation/evaluate.py ``_ReadAhead``): LoRA
adapters of one base share one read of the base, and nothing is read ahead where the host lacks room for it (at
1.5B, four adapters' base weights read at once took 28 GB of a 24 GB box and the run was killed)."""
import json
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import save_file

from batchrl.training.evaluation import evaluate as evaluate_module


def _folders(tmp_path):
    base = tmp_path / "base_model" / "v1"
    base.mkdir(parents=True)
    (base / "config.json").write_text("{}")
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(base / "model.safetensors"))
    adapters = []
    for name in ("dpo", "policy"):
        folder = tmp_path / name / "v1"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
        adapters.append(str(folder))
    other = tmp_path / "other" / "v1"  # a full checkpoint of its own
    other.mkdir(parents=True)
    (other / "config.json").write_text("{}")
    save_file({"w": torch.ones(1000)}, str(other / "model.safetensors"))
    return str(base), adapters, str(other)


def test_adapters_of_one_base_share_one_read_of_it(tmp_path, monkeypatch):
    _, (dpo, policy), other = _folders(tmp_path)
    reads = []
    real_read = evaluate_module.read_weights
    monkeypatch.setattr(evaluate_module, "read_weights", lambda path: reads.append(path) or real_read(path))
    with ThreadPoolExecutor(2) as reader:
        ahead = evaluate_module._ReadAhead(reader)
        for path in (dpo, policy, other):
            ahead.read(path)
        assert dpo in ahead and policy in ahead and other in ahead
        first, second = ahead.pop(dpo), ahead.pop(policy)
        assert first is second and reads.count(dpo) + reads.count(policy) == 1  # the base, read once
        assert torch.equal(first.result()["w"], torch.arange(1000, dtype=torch.float32))
        assert not any(ahead.reads[files][0] is first for files in ahead.reads)  # dropped once both took it
        assert torch.equal(ahead.pop(other).result()["w"], torch.ones(1000))
        assert ahead.pop(other) is None and not ahead.reads


def test_nothing_is_read_ahead_without_room_for_it_twice(tmp_path, monkeypatch):
    base, (dpo, _), other = _folders(tmp_path)
    size = os.path.getsize(os.path.join(base, "model.safetensors"))
    reads = []
    monkeypatch.setattr(evaluate_module, "read_weights", lambda path: reads.append(path) or {})
    monkeypatch.setattr(evaluate_module, "host_memory_available", lambda: 2 * size - 1)
    with ThreadPoolExecutor(1) as reader:
        ahead = evaluate_module._ReadAhead(reader)
        ahead.read(dpo)
        assert dpo not in ahead and ahead.pop(dpo) is None and not reads  # loaded from its files when its turn comes
        monkeypatch.setattr(evaluate_module, "host_memory_available", lambda: 2 * size)
        ahead.read(dpo)
        assert dpo in ahead and ahead.pop(dpo).result() == {} and reads == [dpo]
