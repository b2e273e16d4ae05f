"""The resident-policy loop (issue 32): in the job worker with its weight cache on, the rollout engine stays from one
iteration to the next and samples the trainer's weights copied in from the device (training/rollout/resident.py,
training/models/resident_weights.py), not reloaded from the export. Two RL iterations so give the same data versions and the same
loss curves as the loop that loads every stage's model from the published files (the cache off), for a fixed seed.
"""
from __future__ import annotations

from pipeline_helpers import RL_LOOP, SMALL, stop_workers, two_rl_iterations

from batchrl.training.trainer import resident_trainer

def test_resident_loop_gives_the_data_versions_and_loss_curves_of_the_loop_that_loads_from_files(tmp_path,
                                                                                                upstream_copy):
    histories = {gb: two_rl_iterations(*upstream_copy(tmp_path / f"cache{gb}"), gb, upstream_built=True)
                 for gb in ("1", "0")}
    resident, from_files = histories["1"], histories["0"]
    try:
        for stage in RL_LOOP:
            assert [m["data_version"] for m in resident[stage]] == [m["data_version"] for m in from_files[stage]], stage
            assert len(resident[stage]) == 2
        for got, want in zip(resident["policy_checkpoint"], from_files["policy_checkpoint"]):
            assert got["loss_curve"] == want["loss_curve"] and len(got["loss_curve"]) > 1
        # iteration 1 samples the base model in a new engine; iteration 2 the same engine, the trainer's weights
        # copied in from the device (a hit of the weight cache), not read from the published export
        assert [m["engine_reused"] for m in resident["rollouts"]] == [False, True]
        assert int(resident["rollouts"][1]["weight_cache_hits"]) >= 1  # recorded as text
        assert [m["resident_weights"] for m in resident["policy_checkpoint"]] == [True, True]
        # the second update trains the first one's engine, kept in the worker (resident_trainer), same results
        assert [m["trainer_reused"] for m in resident["policy_checkpoint"]] == [False, True]
        assert not any(m["trainer_reused"] for m in from_files["policy_checkpoint"])
        assert not any(m["engine_reused"] for m in from_files["rollouts"])
        assert not any(m["resident_weights"] for m in from_files["policy_checkpoint"])
    finally:
        stop_workers(histories)


def test_a_lora_policy_trainer_kept_in_the_worker_gives_the_adapters_of_fresh_jobs(tmp_path, upstream_copy):
    """LoRA (adapter artifacts, the reference = the base with the adapter off): the second update takes over the
    first one's PEFT model and engine and publishes the adapter a fresh job would (same data versions, curves) —
    with the kept engine renewed, and with a new engine built around the kept module (what a bf16 engine gets).
    The second update takes up the first one's AdamW state from its published adapter (``carry_optimizer_state``)
    into the kept engine's new optimiser as a fresh job does."""
    # dropout on the adapters: the kept trainer's steps draw the random stream a fresh job's do
    adapter = {"micro_batch_size": 4, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.1, "lr": 1.0e-3,
               "carry_optimizer_state": True}
    lora = {**SMALL, "ops": {**SMALL["ops"], "policy_checkpoint": {"config": adapter}}}
    variants = {"renewed": ("1", {}), "rebuilt": ("1", {resident_trainer.REBUILD_ENV: "1"}), "files": ("0", {})}
    histories = {name: two_rl_iterations(*upstream_copy(tmp_path / name), gb, lora, env, upstream_built=True)
                 for name, (gb, env) in variants.items()}
    from_files = histories["files"]
    try:
        for name in ("renewed", "rebuilt"):
            resident = histories[name]
            for stage in RL_LOOP:
                assert [m["data_version"] for m in resident[stage]] == \
                    [m["data_version"] for m in from_files[stage]], (name, stage)
            assert [m["loss_curve"] for m in resident["policy_checkpoint"]] == \
                [m["loss_curve"] for m in from_files["policy_checkpoint"]], name
            assert [m["trainer_reused"] for m in resident["policy_checkpoint"]] == [False, True], name
            carried = [m["optimizer_state"] for m in resident["policy_checkpoint"]]
            steps = resident["policy_checkpoint"][0]["optimizer_state_step"]
            assert carried[0].startswith("new:") and carried[1] == f"carried from step {steps}" and steps > 0, name
        assert not any(m["trainer_reused"] for m in from_files["policy_checkpoint"])
    finally:
        stop_workers(histories)


def test_kept_engine_is_reused_only_for_the_same_settings_and_model_and_within_its_limit(arith_job_inputs,
                                                                                         monkeypatch):
    from batchrl.training.models import weight_cache
    from batchrl.training.rollout import resident as engines

    options = {"kind": "transformers", "model_path": arith_job_inputs["model_path"], "max_new_tokens": 4,
               "temperature": 1.0, "top_p": 1.0, "batch_size": 4, "device": "cpu", "dtype": "float32"}
    engine, reused = engines.engine_for(options)  # the cache off (as in the Dagster process): never kept
    assert not reused and not engines.keep(options, engine)
    weight_cache.enable(10**9)
    try:
        monkeypatch.setenv(engines.ENV, "0")
        assert not engines.keep(options, engine)  # over its limit
        monkeypatch.setenv(engines.ENV, "1")
        assert engines.keep(options, engine)
        again, reused = engines.engine_for(options)
        assert reused and again is engine
        other, reused = engines.engine_for({**options, "batch_size": 8})  # other settings: a new engine
        assert not reused and other is not engine
    finally:
        engines.release()
        weight_cache.disable()
        weight_cache.clear()
