-- Sessions: a harness that takes several turns in one sandbox.

CREATE TABLE sessions (
    session_id    TEXT PRIMARY KEY,
    state         TEXT NOT NULL,
    profile_ref   TEXT NOT NULL,
    actor         TEXT NOT NULL,
    project       TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    record        TEXT NOT NULL
);
