"""A vLLM engine kept in the job worker (``rollout_engine.vllm_resident``): the resource's rule and the resident
protocol an engine with ``suspend`` / ``load_checkpoint`` / ``shutdown`` goes through (training/rollout/resident.py).

vLLM does not run on a machine without a GPU: the protocol is driven here by the real transformers engine with those
three methods added (the weights copied in by ``load_checkpoint_in_place``), registered under the ``vllm`` kind for
the test; vLLM's own methods run on the GPU host (bench_gpu_rl_vs_trl.py's ``vllm_resident`` arm)."""
from __future__ import annotations

import shutil

import pytest

from batchrl.resources.rollout import RolloutEngineResource
from batchrl.training.models import weight_cache
from batchrl.training.rollout import ROLLOUT_ENGINES, TransformersRolloutEngine, resident


class SleepingEngine(TransformersRolloutEngine):
    def __init__(self, model_path: str, *, sleep_mode: bool = False, **kwargs):
        super().__init__(model_path, **kwargs)
        self.calls: list[str] = []

    def suspend(self) -> None:
        self.calls.append("suspend")

    def load_checkpoint(self, model_path: str) -> bool:
        from batchrl.training.models.loading import load_checkpoint_in_place

        self.calls.append(f"load {model_path}")
        return load_checkpoint_in_place(self.model, model_path, dtype="float32", device="cpu")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.fixture
def sleeping_vllm(monkeypatch):
    monkeypatch.setitem(ROLLOUT_ENGINES, "vllm", SleepingEngine)
    weight_cache.enable(10**9)  # as in the job worker
    yield
    resident.release()
    weight_cache.disable()


def test_vllm_resident_needs_vllm_in_a_job_process():
    options = RolloutEngineResource(kind="vllm", in_subprocess=True, vllm_resident=True).engine_options("/m", "/c")
    assert options["sleep_mode"] is True and options["kind"] == "vllm"
    assert "sleep_mode" not in RolloutEngineResource(kind="vllm", in_subprocess=True).engine_options("/m", "/c")
    for bad in ({"kind": "static", "in_subprocess": True}, {"kind": "vllm", "in_subprocess": False}):
        with pytest.raises(ValueError, match="vllm_resident needs kind: vllm and in_subprocess: true"):
            RolloutEngineResource(vllm_resident=True, **bad)


def test_a_sleeping_engine_is_kept_asleep_and_takes_the_next_checkpoint(sleeping_vllm, arith_model, tmp_path):
    options = {"kind": "vllm", "model_path": arith_model, "max_new_tokens": 4, "sleep_mode": True}
    engine, reused = resident.engine_for(options)
    assert not reused
    first = engine.generate(["1 + 2 ="], n=2, seed=0)
    assert resident.keep(options, engine) and engine.calls == ["suspend"]
    nxt = str(tmp_path / "next")  # the next iteration's checkpoint of the same model
    shutil.copytree(arith_model, nxt)
    again, reused = resident.engine_for({**options, "model_path": nxt})
    assert again is engine and reused and engine.calls == ["suspend", f"load {nxt}"]
    assert again.generate(["1 + 2 ="], n=2, seed=0) == first  # the same weights copied in: the same samples
    resident.release()
    assert engine.calls[-1] == "shutdown"


def test_without_sleep_mode_each_job_gets_its_own_vllm_engine(sleeping_vllm, arith_model):
    options = {"kind": "vllm", "model_path": arith_model, "max_new_tokens": 4}
    engine, reused = resident.engine_for(options)
    assert not reused and not resident.keep(options, engine) and engine.calls == []
    assert resident.engine_for(options)[0] is not engine
