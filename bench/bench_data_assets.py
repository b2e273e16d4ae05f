"""The data assets as they run: one log drop's Dagster run (raw_logs, cleaned_logs, validated_preferences
and their blocking checks, one pass) on the 1M-row JSONL of bench_ingest.py, next to the bare library
call (``ingest_logs``) on the same file.

    .venv/bin/python bench/bench_data_assets.py               # 3 rounds, interleaved; medians
    .venv/bin/python bench/bench_data_assets.py --repeat 1 --rows 100000
    .venv/bin/python bench/bench_data_assets.py --baseline /tmp/before   # /tmp/before/batchrl -> an older checkout

Contenders, each in its own child process, one after the other:
- ``assets``: the run a new drop's sensor request (or a backfill) launches: ``execute_in_process`` of the
  per-drop step with its partition key on a local instance and storage root (the drop registered first);
  the input is hashed for the manifest, the outputs are published (content hash, lineage, catalog row).
- ``library``: ``ingest_logs(keep_cleaned=False)`` alone, input not hashed (bench_ingest.py's batchrl).
- ``before`` (with ``--baseline``): the data assets of an older checkout, unpartitioned, two stages with
  cleaned.parquet in between (``execute_assets`` of raw_logs, cleaned_logs, validated_preferences).
Times: ``process`` (child wall time, interpreter start and imports included) and ``work`` (the run or the
call alone, modules imported before the clock starts). MB/s = input bytes / seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_ingest import OUT, generate, median_run  # noqa: E402

DROP = "prefs_1m.jsonl"


def _resources(landing: str, out: str) -> dict:
    from batchrl.resources import (
        CatalogResource, ComputeResource, LandingResource, RolloutEngineResource, StorageResource,
        TrainerLauncherResource,
    )

    return {"storage": StorageResource(root=out, cache_dir=os.path.join(out, "_cache")),
            "catalog": CatalogResource(path=os.path.join(out, "catalog.duckdb")),
            "landing": LandingResource(preferences=landing), "rollout_engine": RolloutEngineResource(),
            "trainer": TrainerLauncherResource(), "compute": ComputeResource()}


def run_assets(landing: str, out: str) -> dict:
    import dagster as dg

    from batchrl.definitions import build_definitions
    from batchrl.runs.execute import selected_job

    job = selected_job(build_definitions(_resources(landing, out)), ["raw_logs", "cleaned_logs", "validated_preferences"])
    with tempfile.TemporaryDirectory() as home, dg.DagsterInstance.local_temp(home) as instance:
        instance.add_dynamic_partitions("log_drops", [DROP])
        start = time.perf_counter()
        result = job.execute_in_process(instance=instance, partition_key=DROP, raise_on_error=False)
        seconds = time.perf_counter() - start
        assert result.success, [e.message for e in result.all_events if e.is_failure]
        meta = {k: getattr(v, "value", v) for k, v in
                instance.get_latest_materialization_event(dg.AssetKey("validated_preferences"))
                .asset_materialization.metadata.items() if k in ("rows_in", "valid", "quarantined", "duplicates")}
    return {"work_seconds": seconds, "validated": meta}


def run_assets_before(landing: str, out: str) -> dict:
    """The unpartitioned two-stage data assets of the code before log drops (``--baseline``)."""
    import dagster as dg

    from batchrl.definitions import build_definitions
    from batchrl.runs.execute import execute_assets

    with tempfile.TemporaryDirectory() as home, dg.DagsterInstance.local_temp(home) as instance:
        defs = build_definitions(_resources(landing, out))
        start = time.perf_counter()
        result = execute_assets(defs, instance, ["raw_logs", "cleaned_logs", "validated_preferences"])
        seconds = time.perf_counter() - start
        assert result.success, [e.message for e in result.all_events if e.is_failure]
        meta = instance.get_latest_materialization_event(dg.AssetKey("validated_preferences")).asset_materialization
    return {"work_seconds": seconds, "validated": {k: meta.metadata[k].value for k in
                                                  ("rows_in", "valid", "quarantined", "duplicates")}}


def run_library(landing: str, out: str) -> dict:
    from batchrl.ingest import IngestConfig, discover_inputs, ingest_logs

    start = time.perf_counter()
    _, valid = ingest_logs(discover_inputs(landing, hash_files=False), out, IngestConfig(), keep_cleaned=False)
    return {"work_seconds": time.perf_counter() - start,
            "validated": {k: getattr(valid, k) for k in ("rows_in", "valid", "quarantined", "duplicates")}}


CONTENDERS = {"assets": run_assets, "library": run_library, "before": run_assets_before}
PRELOAD = {"assets": ["batchrl.definitions"], "library": ["batchrl.ingest"], "before": ["batchrl.definitions"]}


def measure(name: str, landing: str, size: int, baseline: str | None) -> dict:
    out = os.path.join(OUT, f"run_{name}")
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=baseline) if name == "before" else None
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", name, "--landing", landing, "--out", out],
                          capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    work = result.pop("work_seconds")
    return {"name": name, "seconds": round(seconds, 2), "mb_s": round(size / 1e6 / seconds, 1),
            "work_seconds": round(work, 2), "work_mb_s": round(size / 1e6 / work, 1), "peak_rss_mb": 0, **result}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default="assets,library")
    ap.add_argument("--baseline", help="PYTHONPATH entry holding `batchrl` as it was before log drops: adds the "
                                       "contender `before` (its two-stage, unpartitioned data assets)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--child")
    ap.add_argument("--landing")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        import importlib
        import logging

        logging.disable(logging.WARNING)  # Dagster's event lines to stderr cost time the runs do not need
        for module in PRELOAD[args.child]:
            importlib.import_module(module)
        print(json.dumps(CONTENDERS[args.child](args.landing, args.out)))
        return
    landing = os.path.join(OUT, f"landing_{args.rows}")
    src = os.path.join(landing, DROP)
    if not os.path.exists(src):
        os.makedirs(landing, exist_ok=True)
        generate(src, args.rows)
    size = os.path.getsize(src)
    print(f"input {src}: {args.rows} rows, {size / 1e6:.0f} MB; load before: {os.getloadavg()}", flush=True)
    runs: dict[str, list] = {name: [] for name in args.only.split(",") + (["before"] if args.baseline else [])}
    for _ in range(args.repeat):
        for name in runs:
            r = measure(name, landing, size, args.baseline)
            runs[name].append(r)
            print(f"{name:8s} process {r['seconds']:6.2f}s {r['mb_s']:6.1f} MB/s | work {r['work_seconds']:6.2f}s "
                  f"{r['work_mb_s']:6.1f} MB/s | {r['validated']}", flush=True)
    print(f"medians (load after: {os.getloadavg()}):")
    for name, rs in runs.items():
        m = median_run(rs)
        print(f"{name:8s} process {m['seconds']:6.2f}s {m['mb_s']:6.1f} MB/s | work {m['work_seconds']:6.2f}s "
              f"{m['work_mb_s']:6.1f} MB/s | all work s {m['all_work_seconds']}")
    if not args.keep:
        shutil.rmtree(landing)


if __name__ == "__main__":
    main()
