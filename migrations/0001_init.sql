-- Executions, their lifecycle events, and the sandboxes the daemon owns.

CREATE TABLE executions (
    execution_id   TEXT PRIMARY KEY,
    request_id     TEXT,
    request_digest TEXT NOT NULL,
    state          TEXT NOT NULL,
    profile_ref    TEXT NOT NULL,
    actor          TEXT NOT NULL,
    project        TEXT NOT NULL,
    created_at_ms  BIGINT NOT NULL,
    record         TEXT NOT NULL
);
CREATE UNIQUE INDEX executions_request_id ON executions (request_id);
CREATE INDEX executions_state ON executions (state);

CREATE TABLE events (
    subject_id TEXT NOT NULL,
    sequence   BIGINT NOT NULL,
    time_ms    BIGINT NOT NULL,
    kind       TEXT NOT NULL,
    body       TEXT NOT NULL,
    PRIMARY KEY (subject_id, sequence)
);

-- Written before the sandbox is created (intent before action), so that a
-- restarted daemon can find and destroy what a crashed one left behind.
CREATE TABLE sandboxes (
    sandbox_id     TEXT PRIMARY KEY,
    subject_id     TEXT NOT NULL,
    backend        TEXT NOT NULL,
    state          TEXT NOT NULL,
    root_path      TEXT NOT NULL,
    instance_epoch TEXT NOT NULL,
    created_at_ms  BIGINT NOT NULL,
    updated_at_ms  BIGINT NOT NULL
);
CREATE INDEX sandboxes_state ON sandboxes (state);
