-- The raw tool output and error of a finished execution, scrubbed of
-- credential values, for its owner and adm only (GetExecution view FULL);
-- deleted with the execution's events at retention.
CREATE TABLE execution_raw (
    execution_id TEXT PRIMARY KEY,
    output       TEXT NOT NULL,
    error        TEXT NOT NULL
);
