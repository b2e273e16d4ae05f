"""Data assets: per log drop, landing logs → cleaned → validated preference pairs in one pass; the
training window over the drops; scored logs → pairs; unpaired feedback (thumbs).

Source files are named relative to their landing root in everything that is data (``source_file``,
the manifest, the reports published as data), so the same logs at another path or on an object store
give the same data versions; the lineage keeps their full URIs for the audit."""

import json
import os
import warnings

import dagster as dg
import pydantic

from batchrl.assets.common import code_version, declared_files, output_file, publish, run_config_for, to_library_config
from batchrl.assets.data_quality import quality_metadata, reason_counts, table_metadata, top_reasons
from batchrl.assets.drops import CATALOG_POOL, LOG_DROPS, drop_content, drop_uri, landing_root
from batchrl.common import fsutil
from batchrl.ingest import IngestConfig, StageReport, check_reject_rate, discover_inputs, ingest_logs, scored_to_pairs
from batchrl.ingest.config import FeedbackLogsConfig, PreferenceDropConfig, ScoredLogsConfig
from batchrl.ingest.pairs import PairsConfig
from batchrl.ingest.window import combine_drops
from batchrl.resources import Artifact, CatalogResource, LandingResource, StorageResource
from batchrl.resources.landing import landing_input

INGEST_CODE = code_version("batchrl.ingest", "batchrl.schemas")
IngestRunConfig = run_config_for(PreferenceDropConfig, "IngestRunConfig")
ScoredLogsRunConfig = run_config_for(ScoredLogsConfig, "ScoredLogsRunConfig")
FeedbackLogsRunConfig = run_config_for(FeedbackLogsConfig, "FeedbackLogsRunConfig")
ScoredPairsConfig = run_config_for(PairsConfig, "ScoredPairsConfig")
REPORT_FILE = "report.json"
DROP_CONTENT_TAG = "batchrl/drop_content"  # set by the sensor: the drop's content key it saw


def _report(report) -> dict:
    metadata = report.to_metadata()
    # outputs are named relative to the artifact folder: the staging paths vanish after publishing
    metadata["outputs"] = {name: os.path.basename(path) for name, path in metadata.get("outputs", {}).items()}
    return metadata


def _describe(inputs) -> list[dict]:
    """The landed files for the lineage: ``path`` (relative to the landing root) and the full ``uri``."""
    return [dict(uri=f.uri, path=f.source, size=f.size, sha256=f.sha256, format=f.format) for f in inputs]


def _manifest(files: list[dict]) -> list[dict]:
    """What the data records of the landed files: no machine path (the URI stays in the lineage)."""
    return [{k: v for k, v in f.items() if k != "uri"} for f in files]


def _clean_report(clean: StageReport) -> dict:
    """The cleaning stage's accounting as published data: no timings, staging paths or machine paths."""
    report = {k: v for k, v in clean.to_metadata().items() if k not in ("seconds", "outputs", "content_hash")}
    paths = {f["uri"]: f["path"] for f in clean.extra["inputs"]}
    report["extra"] = {**{k: v for k, v in report["extra"].items() if k != "inputs"},  # inputs: in the manifest
                       "bad_files": [{"path": paths.get(b["uri"], b["uri"]), "cause": b["cause"].replace(
                           b["uri"], paths.get(b["uri"], b["uri"]))} for b in clean.extra["bad_files"]]}
    return report


def _out(kinds: set[str], description: str, reads: dict | None = None, **files: str) -> dg.AssetOut:
    return dg.AssetOut(group_name="data", code_version=INGEST_CODE, kinds=kinds, description=description,
                       metadata={**declared_files(**files), **(reads or {})})


def _drop_check(name: str, description: str) -> dg.AssetCheckSpec:
    """A blocking check of ``validated_preferences`` partitioned like it: each result belongs to its drop (the
    UI shows the check per drop, not the drops joined into one series). Dagster marks a check's partitions as
    preview; the feature is what the UI reads, so its warning stays out of every import."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return dg.AssetCheckSpec(name, asset="validated_preferences", blocking=True, partitions_def=LOG_DROPS,
                                 description=description)


@dg.multi_asset(
    outs={"raw_logs": _out({"jsonl"}, "Manifest of the drop's landed files: uri, size, sha256, format.",
                           reads=landing_input("preferences"), manifest="manifest.json"),
          "cleaned_logs": _out({"parquet"}, "The cleaning stage of the drop: decoded, BOM/control-char "
                               "stripped, NFC, field-mapped; row accounting and quarantine reasons.",
                               report=REPORT_FILE),
          "validated_preferences": _out({"parquet", "pandera"}, "The drop's rows that meet the prompt/chosen/"
                                        "rejected contract, deduplicated; the rest quarantined with reasons.",
                                        table="preferences.parquet", quarantine="quarantine.parquet",
                                        totals="totals.json")},
    internal_asset_deps={"cleaned_logs": {dg.AssetKey("raw_logs")},
                         "validated_preferences": {dg.AssetKey("cleaned_logs")}},
    check_specs=[_drop_check("nothing_lost", "rows_in == valid + quarantined + duplicates, over cleaning and "
                                             "validation together"),
                 _drop_check("reject_rate_below_threshold", "The drop's reject rate is within "
                             "IngestConfig.reject_threshold: else training stops, and later windows leave the drop out")],
    partitions_def=LOG_DROPS, pool=CATALOG_POOL, can_subset=False)
def log_drop(context: dg.AssetExecutionContext, config: IngestRunConfig, landing: LandingResource,
             storage: StorageResource, catalog: CatalogResource):
    """One log drop (a dynamic partition) in one streaming pass (``ingest_logs``): the manifest, then
    clean + contract + dedupe; one quarantine file holds both stages' rows, each stage's accounting and
    reasons stay on its own asset; the drop's blocking checks. A drop whose content differs from what the
    sensor saw fails."""
    drop = context.partition_key
    cfg = to_library_config(config, PreferenceDropConfig).model_copy(update={"storage_options": landing.storage_options})
    inputs = discover_inputs(drop_uri(landing, drop), landing.storage_options, hash_files=False,
                             root=landing_root(landing))
    with storage.staging_dir("validated_preferences") as staging:
        clean, stage = ingest_logs(inputs, staging, cfg, keep_cleaned=False)  # hashes each file as it reads it
        written = _hash_as_written(staging, stage.output_sha256)
        hashes = {f["uri"]: f["sha256"] for f in clean.extra["inputs"]}
        files = [{**f, "sha256": hashes[f["uri"]]} for f in _describe(inputs)]  # the bytes ingested
        content, expected = drop_content(landing, files), context.run.tags.get(DROP_CONTENT_TAG)
        if expected and content != expected:  # never publish other data than the run names
            raise dg.Failure(f"log drop {drop} changed since the sensor saw it (content {expected}, now "
                             f"{content}): {[f['uri'] for f in files]}")
        raw = _publish_json(context, storage, catalog, "raw_logs", "manifest.json", _manifest(files), input_files=files,
                            config={"landing": landing.preferences, "drop": drop},
                            metadata={"drop_content": content, "files": len(files),
                                      "bytes_in": sum(f["size"] for f in files), "manifest": files})
        stage = _report(stage)
        clean = _clean_report(clean)
        cleaned = _publish_json(context, storage, catalog, "cleaned_logs", REPORT_FILE, clean, input_files=files,
                                inputs={"raw_logs": raw.value}, config=config.model_dump(), metadata=clean)
        # one pass: the contract stage saw every input row; the clean stage's rejects are among its quarantined
        totals = {"rows_in": stage["rows_in"], "valid": stage["valid"], "quarantined": stage["quarantined"],
                  "duplicates": stage["duplicates"], "reject_rate": stage["quarantined"] / max(stage["rows_in"], 1)}
        quality = quality_metadata(staging, "preferences.parquet", stage["reasons"])
        validated = publish(context, storage, catalog, staging, asset="validated_preferences", content_hash=written,
                            inputs={"cleaned_logs": cleaned.value}, config=config.model_dump(),
                            sidecars={REPORT_FILE: stage, "totals.json": totals},
                            metadata={**totals, **quality, "stage": stage, "reasons_clean": clean.get("reasons", {})})
    yield from (raw, cleaned, validated)
    accounted = totals["valid"] + totals["quarantined"] + totals["duplicates"]
    yield dg.AssetCheckResult(check_name="nothing_lost", asset_key="validated_preferences",
                              passed=accounted == totals["rows_in"], metadata={**totals, "accounted": accounted})
    rejects = {code: n for code, n in stage["reasons"].items() if code != "duplicate"}  # duplicates are no rejects
    passed, description, threshold = _gate(totals, cfg.reject_threshold, rejects)
    yield dg.AssetCheckResult(check_name="reject_rate_below_threshold", asset_key="validated_preferences",
                              passed=passed, description=description,
                              metadata={"reject_rate": totals["reject_rate"], "threshold": threshold,
                                        "top_reasons": top_reasons(rejects), **reason_counts(stage["reasons"])})


def _hash_as_written(staging: str, file_sha256: dict[str, str]) -> str | None:
    """The staging folder's content hash from the hashes its writers took, when they cover every file in
    it (else None: ``publish`` reads the files); the 1M-row drop's Parquet is not read a second time."""
    return fsutil.tree_hash(file_sha256) if file_sha256 and set(os.listdir(staging)) == set(file_sha256) else None


def _publish_json(context, storage: StorageResource, catalog: CatalogResource, asset: str, name: str,
                  content, **publish_kwargs) -> dg.Output:
    """Publish an artifact whose data is one JSON file (a manifest, a stage's accounting)."""
    with storage.staging_dir(asset) as staging:
        with open(os.path.join(staging, name), "w") as f:
            json.dump(content, f, indent=2, sort_keys=True)
        return publish(context, storage, catalog, staging, asset=asset, **publish_kwargs)


def _gate(totals: dict, threshold: float, reasons: dict[str, int] | None = None) -> tuple[bool, str, float]:
    """The reject-rate gate of one drop (clean + validate together): (passed, description, threshold);
    ``reasons``: the drop's reason codes, which the description names."""
    both_stages = StageReport(stage="clean+validate", rows_in=totals["rows_in"], valid=totals["valid"],
                              quarantined=totals["quarantined"], duplicates=totals["duplicates"],
                              reasons=dict(reasons or {}))
    return (*check_reject_rate(both_stages, threshold), threshold)


def _drop_gate(drop: Artifact) -> bool:
    """Whether an ingested drop passed its gate (its totals and the threshold it was ingested with)."""
    with open(drop.file("totals")) as f:
        totals = json.load(f)
    return _gate(totals, drop.lineage["config"].get("reject_threshold", IngestConfig().reject_threshold))[0]


class WindowConfig(dg.Config):
    """Which log drops the training stages read (``preference_window``)."""

    last_drops: int = pydantic.Field(0, ge=0, description=(
        "How many of the latest log drops the training stages read: 0 = every drop (the default)."))


@dg.asset(group_name="data", code_version=code_version("batchrl.ingest.window", config=WindowConfig),
          kinds={"parquet"}, pool=CATALOG_POOL, metadata=declared_files(table="preferences.parquet"),
          ins={"validated_preferences": dg.AssetIn(partition_mapping=dg.AllPartitionMapping(),
                                                   metadata={"allow_missing_partitions": True})})
def preference_window(context: dg.AssetExecutionContext, config: WindowConfig,
                      validated_preferences: dict[str, Artifact] | None, storage: StorageResource,
                      catalog: CatalogResource) -> dg.Output:
    """The validated preferences the training stages read: every log drop (or the last K), in the order
    the drops landed, a pair seen in an earlier drop left out. Drops not yet ingested and drops that
    fail their reject-rate gate are left out and named in the metadata."""
    order = context.instance.get_dynamic_partitions(LOG_DROPS.name)
    landed = [d for d in order if d in (validated_preferences or {})]
    window = landed[-config.last_drops:] if config.last_drops else landed
    gates = {drop: _drop_gate(validated_preferences[drop]) for drop in window}
    taken = [drop for drop in window if gates[drop]]
    if not taken:
        raise dg.Failure(f"no log drop to train on: drops {order}, ingested {landed}, "
                         f"failing their gate {[d for d in window if not gates[d]]}")
    with storage.staging_dir("preference_window") as staging:
        report = combine_drops([(d, validated_preferences[d].path) for d in taken], staging)
        report.update(table_metadata(output_file(context, staging)))
        return publish(context, storage, catalog, staging, config={**config.model_dump(), "drops": taken},
                       inputs={f"validated_preferences[{d}]": validated_preferences[d] for d in taken},
                       metadata={**report, "drops": taken, "drops_not_ingested": [d for d in order if d not in landed],
                                 "drops_failing_gate": [d for d in window if not gates[d]],
                                 "drops_outside_window": [d for d in landed if d not in window]})


def _ingest_landing(context: dg.AssetExecutionContext, cfg: IngestConfig, location: str, landing: LandingResource,
                    storage: StorageResource, catalog: CatalogResource, config: dg.Config) -> dg.Output:
    """One landing location (every file in it) cleaned and validated against ``cfg.kind``'s contract in one
    pass; the quarantine and the report (accounting, reasons, how rows were mapped) beside the table. Nothing
    landed there fails naming the path (never another location's logs)."""
    asset = context.asset_key.to_user_string()
    landing_uri = landing.require(location, asset)
    cfg = cfg.model_copy(update={"storage_options": landing.storage_options})
    inputs = discover_inputs(landing_uri, landing.storage_options)
    files = _describe(inputs)
    with storage.staging_dir(asset) as staging:
        _, stage = ingest_logs(inputs, staging, cfg, keep_cleaned=False)
        report = _report(stage)
        report["extra"] = {k: v for k, v in report["extra"].items() if k != "inputs"}  # in the lineage
        metadata = {k: report[k] for k in ("rows_in", "valid", "quarantined", "duplicates", "reasons",
                                           "invariant_holds")}
        metadata["mapped"] = stage.extra["mapped"]
        metadata.update(quality_metadata(staging, os.path.basename(output_file(context, staging)), stage.reasons))
        return publish(context, storage, catalog, staging, input_files=files,
                       config={"landing": landing_uri, **config.model_dump()}, metadata=metadata,
                       sidecars={REPORT_FILE: report})


@dg.asset(group_name="data", code_version=INGEST_CODE, kinds={"parquet", "pandera"},
          metadata={**declared_files(table="scored.parquet", quarantine="quarantine.parquet"),
                    **landing_input("scored")})
def scored_logs(context: dg.AssetExecutionContext, config: ScoredLogsRunConfig, landing: LandingResource,
                storage: StorageResource, catalog: CatalogResource) -> dg.Output:
    """Scored interaction logs (prompt/response/score) cleaned and validated against their contract; the
    same mapping config as a log drop (field_mapping e.g. {rating: score}, score_values for text ratings,
    chat_mapping, ...), its kind fixed to scored."""
    return _ingest_landing(context, to_library_config(config, ScoredLogsConfig), "scored", landing,
                           storage, catalog, config)


@dg.asset(group_name="data", code_version=INGEST_CODE, kinds={"parquet", "pandera"},
          metadata={**declared_files(table="feedback.parquet", quarantine="quarantine.parquet"),
                    **landing_input("feedback")})
def feedback_logs(context: dg.AssetExecutionContext, config: FeedbackLogsRunConfig, landing: LandingResource,
                  storage: StorageResource, catalog: CatalogResource) -> dg.Output:
    """Unpaired binary feedback (thumbs): prompt / completion / label (bool, True = desirable) + metadata,
    validated against its contract, for KTO-style trainers. Labels may be true/false, 1/0, up/down, ...
    (``label_values`` adds more); a conversation's last assistant message is the completion."""
    return _ingest_landing(context, to_library_config(config, FeedbackLogsConfig), "feedback", landing,
                           storage, catalog, config)


@dg.asset(group_name="data", code_version=INGEST_CODE, kinds={"parquet"}, metadata=declared_files(table="pairs.parquet"))
def scored_pairs(context: dg.AssetExecutionContext, config: ScoredPairsConfig, scored_logs: Artifact,
                 storage: StorageResource, catalog: CatalogResource) -> dg.Output:
    """Best-vs-worst preference pairs from prompts with two or more scored responses."""
    cfg = IngestConfig(pair_min_margin=config.pair_min_margin)
    scored_dir = storage.localize(scored_logs)
    with storage.staging_dir("scored_pairs") as staging:
        metadata = _report(scored_to_pairs(os.path.join(scored_dir, "scored.parquet"), staging, cfg))
        return publish(context, storage, catalog, staging, inputs={"scored_logs": scored_logs},
                       config={"pair_min_margin": cfg.pair_min_margin}, metadata=metadata,
                       sidecars={REPORT_FILE: metadata})
