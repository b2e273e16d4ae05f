"""pandera schemas and Arrow schemas of the data contracts."""
from batchrl.schemas.contracts import (  # noqa: F401
    ARROW_SCHEMAS, FEEDBACK_ARROW, PANDERA_SCHEMAS, PREFERENCE_ARROW, QUARANTINE_ARROW, SCORED_ARROW, TEXT_FIELDS,
    VALUE_FIELDS,
    FeedbackSchema, PreferenceSchema, ScoredSchema, contract_violations, to_pandas,
)
