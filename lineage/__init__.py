"""What an artifact's lineage is and how it is read back: code versions that follow imports, the environment a
stage ran in, the record published beside each artifact (secrets redacted), the audit of a lineage tree, the
catalog's queries across artifacts and Dagster's staleness."""
