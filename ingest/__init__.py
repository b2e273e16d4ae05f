"""The data plane: discover -> clean -> validate (pandera contract) -> preference pairs.

    from batchrl.ingest import IngestConfig, discover_inputs, clean_logs, validate_preferences
    files = discover_inputs("sample_data/preferences")
    cleaned = clean_logs(files, "out/cleaned", IngestConfig())
    prefs = validate_preferences("out/cleaned", "out/validated", IngestConfig())
    assert prefs.rows_in == prefs.valid + prefs.quarantined + prefs.duplicates
"""
from batchrl.ingest.clean import clean_logs
from batchrl.ingest.config import (
    REASONS, ChatMapping, IngestConfig, IngestError, StageReport, check_reject_rate,
)
from batchrl.ingest.discover import InputFile, discover_inputs
from batchrl.ingest.faults import BadInputFiles
from batchrl.ingest.pairs import scored_to_pairs
from batchrl.ingest.row_error import RowError
from batchrl.ingest.validate import ingest_logs, validate_feedback, validate_preferences, validate_scored

__all__ = [
    "BadInputFiles", "REASONS", "ChatMapping", "IngestConfig", "IngestError", "InputFile", "RowError", "StageReport",
    "check_reject_rate", "clean_logs", "ingest_logs", "discover_inputs", "scored_to_pairs", "validate_feedback",
    "validate_preferences", "validate_scored",
]
