"""Data quality per log drop as the UI shows it: reason counts as numbers, a quarantined sample, the validated
table's row count and schema, and the drop's check results attached to the drop, naming its reasons."""
from __future__ import annotations

import json
import shutil

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
from pipeline_helpers import local_resources, run_assets

from batchrl.assets.data_quality import quarantine_sample, top_reasons
from batchrl.resources import LandingResource

DATA = ["raw_logs", "cleaned_logs", "validated_preferences"]


def _materialisations(instance: dg.DagsterInstance, asset: str) -> dict[str, dict]:
    records = instance.fetch_materializations(dg.AssetKey(asset), limit=100).records
    return {r.asset_materialization.partition: r.asset_materialization.metadata for r in records}


def test_each_drop_shows_its_reasons_sample_rows_and_schema(tmp_path):
    prefs = tmp_path / "landing" / "preferences"
    shutil.copytree(LandingResource().preferences, prefs)
    with open(prefs / "zz_broken.jsonl", "w") as f:  # a third drop that fails its gate on empty answers
        for i in range(30):
            f.write(json.dumps({"prompt": f"q{i}", "chosen": "", "rejected": "x"}) + "\n")
        f.write('{"prompt": "half a line\n')
    with dg.DagsterInstance.ephemeral() as instance:
        result = run_assets(local_resources(str(tmp_path / "s"), LandingResource(preferences=str(prefs))), instance, DATA)
        validated = _materialisations(instance, "validated_preferences")
        for drop, metadata in validated.items():
            stage = metadata["stage"].value
            counts = {k.removeprefix("reason/"): v.value for k, v in metadata.items() if k.startswith("reason/")}
            assert counts == stage["reasons"] and counts, drop  # one number per reason code
            assert metadata["dagster/row_count"].value == stage["valid"]
            columns = {c.name: c.type for c in metadata["dagster/column_schema"].schema.columns}
            assert {"prompt": "string", "chosen": "string", "rejected": "string", "source_line": "int64"}.items() <= columns.items()
            sample = [r.data for r in metadata["quarantine_sample"].records]
            assert {row["reason"] for row in sample} == set(stage["reasons"])  # every code shows, at most twice
            assert all(row["source_file"] == drop and row["source_line"] > 0 for row in sample)
        assert validated["zz_broken.jsonl"]["reason/empty_field"].value == 30
        assert validated["zz_broken.jsonl"]["reason/invalid_json"].value == 1

        checks = [e.event_specific_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]
        for run in instance.get_runs():
            for event in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION):
                checks.append(event.dagster_event.event_specific_data)
        gates = {c.partition: c for c in checks if c.check_name == "reject_rate_below_threshold"}
        assert set(gates) == set(validated)  # each result carries its drop
        broken = gates["zz_broken.jsonl"]
        assert not broken.passed and "reasons: empty_field=30, invalid_json=1" in broken.description
        assert broken.metadata["top_reasons"].value == "empty_field=30, invalid_json=1"
        for drop in ("prefs_000.jsonl", "prefs_001.jsonl"):
            reasons = {k for k in validated[drop] if k.startswith("reason/") and k != "reason/duplicate"}
            assert "reasons: none" not in gates[drop].description and reasons
            assert all(k.removeprefix("reason/") in gates[drop].description for k in reasons)


def test_quarantine_sample_escapes_control_characters_and_caps_rows(tmp_path):
    path = str(tmp_path / "quarantine.parquet")
    rows = [{"reason": "wrong_type", "detail": "bell\x07", "source_file": "a.jsonl", "source_line": i + 1,
             "raw": "x\x1b[31my" + "z" * 500} for i in range(5)]
    rows.append({"reason": "invalid_json", "detail": "", "source_file": "a.jsonl", "source_line": 9, "raw": "{"})
    pq.write_table(pa.Table.from_pylist(rows), path)
    sample = [r.data for r in quarantine_sample(path, per_reason=2).records]
    assert [row["source_line"] for row in sample] == [1, 2, 9]
    assert sample[0]["detail"] == "bell\\x07" and sample[0]["raw"].startswith("x\\x1b[31my") and len(sample[0]["raw"]) < 200
    assert quarantine_sample(str(tmp_path / "absent.parquet")) is None
    assert top_reasons({"a": 1, "b": 5, "c": 1, "d": 2}, n=2) == "b=5, d=2 (+2 more codes)" and top_reasons({}) == "none"
