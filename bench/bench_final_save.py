"""What the end of a training job costs: a full engine checkpoint at the last step (the trainer before) vs
the HF export plus a completion record (now), and re-running a finished job, on the Qwen2-0.5B shape.

    .venv/bin/python bench/bench_final_save.py [--layers 24] [--pairs 8]

CPU, DeepSpeed ZeRO-0 with gloo, fp32 weights + AdamW (the trainer's CPU layout; on a GPU under
``bf16_amp`` the layout is the same: fp32 weights, two fp32 Adam moments). One short DPO epoch, then:
- ``before``: ``save_every`` = the last step, which writes exactly what the trainer wrote at the end
  before this change (engine + optimiser + RNG), and the export;
- ``after``: the default: the export and ``checkpoints/completed.json`` only;
- a first job before both (warm-up: first-call costs in neither figure);
- re-runs of the finished job: before, a resume from the final checkpoint (engine built, checkpoint
  loaded, after-training margins, export again); now, the completion record read back.
Seconds are wall time of the whole ``train_dpo`` call; bytes are what the job left on disk.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _timed(fn) -> tuple[float, dict]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    import pandas as pd
    from qwen_shape import build

    import batchrl.training.trainer.loop as loop_module
    from batchrl.training.trainer.config import DPOConfig
    from batchrl.training.trainer.dpo import train_dpo
    from batchrl.training.trainer.reference import compute_reference_logprobs

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "final_save.json"))
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="final_save_", dir=os.environ.get("BENCH_TMP"))
    try:
        model = build(os.path.join(work, "model"), layers=args.layers, dtype="float32")
        rows = [{"id": str(i), "prompt": f"What is {i} + {i}?", "chosen": str(2 * i), "rejected": str(2 * i + 1)}
                for i in range(args.pairs)]
        pd.DataFrame(rows).to_parquet(os.path.join(work, "pairs.parquet"))
        kw = dict(pairs_parquet=os.path.join(work, "pairs.parquet"), model_path=model,
                  reference_parquet=os.path.join(work, "ref.parquet"))
        compute_reference_logprobs(model, kw["pairs_parquet"], kw["reference_parquet"], max_length=32)
        cfg = DPOConfig(epochs=1, micro_batch_size=2, grad_accum=1, max_length=32)
        steps = args.pairs // 2
        results = {"layers": args.layers, "pairs": args.pairs, "steps": steps}
        saves: list[float] = []
        save = loop_module.save_checkpoint

        def timed_save(*a, **k):  # instrumentation only: the engine checkpoint's own time
            seconds, path = _timed(lambda: save(*a, **k))
            saves.append(seconds)
            return path

        loop_module.save_checkpoint = timed_save
        train_dpo(cfg, out_dir=os.path.join(work, "warm-up"), **kw)  # first-call costs out of both figures
        for name, config in (("before", cfg.model_copy(update={"save_every": steps})), ("after", cfg)):
            out = os.path.join(work, name)
            saves.clear()
            seconds, result = _timed(lambda: train_dpo(config, out_dir=out, **kw))
            results[name] = {"job_s": round(seconds, 2), "train_loop_s": result["wall_s"],
                             "engine_checkpoint_s": round(sum(saves), 2),
                             "checkpoint_bytes": _bytes(os.path.join(out, "checkpoints")),
                             "export_bytes": _bytes(os.path.join(out, "model"))}
            if name == "before":  # the old re-run: no completion record, resume from the final checkpoint
                os.unlink(os.path.join(out, "checkpoints", "completed.json"))
            seconds, again = _timed(lambda: train_dpo(config, out_dir=out, **kw))
            results[name]["rerun_s"] = round(seconds, 2)
            results[name]["rerun_reused_record"] = bool(again.get("completed_earlier"))
            print(name, results[name], flush=True)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(json.dumps(results))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
