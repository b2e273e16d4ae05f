"""Data assets: landing logs → cleaned → validated preference pairs (+ scored logs → pairs)."""

import json
import os

import dagster as dg

from batchrl.assets.common import code_version, declared_files, publish, run_config_for, to_library_config
from batchrl.ingest import (
    IngestConfig, StageReport, check_reject_rate, clean_logs, discover_inputs, scored_to_pairs,
    validate_preferences, validate_scored,
)
from batchrl.resources import Artifact, CatalogResource, LandingResource, StorageResource

INGEST_CODE = code_version("batchrl.ingest", "batchrl.schemas")
IngestRunConfig = run_config_for(IngestConfig, "IngestRunConfig")
REPORT_FILE = "report.json"


def _report(report) -> dict:
    metadata = report.to_metadata()
    # outputs are named relative to the artifact folder: the staging paths vanish after publishing
    metadata["outputs"] = {name: os.path.basename(path) for name, path in metadata.get("outputs", {}).items()}
    return metadata


def _describe(inputs) -> list[dict]:
    return [dict(uri=f.uri, size=f.size, sha256=f.sha256, format=f.format) for f in inputs]


@dg.asset(group_name="data", code_version=INGEST_CODE, kinds={"jsonl"})
def raw_logs(context: dg.AssetExecutionContext, landing: LandingResource, storage: StorageResource,
             catalog: CatalogResource) -> dg.Output:
    """Manifest of the preference logs in the landing place: every file with its size and sha256."""
    files = _describe(discover_inputs(landing.preferences, landing.storage_options))
    if not files:
        raise dg.Failure(f"no input logs found at {landing.preferences}")
    with storage.staging_dir("raw_logs") as staging:
        with open(os.path.join(staging, "manifest.json"), "w") as f:
            json.dump(files, f, indent=2, sort_keys=True)
        return publish(context, storage, catalog, staging, input_files=files,
                       config={"landing": landing.preferences},
                       metadata={"files": len(files), "bytes_in": sum(f["size"] for f in files),
                                 "manifest": files})


@dg.asset(group_name="data", code_version=INGEST_CODE, kinds={"parquet"})
def cleaned_logs(context: dg.AssetExecutionContext, config: IngestRunConfig, raw_logs: Artifact,
                 landing: LandingResource, storage: StorageResource, catalog: CatalogResource) -> dg.Output:
    """Decoded, BOM/control-char stripped, NFC-normalised, field-mapped rows; bad rows quarantined."""
    # the landing's credentials/endpoint reach the readers; run config keeps only the contract knobs
    cfg = to_library_config(config, IngestConfig).model_copy(update={"storage_options": landing.storage_options})
    with open(os.path.join(storage.localize(raw_logs), "manifest.json")) as f:
        manifest = json.load(f)
    inputs = discover_inputs(landing.preferences, landing.storage_options)
    current = {f.uri: f.sha256 for f in inputs}
    recorded = {m["uri"]: m["sha256"] for m in manifest}
    if current != recorded:  # never train on data other than what the manifest (and so the audit) names
        changed = sorted({uri for uri, _ in set(current.items()) ^ set(recorded.items())})
        raise dg.Failure(f"landing changed since raw_logs was materialised: {changed}; rematerialise raw_logs")
    with storage.staging_dir("cleaned_logs") as staging:
        metadata = _report(clean_logs(inputs, staging, cfg))
        return publish(context, storage, catalog, staging, inputs={"raw_logs": raw_logs},
                       config=config.model_dump(), input_files=manifest, metadata=metadata,
                       sidecars={REPORT_FILE: metadata})


@dg.asset(group_name="data", code_version=INGEST_CODE, kinds={"parquet", "pandera"},
          metadata=declared_files(table="preferences.parquet", quarantine="quarantine.parquet"))
def validated_preferences(context: dg.AssetExecutionContext, config: IngestRunConfig, cleaned_logs: Artifact,
                          storage: StorageResource, catalog: CatalogResource) -> dg.Output:
    """Rows that meet the prompt/chosen/rejected contract, deduplicated; the rest quarantined with reasons."""
    cfg = to_library_config(config, IngestConfig)
    cleaned_dir = storage.localize(cleaned_logs)
    with open(os.path.join(cleaned_dir, REPORT_FILE)) as f:
        cleaned = json.load(f)
    with storage.staging_dir("validated_preferences") as staging:
        stage = _report(validate_preferences(cleaned_dir, staging, cfg))
        # Accounting across both stages: every landed row is valid, quarantined or a duplicate.
        totals = {
            "rows_in": cleaned["rows_in"],
            "valid": stage["valid"],
            "quarantined": cleaned["quarantined"] + stage["quarantined"],
            "duplicates": cleaned.get("duplicates", 0) + stage["duplicates"],
        }
        totals["reject_rate"] = totals["quarantined"] / max(totals["rows_in"], 1)
        return publish(context, storage, catalog, staging, inputs={"cleaned_logs": cleaned_logs},
                       config=config.model_dump(), sidecars={REPORT_FILE: stage, "totals.json": totals},
                       metadata={**totals, "stage": stage, "reasons_clean": cleaned.get("reasons", {})})


def _totals(storage: StorageResource, ref: dict) -> dict:
    with open(os.path.join(storage.localize(ref), "totals.json")) as f:
        return json.load(f)


@dg.asset_check(asset=validated_preferences, blocking=True)
def nothing_lost(validated_preferences: Artifact, storage: StorageResource) -> dg.AssetCheckResult:
    """rows_in == valid + quarantined + duplicates, over cleaning and validation together."""
    t = _totals(storage, validated_preferences)
    accounted = t["valid"] + t["quarantined"] + t["duplicates"]
    return dg.AssetCheckResult(passed=accounted == t["rows_in"], metadata={**t, "accounted": accounted})


@dg.asset_check(asset=validated_preferences, blocking=True)
def reject_rate_below_threshold(validated_preferences: Artifact, storage: StorageResource) -> dg.AssetCheckResult:
    """Stops downstream training when too many landed rows were rejected (threshold from IngestConfig)."""
    t = _totals(storage, validated_preferences)
    lineage = storage.read_lineage(validated_preferences)
    threshold = lineage["config"].get("reject_threshold", IngestConfig().reject_threshold)
    both_stages = StageReport(stage="clean+validate", rows_in=t["rows_in"], valid=t["valid"],
                              quarantined=t["quarantined"], duplicates=t["duplicates"])
    passed, description = check_reject_rate(both_stages, threshold)
    return dg.AssetCheckResult(passed=passed, description=description,
                               metadata={"reject_rate": t["reject_rate"], "threshold": threshold})


@dg.asset(group_name="data", code_version=INGEST_CODE, kinds={"parquet", "pandera"})
def scored_logs(context: dg.AssetExecutionContext, landing: LandingResource, storage: StorageResource,
                catalog: CatalogResource) -> dg.Output:
    """Scored interaction logs (prompt/response/score) cleaned and validated against their contract."""
    cfg = IngestConfig(kind="scored", storage_options=landing.storage_options)
    inputs = discover_inputs(landing.scored, landing.storage_options)
    files = _describe(inputs)
    with storage.staging_dir("scored_logs") as staging:
        cleaned_dir = os.path.join(staging, "cleaned")
        cleaned = clean_logs(inputs, cleaned_dir, cfg)
        stage = validate_scored(cleaned_dir, staging, cfg)
        metadata = {"rows_in": cleaned.rows_in, "valid": stage.valid,
                    "quarantined": cleaned.quarantined + stage.quarantined, "duplicates": stage.duplicates}
        return publish(context, storage, catalog, staging, input_files=files,
                       config={"landing": landing.scored}, metadata=metadata, sidecars={REPORT_FILE: metadata})


@dg.asset(group_name="data", code_version=INGEST_CODE, kinds={"parquet"}, metadata=declared_files(table="pairs.parquet"))
def scored_pairs(context: dg.AssetExecutionContext, scored_logs: Artifact, storage: StorageResource,
                 catalog: CatalogResource) -> dg.Output:
    """Best-vs-worst preference pairs from prompts with two or more scored responses."""
    cfg = IngestConfig()
    scored_dir = storage.localize(scored_logs)
    with storage.staging_dir("scored_pairs") as staging:
        metadata = _report(scored_to_pairs(os.path.join(scored_dir, "scored.parquet"), staging, cfg))
        return publish(context, storage, catalog, staging, inputs={"scored_logs": scored_logs},
                       config={"pair_min_margin": cfg.pair_min_margin}, metadata=metadata,
                       sidecars={REPORT_FILE: metadata})
