"""pandera schemas and Arrow schemas of the data contracts."""
from batchrl.schemas.contracts import (  # noqa: F401
    ARROW_SCHEMAS, PANDERA_SCHEMAS, PREFERENCE_ARROW, QUARANTINE_ARROW, SCORED_ARROW, TEXT_FIELDS,
    PreferenceSchema, ScoredSchema, contract_violations, to_pandas,
)
