"""Running the code location's assets: executing a selection (per log drop, then the rest; one step at a time or in
forked step processes), the log drops still to ingest, the run-config checks made before anything starts, the step
server and what it preloads, and `batchrl reproduce`'s re-materialisation of an artifact's lineage."""
